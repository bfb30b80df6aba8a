"""POST /v1/responses (OpenAI's Responses API): a string or a list of messages in, with
instructions as a system message first; a Response object out, or OpenAI's typed events
streamed; every field of OpenAI's request honoured or refused by name (the table below has a
row for each field of the openai package's ResponseCreateParams, when it is installed). The
real server on a loopback port."""
import json

import pytest

from test_server import Running, httpx  # (it skips without the server's packages)
from test_server_abuse import assert_openai_error

from nano.server.fields import refused  # noqa: E402
from nano.server.schemas import ResponsesRequest  # noqa: E402

try:
    from openai.types.responses import Response, ResponseStreamEvent
    from openai.types.responses.response_create_params import ResponseCreateParamsStreaming
    from pydantic import TypeAdapter
except ImportError:  # the checks against openai's own types are skipped
    Response = None

PATH = "/v1/responses"
BASE = {"input": "The sky is", "max_output_tokens": 2}
HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "metadata",
            "user", "safety_identifier"}
# A value for each field that asks for something (a refused field: not null nor one of its "off" values).
VALUES = {
    "model": "MODEL", "input": [{"role": "user", "content": "Hi"}], "instructions": "Be brief.", "max_output_tokens": 3,
    "temperature": 0.5, "top_p": 0.9, "stream": True, "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s",
    "store": True, "background": True, "background_options": {"completion_window": "2h"},
    "previous_response_id": "resp_1", "conversation": "conv_1", "context_management": [{"type": "compaction"}],
    "prompt": {"id": "pmpt_1"}, "text": {"format": {"type": "json_object"}},
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required",
    "parallel_tool_calls": False, "max_tool_calls": 2, "reasoning": {"effort": "low"},
    "include": ["message.output_text.logprobs"], "truncation": "auto", "top_logprobs": 2,
    "stream_options": {"include_obfuscation": True}, "service_tier": "flex", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"}, "access_programs": {"cyber": "standard"},
    "image": {"context_compression": "auto"}, "moderation": {"model": "omni-moderation-latest"},
}
COMPANIONS = {"stream_options": {"stream": True}}
# Values refused within an honoured-looking field (a format other than text, a tool choice with no tools ...).
ALSO_REFUSED = [("text", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}),
                ("text", {"format": {"type": "text"}, "verbosity": "low"}), ("tool_choice", {"type": "function", "name": "f"}),
                ("tools", [{"type": "web_search"}])]


@pytest.fixture(scope="module")
def srv():
    running = Running(max_queued=16)
    yield running
    running.stop()


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + PATH, json=body, timeout=120)


def events_of(r: httpx.Response) -> list[dict]:
    """A stream's events, each checked: its SSE event name is its type."""
    out, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            event = json.loads(line.split(":", 1)[1])
            assert event["type"] == name, (name, event)
            out.append(event)
    return out


def parsed(body: dict):
    """The body as the openai client's model reads it (None without the openai package)."""
    return None if Response is None else Response.model_validate(body)


