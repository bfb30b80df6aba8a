"""Tool calls on the chat endpoint (nano/server/tools.py, tool_parsers.py), as vLLM serves them:
the tools and earlier calls reach the chat template (--chat-template, tests/data/hermes_tools.jinja),
the hermes parser reads calls back from a text whole or streamed, tool_choice's checks, and the
schemas and parsing for forced calls. The real server on a loopback port; for what the model
would have to write, an engine output put in its place (fake_output)."""
import asyncio
import json
from pathlib import Path

import pytest

from test_server import Running, httpx  # (it skips without the server's packages)
from test_server_abuse import assert_openai_error

from nano.chat import template  # noqa: E402
from nano.errors import NanoError  # noqa: E402
from nano.server import tool_parsers, tools  # noqa: E402
from nano.server.engine_thread import Job  # noqa: E402
from nano.server.tool_parsers import Hermes  # noqa: E402

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"},
]
HERMES = Hermes(["get_weather", "get_time", "f"])  # the parser, for a request with these tools
DEEP = "[" * 500 + "]" * 500  # JSON nested deeper than the template's recursion can take
ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


@pytest.fixture(scope="module")
def srv():
    running = Running(max_queued=16, app={"chat_template": template.load(str(TEMPLATE)), "tool_parser": "hermes",
                                          "auto_tools": True})
    yield running
    running.stop()


def post(srv, body: dict, path: str = CHAT):
    return httpx.post(srv.url + path, json={**({"max_tokens": 2} if path == CHAT else {}), **body}, timeout=120)


def fake_output(srv, monkeypatch, pieces: list[str]):
    """Each choice's engine output is these text pieces (the last one finishing it), in place of
    the model's: the request is checked and tokenized as ever, then gets these events."""
    server = srv.app.state.server

    async def submit(body, prompts, stops, top_logprobs, max_tokens, echo=False, grammar=None):
        jobs = []
        for prompt in prompts:
            for _ in range(body.n):
                job = Job(prompt, None, stops, top_logprobs, asyncio.Queue(), asyncio.get_running_loop())
                for k, text in enumerate(pieces):
                    job.events.put_nowait({"text": text, "completion_tokens": k + 1, "cached_tokens": 0,
                                           "finish_reason": "stop" if k == len(pieces) - 1 else None})
                jobs.append(job)
        server.open.update(jobs)
        return jobs
    monkeypatch.setattr(server, "submit", submit)


