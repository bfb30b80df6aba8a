"""POST /v1/responses (OpenAI's Responses API): a string or a list of messages in, with
instructions as a system message first; a Response object out, or OpenAI's typed events
streamed; structured output (text.format) and function tools, as the chat endpoint serves them;
every field of OpenAI's request honoured or refused by name (the table below has a row for each
field of the openai package's ResponseCreateParams, when it is installed). The real server on a
loopback port, with a tool-use template and the hermes parser (as test_server_tools')."""
import json

import pytest

from test_server import httpx  # (it skips without the server's packages)
from test_server_abuse import assert_openai_error
from test_server_tools import srv  # noqa: F401 (the fixture: a server with a tools template, the hermes parser)

from nano.server import tools  # noqa: E402
from nano.server.fields import refused  # noqa: E402
from nano.server.responses_schemas import ResponsesRequest  # noqa: E402

try:
    from openai.types.responses import Response, ResponseStreamEvent
    from openai.types.responses.response_create_params import ResponseCreateParamsStreaming
    from pydantic import TypeAdapter
except ImportError:  # the checks against openai's own types are skipped
    Response = None

PATH = "/v1/responses"
DEEP = "[" * 500 + "]" * 500  # JSON nested deeper than the template's recursion can take
DEEP_SCHEMA = json.loads("{\"a\": " * 300 + "{}" + "}" * 300)
BASE = {"input": "The sky is", "max_output_tokens": 2}
HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "metadata",
            "user", "safety_identifier", "text", "tools", "tool_choice", "parallel_tool_calls"}
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
COMPANIONS = {"stream_options": {"stream": True}, "tool_choice": {"tools": VALUES["tools"]}}
# Values refused within an honoured field.
ALSO_REFUSED = [("text", {"format": {"type": "text"}, "verbosity": "low"}, "text.verbosity")]


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
    last = "response.completed"  # vLLM's last event whatever the status inside (the openai client waits for it)
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
    for name, value, param in ALSO_REFUSED:
        r = post(srv, {**BASE, name: value})
        assert_openai_error(r, 400, "nano does not implement this field")
        assert r.json()["error"]["param"] == param, r.text


def test_a_refused_field_set_off_is_taken(srv):
    """Null, and each value that asks for nothing (store false, tool_choice "auto", text format text ...)."""
    offs = refused(ResponsesRequest)
    for i in range(max(map(len, offs.values())) + 1):
        body = {**BASE, **{name: [None, *values][i % (len(values) + 1)] for name, values in offs.items()}}
        r = post(srv, body)
        assert r.status_code == 200, (body, r.text)
        parsed(r.json())


@pytest.mark.parametrize("body, param, text", [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input",
     "'arguments' must be a JSON string"),
    ({"input": [{"type": "function_call_output", "output": "4"}]}, "input", "'call_id' is required"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": DEEP}]}, "input",
     "item 0: 'arguments' must be a JSON string holding an object (nests deeper than 64 levels)"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"x": NaN}'}]}, "input",
     "NaN is not JSON"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}, "input",
     "item 0: No tool call found for function call output with call_id c."),
    ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "b", "output": "4"}]}, "input", "with call_id b."),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": DEEP_SCHEMA}}]},
     "tools", "tool 0: 'parameters' nests deeper than 64 levels"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 items"),
    ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65, "at most 64 characters"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "at most 512 characters"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search': nano calls function tools only"),
    ({"tools": [{"type": "function", "name": "f", "colour": 1}]}, "tools", "'colour' is an unknown field"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools", "JSON schema of an"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "function tools only"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format", "needs its name"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format", "'schema' goes with type json_schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "two"}}}},
     "text.format", "text.format"),
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


def test_metadata_is_taken_up_to_openais_bounds(srv):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # 16 keys, 64 characters each, values of 512
    r = post(srv, {**BASE, "metadata": metadata})
    assert r.status_code == 200 and r.json()["metadata"] == metadata, r.text


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


