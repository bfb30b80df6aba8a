"""Nothing a client sends is silently ignored: every field of OpenAI's and
vLLM's chat-completions and completions requests is either honoured (200) or, set to a value
that asks for something, a 400 whose param names it (nano/server/fields.py); so are unknown
fields. The table below has a row for every field of the request models, so that a field added
to a model without a row fails here. Also vLLM's range checks, GET /version and GET|POST
/ping. The real server on a loopback port."""
import pytest

from test_server import Running, httpx  # (it skips without the server's packages)
from test_server_abuse import assert_openai_error

from nano.server import __version__  # noqa: E402
from nano.server.fields import refused  # noqa: E402
from nano.server.schemas import ChatRequest, CompletionRequest, Message  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatRequest}
BASE = {COMPLETIONS: {"prompt": "The sky is", "max_tokens": 2},
        CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}

# The fields each endpoint honours; every other field of its model is refused unless "off".
SAMPLING = {"model", "user", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
            "stream_options", "ignore_eos", "prompt_logprobs", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
            "bad_words", "response_format", "structured_outputs"}
HONOURED = {COMPLETIONS: SAMPLING | {"prompt", "logprobs", "echo"},
            CHAT: SAMPLING | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                              "safety_identifier", "tools", "tool_choice", "parallel_tool_calls"}}

# A value for each field that asks for something (not its default, nor "off").
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
VALUES = {
    # honoured
    "model": "MODEL", "user": "u", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7,
    "stop": ["\n"], "n": 2, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    "prompt_logprobs": 1, "prompt": [1, 2, 3], "echo": True, "frequency_penalty": 0.5, "presence_penalty": -0.5,
    "logit_bias": {"11": 100}, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [5],
    "include_stop_str_in_output": True, "min_tokens": 2, "bad_words": ["x"],
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    "top_logprobs": 2, "max_completion_tokens": 3, "add_generation_prompt": False, "response_format": JSON_SCHEMA,
    "structured_outputs": {"regex": "[ab]+"},
    # refused (both endpoints)
    "use_beam_search": True, "length_penalty": 0.5, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8, "allowed_token_ids": [1, 2],
    "priority": 1, "request_id": "r1", "logits_processors": ["m.P"],
    "return_tokens_as_token_ids": True, "return_token_ids": True, "cache_salt": "salt", "kv_transfer_params": {},
    "vllm_xargs": {"k": 1},
    # refused (completions)
    "suffix": "end", "best_of": 3, "prompt_embeds": "AAAA", "max_repetition_pattern_size": 4,
    "min_repetition_pattern_size": 2, "repetition_min_count": 3,
    # refused (chat)
    "tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": False, "functions": [TOOL["function"]],
    "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "metadata": {"k": "v"}, "store": True, "service_tier": "flex",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "s", "verbosity": "low",
    "web_search_options": {}, "reasoning_effort": "low", "thinking_token_budget": 8, "include_reasoning": False,
    "watermarking": True, "logprob_token_ids": [1], "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ 'x' }}", "chat_template_kwargs": {"k": 1},
    "media_io_kwargs": {}, "mm_processor_kwargs": {}, "session_id": "s", "routed_experts_prompt_start": 1,
    "return_token_offsets": True, "return_prompt_text": True, "return_mm_kwargs": False, "ec_transfer_params": {},
    "repetition_detection": {"max_pattern_size": 4}, "stream_interval": 4,
}
# Where the endpoints' fields differ in type (logprobs) or default (add_special_tokens).
PER_ENDPOINT = {COMPLETIONS: {"logprobs": 2, "add_special_tokens": False}, CHAT: {"logprobs": True, "add_special_tokens": True}}
# What the value needs beside it (tools alone ask for "auto", which needs the server's flags).
COMPANIONS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
              "tools": {"tool_choice": "none"}, "tool_choice": {"tools": [TOOL]}}
TOOL_CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MESSAGE = {"role": "user", "content": "Hi", "name": "ann", "tool_calls": [TOOL_CALL], "tool_call_id": "1",
           "function_call": {"name": "f"}, "refusal": "no", "audio": {"id": "a"}, "reasoning": "r",
           "reasoning_content": "r"}

MESSAGE_HONOURED = {"role", "content", "name", "tool_calls", "tool_call_id"}  # what the template gets


def test_a_messages_tool_fields_are_taken(srv):
    call = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
    result = {"role": "tool", "content": "42", "tool_call_id": "1", "name": "f"}
    r = httpx.post(srv.url + CHAT, json={**BASE[CHAT], "messages": [BASE[CHAT]["messages"][0], call, result]},
                   timeout=120)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def srv():
    running = Running(max_queued=16)
    yield running
    running.stop()


def value(path: str, name: str, srv):
    found = {**VALUES, **PER_ENDPOINT[path]}[name]
    return srv.model if found == "MODEL" else found


@pytest.mark.parametrize("path", MODELS)
def test_the_table_has_a_row_for_every_field(path):
    fields = set(MODELS[path].model_fields)
    assert fields <= set(VALUES) | set(PER_ENDPOINT[path]), "fields without a row: add them to VALUES"
    assert set(refused(MODELS[path])) == fields - HONOURED[path]
    assert set(MESSAGE) == set(Message.model_fields) and set(refused(Message)) == set(MESSAGE) - MESSAGE_HONOURED


@pytest.mark.parametrize("path", MODELS)
def test_every_field_is_honoured_or_refused_by_name(srv, path):
    for name in MODELS[path].model_fields:
        body = {**BASE[path], **COMPANIONS.get(name, {}), name: value(path, name, srv)}
        r = httpx.post(srv.url + path, json=body, timeout=120)
        if name in HONOURED[path]:
            assert r.status_code == 200, (name, r.text)
        else:
            assert_openai_error(r, 400, "nano does not implement this field")
            assert r.json()["error"]["param"] == name, r.text