def test_a_string_input_answers_a_response(srv):
    r = post(srv, {"model": srv.model, "input": "What is the capital of France?", "max_output_tokens": 12,
                   "temperature": 0, "metadata": {"k": "v"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["model"] == srv.model
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    [part] = message["content"]
    assert part["type"] == "output_text" and part["text"] and part["annotations"] == []
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > usage["input_tokens"] > 0
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0} and "cached_tokens" in usage["input_tokens_details"]
    assert body["store"] is False and body["tools"] == [] and body["metadata"] == {"k": "v"}
    assert body["status"] == ("incomplete" if usage["output_tokens"] == 12 else "completed")
    response = parsed(body)
    assert response is None or response.output_text == part["text"]


def test_instructions_are_a_system_message_before_the_input(srv):
    """The prompt the engine gets is the chat template's, instructions first: the same tokens as
    the chat endpoint's for the same conversation (input_tokens counts them)."""
    system, user = "Answer with one word.", [{"type": "input_text", "text": "What color"},
                                             {"type": "input_text", "text": "is the sky?"}]
    r = post(srv, {"instructions": system, "max_output_tokens": 4, "temperature": 0,
                   "input": [{"role": "user", "content": "Hi"}, {"type": "message", "role": "assistant",
                                                                  "content": [{"type": "output_text", "text": "Hello."}]},
                             {"type": "message", "role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    chat = httpx.post(srv.url + "/v1/chat/completions", json={"max_tokens": 4, "temperature": 0, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What color\nis the sky?"}]}).json()
    body = r.json()
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["instructions"] == system
    parsed(body)


def test_max_output_tokens_cut_short_is_incomplete(srv):
    r = post(srv, {"input": "Tell me a long story.", "max_output_tokens": 3, "temperature": 0})
    body = r.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3 and body["max_output_tokens"] == 3
    assert body["output"][0]["status"] == "incomplete"
    parsed(body)


@pytest.mark.parametrize("max_output_tokens", [3, 40])
def test_the_stream_is_openais_events_in_order_and_its_text_the_responses(srv, max_output_tokens):
    body = {"input": "What is the capital of France?", "instructions": "Be brief.", "temperature": 0,
            "max_output_tokens": max_output_tokens}
    whole = post(srv, body).json()
    r = post(srv, {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r)
    kinds = [e["type"] for e in events]
    last = f"response.{whole['status']}"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = whole["output"][0]["content"][0]["text"]
    assert "".join(deltas) == text and events[-4]["text"] == text and events[-3]["part"]["text"] == text
    final = events[-1]["response"]
    assert final["output"] == [{**whole["output"][0], "id": final["output"][0]["id"]}]
    same = ("input_tokens", "output_tokens", "total_tokens")  # (the second one's prompt is in the prefix cache)
    assert [final["usage"][k] for k in same] == [whole["usage"][k] for k in same] and final["status"] == whole["status"]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    if Response is not None:
        for event in events:
            TypeAdapter(ResponseStreamEvent).validate_python(event)


def test_the_openai_client_reads_it(srv):
    if Response is None:
        pytest.skip("the openai package is not installed")
    kw = dict(model=srv.model, input="What is the capital of France?", instructions="Answer in one sentence.",
              max_output_tokens=12, temperature=0)
    out = srv.client.responses.create(**kw)
    streamed = [e for e in srv.client.responses.create(**kw, stream=True)]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == out.output_text
    with srv.client.responses.stream(**{**kw, "max_output_tokens": 64}) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text.startswith(out.output_text)


def test_the_table_has_a_row_for_every_field():
    fields = set(ResponsesRequest.model_fields)
    assert fields <= set(VALUES), "fields without a row: add them to VALUES"
    assert set(refused(ResponsesRequest)) == fields - HONOURED
    if Response is None:
        pytest.skip("the openai package is not installed: its request fields are not compared")
    openai_fields = ResponseCreateParamsStreaming.__required_keys__ | ResponseCreateParamsStreaming.__optional_keys__
    assert openai_fields <= fields, f"openai's request fields without a row: {sorted(openai_fields - fields)}"


def test_every_field_is_honoured_or_refused_by_name(srv):
    for name in ResponsesRequest.model_fields:
        value = srv.model if VALUES[name] == "MODEL" else VALUES[name]
        r = post(srv, {**BASE, **COMPANIONS.get(name, {}), name: value})
        if name in HONOURED:
            assert r.status_code == 200, (name, r.text)
        else:
            assert_openai_error(r, 400, "nano does not implement this field")
            assert r.json()["error"]["param"] == name, r.text
    for name, value in ALSO_REFUSED:
        r = post(srv, {**BASE, name: value})
        assert_openai_error(r, 400, "nano does not implement this field")
        assert r.json()["error"]["param"] == name, r.text


def test_a_refused_field_set_off_is_taken(srv):
    """Null, and each value that asks for nothing (store false, tool_choice "auto", text format text ...)."""
    offs = refused(ResponsesRequest)
    for i in range(max(map(len, offs.values())) + 1):
        body = {**BASE, **{name: [None, *values][i % (len(values) + 1)] for name, values in offs.items()}}
        r = post(srv, body)
        assert r.status_code == 200, (body, r.text)
        parsed(r.json())


@pytest.mark.parametrize("body, param, text", [
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}, "input", "'function_call_output'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input", "'function_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "'input_file'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "'role'"),
    ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input", "'colour'"),
    ({"input": []}, "input", "non-empty"),
    ({"colour": "red"}, "colour", "an unknown field"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal"),
    ({"temperature": -1}, "temperature", "greater than or equal"),
])
def test_what_the_server_cannot_take_is_a_400_naming_it(srv, body, param, text):
    r = post(srv, {**BASE, **body})
    assert_openai_error(r, 400, text)
    assert r.json()["error"]["param"] == param


def test_another_model_is_a_404_and_a_rejected_prompt_a_400(srv):
    assert_openai_error(post(srv, {**BASE, "model": "gpt-4"}), 404, "does not exist")
    long = " ".join(["word"] * (srv.engine.max_model_len + 10))
    assert_openai_error(post(srv, {**BASE, "input": long}), 400, "maximum context length")
    assert srv.idle()


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_is_a_500_or_an_error_event_then_response_failed(srv, monkeypatch, stream):
    server = srv.app.state.server
    submit = server.submit

    async def failing(*args, **kw):  # the job's first event: the engine failed
        jobs = await submit(*args, **kw)
        jobs[0].events.put_nowait({"error": "planted", "status": 500})
        return jobs
    monkeypatch.setattr(server, "submit", failing)
    r = post(srv, {"input": "Tell me a long story.", "max_output_tokens": 64, "stream": stream})
    if not stream:
        assert_openai_error(r, 500, "planted")
    else:
        events = events_of(r)
        assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
        assert events[-2]["message"] == "planted" and events[-1]["response"]["status"] == "failed"
        assert events[-1]["response"]["error"] == {"code": "server_error", "message": "planted"}
        if Response is not None:
            for event in events:
                TypeAdapter(ResponseStreamEvent).validate_python(event)
    assert srv.idle()


def test_a_client_that_leaves_mid_stream_leaves_nothing_behind(srv):
    with httpx.stream("POST", srv.url + PATH, timeout=60, json={
            "input": "Count from 1 to 1000, one number per line.", "max_output_tokens": 3000, "temperature": 0,
            "stream": True}) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += '"response.output_text.delta"' in line and line.startswith("data:")
            if deltas >= 3:
                break  # closing the response drops the connection
    assert deltas == 3 and srv.idle(timeout=5), srv.engine.scheduler.running