# ---- structured output: text.format ------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                        "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_format_answers_json_valid_against_it(srv, stream):
    import jsonschema
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    r = post(srv, {"input": "Name a large city and its population.", "text": {"format": fmt}, "max_output_tokens": 60,
                   "temperature": 0, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        events = events_of(r)
        body = events[-1]["response"]
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
            body["output"][0]["content"][0]["text"]
    else:
        body = r.json()
    assert body["status"] == "completed" and body["text"] == {"format": fmt}
    jsonschema.validate(json.loads(body["output"][0]["content"][0]["text"]), CITY)
    parsed(body)


def test_a_json_object_format_answers_json(srv):
    r = post(srv, {"input": "Describe Paris as JSON.", "text": {"format": {"type": "json_object"}},
                   "max_output_tokens": 40, "temperature": 0})
    body = r.json()
    if body["status"] == "completed":
        assert isinstance(json.loads(body["output"][0]["content"][0]["text"]), (dict, list))
    assert body["text"] == {"format": {"type": "json_object"}}


def test_the_openai_clients_parse_reads_the_output_into_the_model(srv):
    if Response is None:
        pytest.skip("the openai package is not installed")
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        population: int
    out = srv.client.responses.parse(model=srv.model, input="Name a large city and its population.", text_format=City,
                                     max_output_tokens=60, temperature=0)
    assert isinstance(out.output_parsed, City) and out.output_parsed.city


# ---- function tools ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "additionalProperties": False}, "strict": True}
ASK = "Weather in Paris? And the time in CET?"


def calls_in(output: list[dict]) -> list[dict]:
    calls = [item for item in output if item["type"] == "function_call"]
    for c in calls:
        assert c["id"].startswith("fc_") and c["call_id"].startswith("call_") and c["status"] == "completed"
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_a_forced_choice_gives_function_calls_whole_and_streamed(srv, choice):
    import jsonschema
    body = {"input": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "max_output_tokens": 60, "temperature": 0}
    whole = post(srv, body).json()
    calls = calls_in(whole["output"])
    assert calls and whole["output"] == calls and whole["status"] == "completed"  # no message: no text
    parameters = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), parameters[call["name"]])
    if isinstance(choice, dict):
        assert [c["name"] for c in calls] == ["get_time"]
    assert whole["tools"] == [WEATHER, {**TIME, "description": None}] and whole["tool_choice"] == choice
    events = events_of(post(srv, {**body, "stream": True}))
    per_call = ["response.output_item.added", "response.function_call_arguments.delta",
                "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", *per_call * len(calls),
                                           "response.completed"]
    final = events[-1]["response"]["output"]
    assert [(c["name"], c["arguments"]) for c in calls_in(final)] == [(c["name"], c["arguments"]) for c in calls]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["arguments"] for a in added] == [""] * len(calls) and [a["id"] for a in added] == [c["id"] for c in final]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == [c["arguments"] for c in calls]
    if Response is not None:
        for event in events:
            TypeAdapter(ResponseStreamEvent).validate_python(event)
        parsed(whole)


def test_a_call_the_model_writes_is_read_back_after_its_text(srv, monkeypatch):
    from test_server_tools import ONE, fake_output
    fake_output(srv, monkeypatch, ["Let me check.\n<tool", "_call>\n{\"name\": \"get_weather\", ",
                                   "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"])
    body = {"input": "Weather in Paris?", "tools": [WEATHER]}  # tool_choice "auto": the server's parser
    whole = post(srv, body).json()
    message, call = whole["output"]
    assert message["content"][0]["text"] == "Let me check.\n"
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    events = events_of(post(srv, {**body, "stream": True}))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call"]
    # tool_choice "none": the text as written; parallel_tool_calls false: the first call only
    fake_output(srv, monkeypatch, [ONE + ONE])
    assert post(srv, {**body, "tool_choice": "none"}).json()["output"][0]["content"][0]["text"] == ONE + ONE
    assert len(calls_in(post(srv, body).json()["output"])) == 2
    assert len(calls_in(post(srv, {**body, "parallel_tool_calls": False}).json()["output"])) == 1
    events = events_of(post(srv, {**body, "parallel_tool_calls": False, "stream": True}))
    assert len(calls_in(events[-1]["response"]["output"])) == 1


def test_auto_needs_the_flags(srv, monkeypatch):
    monkeypatch.setattr(srv.app.state.server, "auto_tools", False)
    for extra in ({}, {"tool_choice": "auto"}):  # with tools, "auto" is the default
        r = post(srv, {**BASE, "tools": [WEATHER], **extra})
        assert_openai_error(r, 400, tools.AUTO_NEEDS_FLAGS)
        assert r.json()["error"]["param"] == "tool_choice"
    assert post(srv, {**BASE, "tools": [WEATHER], "tool_choice": "none"}).status_code == 200
    assert post(srv, {**BASE, "tool_choice": "auto"}).status_code == 200  # OpenAI's default, with no tools: nothing


def test_function_call_items_and_their_outputs_reach_the_template(srv):
    """An agent's next turn: the call an earlier response made and what it returned, as chat's
    assistant tool_calls and tool message (the prompt: the same tokens as /tokenize's)."""
    from test_server_tools import HISTORY
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city":"Paris"}', "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
    r = post(srv, {"input": items, "tools": [WEATHER], "tool_choice": "none", "max_output_tokens": 1})
    assert r.status_code == 200, r.text
    nested = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    tokenized = httpx.post(srv.url + "/tokenize", json={"messages": HISTORY, "tools": nested}).json()
    assert r.json()["usage"]["input_tokens"] == tokenized["count"]
    text = httpx.post(srv.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and "18 C, sunny" in text


def test_the_openai_clients_stream_gets_its_final_response_when_cut_short(srv):
    """openai's responses.stream() takes response.completed as the end, whatever the status in it."""
    with srv.client.responses.stream(model=srv.model, input="Tell me a long story.", max_output_tokens=5) as stream:
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.output_text