# ---- the template gets the tools and the earlier calls -------------------------------------------------
def test_the_template_gets_the_tools_the_calls_and_their_results(srv):
    r = post(srv, {"messages": HISTORY, "tools": [WEATHER]}, "/tokenize")
    assert r.status_code == 200, r.text
    text = httpx.post(srv.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in text
    # the arguments reach the template parsed, as vLLM passes them: tojson respaces the client's JSON
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    # the same text as transformers' apply_chat_template would render, tokenized with special tokens special
    tokenizer = srv.engine.tokenizer
    parsed = [{**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]} if i == 1 else m for i, m in enumerate(HISTORY)]
    rendered = template.render(tokenizer, [{**m, "content": m["content"] or ""} for m in parsed], tools=[WEATHER],
                               chat_template=TEMPLATE.read_text())
    assert rendered == text
    # and the chat endpoint tokenizes the same prompt
    assert post(srv, {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"}).json()["usage"][
        "prompt_tokens"] == r.json()["count"]


def test_special_token_text_in_a_tool_stays_text(srv):
    tool = {"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}
    tokens = post(srv, {"messages": [{"role": "user", "content": "Hi"}], "tools": [tool]}, "/tokenize").json()["tokens"]
    im_end = srv.engine.tokenizer.encode("<|im_end|>")
    assert tokens.count(im_end[0]) == 2  # the system turn's and the user's end, not the description's


def test_load_takes_a_path_or_a_template():
    assert template.load(str(TEMPLATE)) == TEMPLATE.read_text()
    assert template.load("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"
    with pytest.raises(NanoError, match="looks like a file path"):
        template.load("no/such/template.jinja")


# ---- the hermes parser ------------------------------------------------------------------------------
def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == 14 + 32
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", [
    (ONE, None, [("get_weather", {"city": "Paris"})]),
    (TWO, None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("Let me look.\n" + ONE, "Let me look.\n", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', None, [("get_weather", {"city": "Par"})][:0]),
    ('<tool_call>{"name": "f", "arguments": {"a": [1, "é"]}}', None, [("f", {"a": [1, "é"]})]),  # left open
    ("No call here.", "No call here.", []),
    ('<tool_call>{"name": get_weather}</tool_call>', '<tool_call>{"name": get_weather}</tool_call>', []),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),  # no arguments
    # not calls either: a function the request has not given, arguments not an object or not strict JSON
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', None, []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', None, []),
    ('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>', None, []),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', None, []),
    ('<tool_call>{"name": "f", "arguments": {"x": -Infinity}}</tool_call>', None, []),
    ('<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>', None, []),
    ('<tool_call>{"name": "f", "arguments": {"x": ' + DEEP + '}}</tool_call>', None, []),
])
def test_hermes_reads_whole_texts(text, content, calls):
    got_content, got_calls = HERMES.extract(text)
    if not calls and "<tool_call>" in text:  # not a call: the whole text is the content
        content = text
    assert (got_content, calls_of(got_calls)) == (content, calls)


def streamed(pieces: list[str], max_calls=None) -> tuple[str | None, list[dict], list[dict]]:
    """The content and calls a client puts together from the stream's deltas, and the deltas."""
    reader, deltas = HERMES.Stream(max_calls), []
    for piece in pieces:
        deltas += reader.feed(piece)
    deltas += reader.end()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"function": {"arguments": ""}})
            if "id" in c:  # the head comes first, once: id, type, name
                assert "name" in c["function"] and "arguments" not in c["function"] and call.get("id") is None
                call.update(id=c["id"], type=c["type"])
                call["function"]["name"] = c["function"]["name"]
            else:
                assert call.get("id") and set(c["function"]) == {"arguments"}
                call["function"]["arguments"] += c["function"]["arguments"]
    return content or None, [calls[i] for i in sorted(calls)], deltas


@pytest.mark.parametrize("text", [ONE, TWO, "Let me look.\n" + TWO, "a < b <tool_ and <tool_call", "No call.",
                                  '<tool_call>{"name": "f", "arguments": {"a": 1}}'])
def test_a_stream_split_anywhere_gives_the_same_calls(text):
    whole_content, whole_calls = HERMES.extract(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut], *text[cut:]]):  # two pieces; then one a character
            content, calls, deltas = streamed(pieces)
            assert content == whole_content and calls_of(calls) == calls_of(whole_calls), (cut, deltas)
    if whole_calls:  # no content delta holds any of the tag
        assert all("<" not in d.get("content", "") for d in streamed(list(text))[2])


def test_the_tag_is_held_back_until_it_is_known():
    reader = HERMES.Stream()
    assert reader.feed("Hi <tool") == [{"content": "Hi "}]
    assert reader.feed("box") == [{"content": "<toolbox"}]
    assert reader.feed("<tool_call>") == [] and not reader.called


def test_invalid_json_in_a_stream_is_content():
    content, calls, _ = streamed(list('<tool_call>{"name": oops}</tool_call> then'))
    assert (content, calls) == ('<tool_call>{"name": oops}</tool_call> then', [])


def test_one_call_at_most_without_parallel_calls():
    content, calls, _ = streamed([TWO], max_calls=1)
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]


def test_an_unknown_parser_is_named():
    with pytest.raises(ValueError, match="'nope'.*known: hermes"):
        tool_parsers.parser("nope")