@pytest.mark.parametrize("path", MODELS)
def test_a_refused_field_set_off_is_taken(srv, path):
    """Null, and each value that asks for nothing (presence_penalty 0, tool_choice "none", ...)."""
    offs = refused(MODELS[path])
    for i in range(max(map(len, offs.values())) + 1):  # null first, then each off value in turn
        body = {**BASE[path], **{name: [None, *values][i % (len(values) + 1)] for name, values in offs.items()}}
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 200, (body, r.text)


@pytest.mark.parametrize("name", sorted(set(MESSAGE) - MESSAGE_HONOURED))
def test_a_messages_field_the_template_does_not_get_is_refused(srv, name):
    r = httpx.post(srv.url + CHAT, json={**BASE[CHAT], "messages": [{"role": "user", "content": "Hi",
                                                                       name: MESSAGE[name]}]}, timeout=120)
    assert_openai_error(r, 400, "nano does not implement this field")
    assert r.json()["error"]["param"] == f"messages.0.{name}"


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"frequency_penalty_x": 1}, "frequency_penalty_x"),
    (COMPLETIONS, {"max-tokens": 1}, "max-tokens"),
    (CHAT, {"Temperature": 0}, "Temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi", "colour": "red"}]}, "messages.0.colour"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "every": 2}}, "stream_options.every"),
])
def test_an_unknown_field_is_refused_by_name(srv, path, body, param):
    r = httpx.post(srv.url + path, json={**BASE[path], **body}, timeout=120)
    assert_openai_error(r, 400, "an unknown field")
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body, param, text", [
    (CHAT, {"top_logprobs": 2}, "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."),
    (COMPLETIONS, {"stream_options": {"include_usage": False}}, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (COMPLETIONS, {"seed": 2**63}, "seed", "less than"),
    (CHAT, {"seed": -2**63 - 1}, "seed", "greater than or equal"),
    (COMPLETIONS, {"top_k": -2}, "top_k", "greater than or equal"),
    (CHAT, {"temperature": -0.1}, "temperature", "greater than or equal"),
    (CHAT, {"top_p": 1.5}, "top_p", "less than or equal"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs", "greater than or equal"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    (CHAT, {"n": 0}, "n", "greater than or equal"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal"),
    (CHAT, {"frequency_penalty": 5}, "frequency_penalty", "less than or equal"),
    (COMPLETIONS, {"presence_penalty": -2.5}, "presence_penalty", "greater than or equal"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty", "greater than"),
    (CHAT, {"repetition_penalty": 1e-300}, "repetition_penalty", "greater than or equal to 0.000001"),  # float32: 0
    (COMPLETIONS, {"repetition_penalty": 1e308}, "repetition_penalty", "less than or equal to 1000000"),  # inf
    (CHAT, {"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "must not be empty"),
    (COMPLETIONS, {"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar", "must not be empty"),
    (CHAT, {"structured_outputs": {"json": ""}}, "structured_outputs.json", "must not be empty"),
    (COMPLETIONS, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "must not be empty"),
    (COMPLETIONS, {"min_p": 1.5}, "min_p", "less than or equal"),
    (COMPLETIONS, {"min_tokens": -1}, "min_tokens", "greater than or equal"),
    (CHAT, {"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
    (COMPLETIONS, {"logit_bias": {"11": 101}}, "logit_bias", "less than or equal"),
    (COMPLETIONS, {"logit_bias": {"99999999": 1}}, "logit_bias", "out of the vocabulary"),
    (CHAT, {"stop_token_ids": [99999999]}, "stop_token_ids", "token ids must be in"),
    (COMPLETIONS, {"min_tokens": 3}, "min_tokens", "at most max_tokens"),
])
def test_vllms_range_checks(srv, path, body, param, text):
    r = httpx.post(srv.url + path, json={**BASE[path], **body}, timeout=120)
    assert_openai_error(r, 400, text)
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body", [
    (CHAT, {"top_logprobs": 0}),                             # asks for no alternatives: fine without logprobs
    (COMPLETIONS, {"stream_options": {}}),                   # vLLM's check is on a non-empty object
    (CHAT, {"seed": 2**63 - 1}), (COMPLETIONS, {"seed": -2**63}), (COMPLETIONS, {"top_k": 0}),
    (CHAT, {"repetition_penalty": 1e-6}), (COMPLETIONS, {"repetition_penalty": 1e6}),
    (CHAT, {"structured_outputs": {"json": {}}}),  # the empty schema: any JSON value
    (COMPLETIONS, {"structured_outputs": {"regex": None, "choice": ["a", "b"]}}),  # null: not set
    (CHAT, {"temperature": None, "top_p": None, "top_k": None, "n": None, "stream": None, "logprobs": None}),
    (COMPLETIONS, {"max_tokens": None, "echo": None, "seed": None, "stop": None}),  # null: the default, as in vLLM
])
def test_the_edges_of_the_ranges_are_taken(srv, path, body):
    r = httpx.post(srv.url + path, json={**BASE[path], **body}, timeout=120)
    assert r.status_code == 200, r.text


def test_version_and_ping(srv):
    r = httpx.get(srv.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, srv.url + "/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    ids = [op["operationId"] for ops in httpx.get(srv.url + "/openapi.json").json()["paths"].values()
           for op in ops.values()]
    assert len(ids) == len(set(ids)), ids