# ---- the server -------------------------------------------------------------------------------------
def test_a_call_the_model_writes_comes_back_as_tool_calls(srv, monkeypatch):
    fake_output(srv, monkeypatch, ["Let me check.\n<tool", "_call>\n{\"name\": \"get_weather\", ",
                                   "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"])
    out = srv.client.chat.completions.create(model=srv.model, messages=HISTORY[:1], tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    # streamed: the same message, in OpenAI's deltas
    chunks = list(srv.client.chat.completions.create(model=srv.model, messages=HISTORY[:1], tools=[WEATHER],
                                                     stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    heads = [t for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.id]
    arguments = "".join(t.function.arguments or "" for c in chunks for t in c.choices[0].delta.tool_calls or [])
    assert content == "Let me check.\n" and [h.function.name for h in heads] == ["get_weather"]
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first(srv, monkeypatch):
    fake_output(srv, monkeypatch, [TWO])
    body = {"messages": HISTORY[:1], "tools": [WEATHER, TIME], "parallel_tool_calls": False}
    message = post(srv, body).json()["choices"][0]["message"]
    assert calls_of(message["tool_calls"]) == [("get_weather", {"city": "Paris"})] and message["content"] is None
    assert calls_of(post(srv, {**body, "parallel_tool_calls": True}).json()["choices"][0]["message"]["tool_calls"]) \
        == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_to_a_tool_not_given_or_with_arguments_not_strict_json_is_content(srv, monkeypatch, stream):
    for text in ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
                 '<tool_call>{"name": "get_weather", "arguments": {"city": NaN}}</tool_call>'):
        fake_output(srv, monkeypatch, [text])
        r = post(srv, {"messages": HISTORY[:1], "tools": [WEATHER], "stream": stream})
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            content, finish = "".join(d.get("content") or "" for d in deltas), chunks[-1]["choices"][0]["finish_reason"]
            assert not any("tool_calls" in d for d in deltas)
        else:
            message, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
            content = message["content"]
            assert message["tool_calls"] == []
        assert (content, finish) == (text, "stop")


def test_tool_choice_none_reads_no_call(srv, monkeypatch):
    fake_output(srv, monkeypatch, [ONE])
    choice = post(srv, {"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "none"}).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ONE} and choice["finish_reason"] == "stop"


def test_a_real_generation_with_tools(srv):
    r = post(srv, {"messages": HISTORY, "tools": [WEATHER], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "tool_calls" in choice["message"] and choice["finish_reason"] in ("stop", "length", "tool_calls")


def test_auto_needs_the_flags(srv, monkeypatch):
    monkeypatch.setattr(srv.app.state.server, "auto_tools", False)
    for extra in ({}, {"tool_choice": "auto"}):  # with tools, "auto" is the default
        r = post(srv, {"messages": HISTORY[:1], "tools": [WEATHER], **extra})
        assert_openai_error(r, 400, tools.AUTO_NEEDS_FLAGS)
        assert r.json()["error"]["message"] == tools.AUTO_NEEDS_FLAGS and r.json()["error"]["param"] == "tool_choice"
    assert post(srv, {"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "none"}).status_code == 200


@pytest.mark.parametrize("body, text", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "Tool 'nope' has not been passed in `tools`."),
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "must be \"none\", \"auto\""),
])
def test_tool_choice_refusals_name_it(srv, body, text):
    r = post(srv, {"messages": HISTORY[:1], **body})
    assert_openai_error(r, 400, text)
    assert r.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("tool, param, text", [
    ({"type": "function"}, "tools", "'function' is required"),
    ({"type": "code", "function": {"name": "f"}}, "tools", "'type' must be 'function'"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}, "tools", "JSON schema of an"),
    ({"type": "function", "function": {"name": "f", "parameters": []}}, "tools", "must be of type object"),
    ({"type": "function", "function": {"name": "f", "colour": 1}}, "tools", "'colour' is an unknown field"),
])
def test_tools_shape_is_checked(srv, tool, param, text):
    r = post(srv, {"messages": HISTORY[:1], "tools": [tool]})
    assert_openai_error(r, 400, text)
    assert r.json()["error"]["param"] == param


def test_an_earlier_calls_shape_is_checked(srv):
    bad = {**HISTORY[1], "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}
    r = post(srv, {"messages": [HISTORY[0], bad]})
    assert_openai_error(r, 400, "'arguments' must be of type string")
    assert r.json()["error"]["param"] == "messages.1.tool_calls"
    bad["tool_calls"][0]["function"]["arguments"] = '{"city": '
    assert_openai_error(post(srv, {"messages": [HISTORY[0], bad]}), 400, "'arguments' must be a JSON string")


CALL = HISTORY[1]["tool_calls"][0]


@pytest.mark.parametrize("messages, param, text", [
    # the arguments: a JSON object, strict JSON, not too deep for the template's recursion
    ([HISTORY[0], {**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": DEEP}}]}],
     "messages.1.tool_calls", "call 0: 'arguments' must be a JSON string holding an object (nests deeper than 64 "
     "levels)"),
    ([HISTORY[0], {**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": '{"x": NaN}'}}]}],
     "messages.1.tool_calls", "(NaN is not JSON)"),
    ([HISTORY[0], {**HISTORY[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages.1.tool_calls", "holding an object, not list"),
    # each field on its own role: tool_calls on an assistant's message, tool_call_id on a tool message, always
    ([{**HISTORY[0], "tool_calls": HISTORY[1]["tool_calls"]}], "messages.0.tool_calls",
     "only an assistant's message may have tool_calls"),
    ([{"role": "system", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}, HISTORY[0]],
     "messages.0.tool_calls", "only an assistant's message may have tool_calls"),
    ([{**HISTORY[0], "tool_call_id": "call_1"}], "messages.0.tool_call_id", "only a tool message may have"),
    ([*HISTORY[:2], {"role": "tool", "content": "18 C"}], "messages.2.tool_call_id", "needs its tool_call_id"),
    # a tool message answers a call made before it
    ([HISTORY[0], HISTORY[2]], "messages", "message 1: messages with role 'tool' must be a response to a preceding "
     "message with 'tool_calls' (no call has the id 'call_1')"),
    ([*HISTORY[:2], {**HISTORY[2], "tool_call_id": "call_2"}], "messages", "no call has the id 'call_2'"),
])
def test_a_conversations_tool_fields_are_checked(srv, messages, param, text):
    for path in (CHAT, "/tokenize"):
        r = post(srv, {"messages": messages}, path)
        assert_openai_error(r, 400, text)
        assert r.json()["error"]["param"] == param


def test_a_tools_parameters_too_deep_for_the_template_are_refused(srv):
    deep = json.loads('{"a": ' * 300 + "{}" + "}" * 300)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": deep}}}
    r = post(srv, {"messages": HISTORY[:1], "tools": [tool], "tool_choice": "none"})
    assert_openai_error(r, 400, "tool 0: 'parameters' nests deeper than 64 levels")
    assert r.json()["error"]["param"] == "tools"


# ---- forced calls: "required" and a named function ---------------------------------------------------
NAMED = {"type": "function", "function": {"name": "get_time"}}
STRICT = [{"type": "function", "function": {**t["function"], "parameters": {
    **t["function"]["parameters"], "additionalProperties": False}}} for t in (WEATHER, TIME)]  # as OpenAI's strict tools


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_choice_gets_valid_calls_whole_and_streamed(srv, choice):
    """The grammar holds the model to forced_schema: its calls name the given tools and their
    arguments validate against the tool's parameters, in the whole message and the stream."""
    import jsonschema
    ask = dict(model=srv.model, messages=[{"role": "user", "content": "Weather in Paris? And the time in CET?"}],
               tools=STRICT, tool_choice=choice, max_tokens=60, temperature=0)
    choice_out = srv.client.chat.completions.create(**ask).choices[0]
    calls = choice_out.message.tool_calls
    finished = "stop" if choice == NAMED else "tool_calls"  # OpenAI's (and vLLM's) rule for a forced function
    assert calls and choice_out.finish_reason == finished and not choice_out.message.content
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    if choice == NAMED:
        assert [c.function.name for c in calls] == ["get_time"]
    chunks = list(srv.client.chat.completions.create(**ask, stream=True))
    heads = [t for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.id]
    arguments = "".join(t.function.arguments or "" for c in chunks for t in c.choices[0].delta.tool_calls or [])
    assert [h.function.name for h in heads] == [c.function.name for c in calls]
    assert arguments == "".join(c.function.arguments for c in calls)
    assert chunks[-1].choices[0].finish_reason == finished


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_cut_short_is_length_and_no_call(srv, stream):
    """Arguments cut by max_tokens do not parse: no call is made of them, and the choice says "length"."""
    ask = dict(model=srv.model, messages=[{"role": "user", "content": "The time in CET?"}], tools=STRICT,
               tool_choice=NAMED, max_tokens=3, temperature=0)
    if stream:
        chunks = list(srv.client.chat.completions.create(**ask, stream=True))
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        out = srv.client.chat.completions.create(**ask).choices[0]
        assert out.finish_reason == "length" and not out.message.tool_calls, out


def test_a_forced_call_cut_short_is_content(srv):
    body = {"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "required", "max_tokens": 3}
    choice = post(srv, body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith("[")


def test_a_forced_choice_and_a_response_format_are_one_too_many(srv):
    r = post(srv, {"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "required",
                   "response_format": {"type": "json_object"}})
    assert_openai_error(r, 400, "set one of them")
    assert r.json()["error"]["param"] == "tool_choice"



def test_the_schema_forced_for_required_and_named():
    before = json.dumps([WEATHER, TIME])
    schema = tools.forced_schema([WEATHER, TIME], "required")
    assert schema == {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"],
         "additionalProperties": False},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}}},
         "required": ["name", "parameters"], "additionalProperties": False}]},
        "$defs": {"zone": {"type": "string"}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tools.forced_schema([WEATHER, TIME], named) == WEATHER["function"]["parameters"]
    assert tools.forced_schema([WEATHER], "required", parallel=False)["maxItems"] == 1  # parallel_tool_calls false
    no_parameters = {"type": "function", "function": {"name": "ping"}}
    assert tools.forced_schema([no_parameters], {"type": "function", "function": {"name": "ping"}}) == {
        "type": "object", "properties": {}}
    assert json.dumps([WEATHER, TIME]) == before  # the tools are not changed


def test_forced_output_becomes_tool_calls():
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    assert calls_of(tools.forced_calls(out, "required")) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    [call] = tools.forced_calls('{"city": "Rome"}', {"type": "function", "function": {"name": "get_weather"}})
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


# ---- the flags -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--tool-call-parser", "nope"], "--tool-call-parser 'nope': no such parser (known: hermes)"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--chat-template", "no/such.jinja"], "--chat-template 'no/such.jinja' looks like a file path, but it failed"),
    (["--chat-template", "{{ x }}", "--no-chat"], "--chat-template with --no-chat"),
])
def test_the_flags_are_checked_at_startup(flags, message):
    import run
    with pytest.raises(NanoError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run.main(["--serve", *flags])


def test_the_command_lines_prompts_take_the_template_too(srv):
    from nano.cli.prompts import model_inputs
    assert model_inputs(srv.engine.tokenizer, ["Hi"], True, "[{{ messages[0].content }}]") == ["[Hi]"]
    assert model_inputs(srv.engine.tokenizer, ["Hi"], False, "[{{ messages[0].content }}]") == ["Hi"]
