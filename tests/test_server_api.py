"""What third-party clients send the server (nano/server/app.py) beyond a plain prompt: chat
content as parts (or null), prompt batches, usage with prefix-cache hits and on every chunk,
vLLM's /tokenize and /detokenize, GET /v1/models/{id}, every error status in OpenAI's shape,
and one log line per request. The real server on a loopback port, the `openai` client."""
import itertools
import json
import logging
import sys
import time

import pytest

from test_server import PROMPT, Running, httpx, openai  # (it skips without the server's packages)
from test_server_abuse import assert_openai_error, post_text, start_server

from fastapi.routing import iter_route_contexts  # noqa: E402

from nano.chat import template  # noqa: E402
from nano.server.middleware import allowed_hosts  # noqa: E402
from nano.server.limits import Limits  # noqa: E402

KEY = "sesame"
LIMITS = Limits(body_bytes=4096, prompt_chars=600, request_tokens=256)
FORGED = "2026-12-02 04:40:52,036 INFO nano.server: GET /health 200 0.1 ms"  # a line a client would like to add
LONG = "In a quiet village by the sea, the fishermen rose before dawn to mend their nets and " * 2


@pytest.fixture(scope="module")
def srv():
    """A server with an API key, the loopback hosts only, small limits, 8 requests in flight."""
    running = Running(max_queued=8, app={"api_key": KEY, "hosts": allowed_hosts("127.0.0.1", None),
                                         "limits": LIMITS})
    yield running
    running.stop()


def post(srv, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}, **kw)


def tokens(srv, **body) -> list[int]:
    r = post(srv, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- chat content: a string, text parts, null ------------------------------------------------------------
def test_chat_content_as_text_parts_is_the_joined_string(srv):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                          {"type": "text", "text": "One word."}]}]
    joined = [{"role": "user", "content": "Name a colour.\nOne word."}]  # joined as vLLM joins them
    assert tokens(srv, messages=parts) == tokens(srv, messages=joined)
    by_parts = srv.client.chat.completions.create(model=srv.model, messages=parts, max_tokens=6, temperature=0)
    by_string = srv.client.chat.completions.create(model=srv.model, messages=joined, max_tokens=6, temperature=0)
    assert by_parts.choices[0].message.content == by_string.choices[0].message.content
    assert by_parts.usage.prompt_tokens == by_string.usage.prompt_tokens


def test_assistant_content_may_be_null(srv):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "And?"}]
    empty = [dict(m, content=m["content"] or "") for m in turns]
    assert tokens(srv, messages=turns) == tokens(srv, messages=empty)
    absent = [turns[0], {"role": "assistant", "tool_calls": []}, turns[2]]  # no content at all: as null
    assert tokens(srv, messages=absent) == tokens(srv, messages=empty)
    out = srv.client.chat.completions.create(model=srv.model, messages=turns, max_tokens=2)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("content,where", [
    (None, "messages.0.content: is required (it may be null only in an assistant's message)"),
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
     "messages.0.content: part 1 is of type 'image_url': this server takes text only"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     "messages.0.content: part 0 is of type 'input_audio'"),
    ([{"type": "text"}], "messages.0.content: part 0: 'text' must be a string"),
    ([{"type": "text", "text": "a\ud800"}], "messages.0.content: the text is not valid Unicode text"),
    (5, "messages.0.content: must be a string or a list of content parts"),
])
def test_content_the_server_cannot_take_is_a_400_naming_the_field(srv, content, where):
    body = json.dumps({"messages": [{"role": "user", "content": content}]})  # \ud800 as JSON writes it
    r = post_text(srv.url + "/v1/chat/completions", body, headers={"Authorization": f"Bearer {KEY}"})
    assert_openai_error(r, 400, where)
    assert r.json()["error"]["param"] == "messages.0.content"


# ---- prompt batches --------------------------------------------------------------------------------------
def test_a_batch_of_prompts_gives_n_choices_per_prompt_in_openais_order(srv):
    prompts = [PROMPT, "The capital of France is"]
    one = [srv.client.completions.create(model=srv.model, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    ids = [tokens(srv, prompt=p) for p in prompts]
    for batch in (prompts, ids):
        out = srv.client.completions.create(model=srv.model, prompt=batch, max_tokens=5, temperature=0, n=2)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [one[0].choices[0].text] * 2 + [one[1].choices[0].text] * 2
        assert out.usage.prompt_tokens == sum(o.usage.prompt_tokens for o in one) == sum(map(len, ids))
        assert out.usage.completion_tokens == 2 * sum(o.usage.completion_tokens for o in one)
    chunks = list(srv.client.completions.create(model=srv.model, prompt=prompts, max_tokens=5, temperature=0, n=2,
                                                stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in out.choices] and chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


@pytest.mark.parametrize("prompt,where", [
    ([], "prompt: must be a string, a list of token ids, a list of strings or a list of token-id lists"),
    ([[]], "prompt: prompt 0: is empty"),
    (["hi", ""], "prompt: prompt 1: is empty"),
    (["hi", [1, 2]], None),  # a mixed batch: OpenAI's four shapes do not mix, but each item is a prompt
    (["hi", 5], "prompt: prompt 1: must be a string or a list of token ids"),
    ([[1, 2], [3, True]], "prompt: prompt 1: must be a string or a list of token ids"),
    ([[1, 2], [3, 99999999]], "prompt 1: token ids must be in [0, "),
    ({"text": "hi"}, "prompt: must be a string"),
])
def test_prompts_the_server_cannot_take_are_a_400(srv, prompt, where):
    r = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    if where is None:
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    else:
        assert_openai_error(r, 400, where)


def test_the_limits_hold_for_the_whole_batch(srv):
    chars = "x " * 60
    assert post(srv, "/v1/completions", {"prompt": [chars] * 5, "max_tokens": 1}).status_code == 200
    assert_openai_error(post(srv, "/v1/completions", {"prompt": [chars] * 6, "max_tokens": 1}), 400,
                        "the prompt has 720 characters, more than this server's 600")
    assert_openai_error(post(srv, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3}), 400,
                        "n: 9 choices (3 prompts x 3), more than this server's 8 requests in flight")
    # 128 tokens for each prompt is within the limit, 3 x 128 for the request is not
    assert_openai_error(post(srv, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 128}), 400,
                        "n x max_tokens is 1 x 384 (over 3 prompts), more than this server's 256 tokens")
    assert srv.idle()


def test_a_prompt_and_max_tokens_past_the_context_are_a_400_in_vllms_words(srv):
    """vLLM's check: max_tokens asked beyond what the context leaves is refused, never cut
    short; chat without max_tokens means the rest of the context."""
    context, messages = srv.engine.max_model_len, [{"role": "user", "content": "Hi"}]
    prompt = len(tokens(srv, messages=messages))
    for path, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/responses", {"input": "Hi"})):
        key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
        r = post(srv, path, {**body, key: context})
        assert_openai_error(r, 400, f"This model's maximum context length is {context} tokens. However, you "
                            f"requested {context + prompt} tokens ({prompt} in the messages, {context} in the "
                            "completion). Please reduce the length of the messages or completion.")
        # what fits passes the context's check, to be refused by this server's request_tokens limit
        assert_openai_error(post(srv, path, {**body, key: context - prompt}), 400, "n x max_tokens is 1 x")
    assert_openai_error(post(srv, "/v1/completions", {"prompt": [1, 2], "max_tokens": context - 1}), 400,
                        f"However, you requested {context + 1} tokens (2 in the messages, {context - 1} in the "
                        "completion)")
    assert_openai_error(post(srv, "/v1/chat/completions", {"messages": messages}), 400,  # the rest of the context
                        f"n x max_tokens is 1 x {context - prompt},")
    assert srv.idle()


# ---- usage: prefix-cache hits, every chunk -----------------------------------------------------------------
def test_usage_reports_the_prefix_cache_hit(srv):
    first = srv.client.completions.create(model=srv.model, prompt=LONG, max_tokens=2, temperature=0)
    again = srv.client.completions.create(model=srv.model, prompt=LONG, max_tokens=2, temperature=0)
    block = srv.engine.config.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit == (again.usage.prompt_tokens - 1) // block * block > 0  # every full block before the last token
    streamed = list(srv.client.completions.create(model=srv.model, prompt=[LONG, "Fresh words"], max_tokens=2,
                                                  stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == hit  # summed over the prompts
    chat = [{"role": "user", "content": LONG}]
    srv.client.chat.completions.create(model=srv.model, messages=chat, max_tokens=1)
    assert srv.client.chat.completions.create(model=srv.model, messages=chat,
                                              max_tokens=1).usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(srv, chat, include_usage):
    args = dict(model=srv.model, max_tokens=8, temperature=0, n=2, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": include_usage, "continuous_usage_stats": True})
    if chat:
        chunks = list(srv.client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **args))
    else:
        chunks = list(srv.client.completions.create(prompt=PROMPT, **args))
    assert all(c.usage is not None for c in chunks)
    generated = [c.usage.completion_tokens for c in chunks]
    assert generated == sorted(generated) and generated[-1] == 16 and len(set(generated)) > 2
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert (chunks[-1].choices == []) == include_usage  # the usage-only chunk only with include_usage


# ---- /tokenize, /detokenize, /v1/models/{id} ---------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(srv):
    tok = srv.engine.tokenizer
    r = post(srv, "/tokenize", {"prompt": LONG, "model": srv.model}).json()
    assert r == {"count": len(tok.encode(LONG, True)), "max_model_len": srv.engine.max_model_len,
                 "tokens": tok.encode(LONG, True)}
    assert post(srv, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": LONG}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for generation in (True, False):
        ids = tokens(srv, messages=messages, add_generation_prompt=generation)
        assert ids == template.encode(tok, messages, generation)
        text = post(srv, "/detokenize", {"tokens": ids}).json()["prompt"]  # special tokens shown
        assert text == template.render(tok, messages, generation)
    assert len(tokens(srv, messages=messages)) > len(tokens(srv, messages=messages, add_generation_prompt=False))


@pytest.mark.parametrize("path,body,status,text", [
    ("/tokenize", {}, 400, "give either prompt or messages"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "either"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    ("/tokenize", {"prompt": "x" * 601}, 400, "more than this server's 600"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens: token ids must be in [0, "),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens: Input should be a valid list"),
])
def test_tokenizer_routes_refuse_what_they_cannot_take(srv, path, body, status, text):
    assert_openai_error(post(srv, path, body), status, text)


def test_a_model_by_its_id(srv):
    assert srv.client.models.retrieve(srv.model) == srv.client.models.list().data[0]
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("gpt-4")
    r = httpx.get(srv.url + "/v1/models/org/gpt-4", headers={"Authorization": f"Bearer {KEY}"})
    assert_openai_error(r, 404, "the model 'org/gpt-4' does not exist")
    assert r.json()["error"]["code"] == "model_not_found"


# ---- every error status in OpenAI's shape ----------------------------------------------------------------
def test_every_error_status_is_in_openais_shape(srv, monkeypatch):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert_openai_error(httpx.get(srv.url + "/nowhere"), 404, "Not Found")
    assert_openai_error(httpx.get(srv.url + "/tokenize", headers=auth), 405, "Method Not Allowed")
    assert_openai_error(post(srv, "/detokenize", {"tokens": [1] * 3000}), 413, "larger than this server's 4096")
    invalid = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": "ten"})
    assert_openai_error(invalid, 400, "max_tokens")
    assert invalid.json()["error"]["param"] == "max_tokens"
    assert_openai_error(httpx.post(srv.url + "/tokenize", json={"prompt": "hi"}), 401, "API key")
    assert_openai_error(httpx.get(srv.url + "/health", headers={"Host": "rebound.example"}), 400, "Host header")
    server = srv.app.state.server
    monkeypatch.setattr(server, "closing", True)
    assert_openai_error(post(srv, "/v1/completions", {"prompt": "hi"}), 503, "the server is shutting down")
    monkeypatch.undo()

    async def broken(*_):
        raise RuntimeError("planted")
    monkeypatch.setattr(server, "tokenize", broken)
    r = post(srv, "/v1/completions", {"prompt": "hi"})
    assert_openai_error(r, 500, "internal error: RuntimeError: planted")
    assert r.json()["error"]["type"] == "server_error"


# ---- one log line per request ----------------------------------------------------------------------------
def test_each_request_is_one_log_line(srv, caplog):
    caplog.set_level(logging.INFO, logger="nano.server")
    srv.client.completions.create(model=srv.model, prompt="hi", max_tokens=2)
    post(srv, "/v1/completions", {"prompt": "hi", "temperature": -1})
    list(srv.client.completions.create(model=srv.model, prompt="hi", max_tokens=2, stream=True))
    deadline = time.monotonic() + 10  # a line is written once the response's last byte is sent
    while len(lines := [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nano.server"]) < 3:
        assert time.monotonic() < deadline, lines
        time.sleep(0.05)
    assert len(lines) == 3, lines
    (ok, good), (warning, bad), (_, streamed) = lines
    assert ok == "INFO" and good.startswith("POST /v1/completions 200 ") and good.endswith(" ms")
    assert warning == "WARNING" and bad.startswith("POST /v1/completions 400 ")
    assert bad.endswith(" ms: temperature: Input should be greater than or equal to 0")
    assert streamed.startswith("POST /v1/completions 200 ")


def test_the_log_level_flag_sets_what_the_server_logs():
    """--log-level warning: the 400 is logged (with its reason), the 200 is not, and uvicorn's
    own access log is off (no line twice). A client cannot write a line of its own into the
    log: a line break, an ANSI escape, a Unicode line separator in the path are written escaped."""
    job, url = start_server("--log-level", "warning")
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 0}, timeout=60).status_code == 400
        assert httpx.get(url + "/v1/x%0A" + FORGED.replace(" ", "%20") + "%1B[2J%E2%80%A8%C2%85").status_code == 404
        job.terminate()
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    logged = [line for line in stderr.splitlines() if "/v1/completions" in line]
    assert len(logged) == 1 and " WARNING nano.server: POST /v1/completions 400 " in logged[0], stderr[-3000:]
    assert logged[0].endswith("ms: n: Input should be greater than or equal to 1"), logged
    assert not any(c in stderr for c in "\x1b\u2028\x85") and "\n" + FORGED not in stderr, stderr[-3000:]
    assert f" WARNING nano.server: GET /v1/x\\n{FORGED}\\x1b[2J\\u2028\\x85 404 " in stderr, stderr[-3000:]


def test_a_log_record_is_one_line_whatever_a_client_put_in_it():
    """The server's log formatter (its own lines and uvicorn's): every character that is not
    printable is escaped, a traceback's line breaks too."""
    from nano.server.middleware import log_config
    formatter = log_config("info")["formatters"]["nano.server"]  # as serve() configures it
    try:
        raise ValueError("bad\n" + FORGED)
    except ValueError:
        record = logging.LogRecord("nano.server", logging.ERROR, __file__, 1, "GET /x\n%s\x1b[31m\u2028\x85\ud800 500",
                                   (FORGED,), sys.exc_info())
    line = formatter["()"](formatter["fmt"]).format(record)
    assert line.isprintable(), line
    assert f" ERROR nano.server: GET /x\\n{FORGED}\\x1b[31m\\u2028\\x85\\ud800 500\\nTraceback (most " in line
    assert line.endswith("\\nValueError: bad\\n" + FORGED), line


# ---- /openapi.json says what the server does -------------------------------------------------------------
def spec(srv) -> dict:
    r = httpx.get(srv.url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


def operations(doc: dict) -> dict[tuple[str, str], dict]:
    return {(path, method.upper()): op for path, ops in doc["paths"].items() for method, op in ops.items()}


def examples(schema: dict, doc: dict) -> list:
    """Values the schema describes, the way a schema-driven fuzzer starts: an object's required
    properties only (and those its `else` requires: the generator never picks the `if` value),
    one value per alternative of each union on the way, null left out (an optional field's
    absence), an enum's first value, a schema's first example, a number's minimum."""
    if "$ref" in schema:
        return examples(doc["components"]["schemas"][schema["$ref"].split("/")[-1]], doc)
    if "anyOf" in schema:
        return [v for alternative in schema["anyOf"] if alternative.get("type") != "null"
                for v in examples(alternative, doc)]
    if "const" in schema:
        return [schema["const"]]
    if "examples" in schema:  # the schema's own example (a string of JSON: a call's arguments)
        return [schema["examples"][0]]
    if "enum" in schema:
        return [schema["enum"][0]]
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return [int(schema.get("minimum", 1))]
    if kind == "array":
        return [[item] for item in examples(schema["items"], doc)]
    if kind == "object":
        out = []
        for alternative in schema.get("oneOf", [{}]):
            names = schema.get("required", []) + schema.get("else", {}).get("required", []) + \
                alternative.get("required", [])
            for values in itertools.product(*(examples(schema["properties"][name], doc) for name in names)):
                out.append(dict(zip(names, values)))
        return out
    return {"string": ["Hello"], "boolean": [False]}[kind]


def bodies(doc: dict, path: str) -> list[dict]:
    """A POST route's example bodies, each asking for 2 tokens where it may ask."""
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = doc["components"]["schemas"][schema["$ref"].split("/")[-1]]["properties"]
    most = {name: 2 for name in ("max_tokens", "max_output_tokens") if name in fields}
    return [dict(body, **most) for body in examples(schema, doc)]


def test_every_route_the_server_answers_is_documented_and_405_names_the_methods(srv):
    """The routes the app answers (but the schema's own pages) are the documented operations; a
    method a path does not document is a 405 whose Allow names those it does; no 422 anywhere
    (a body that fails validation is a 400), and the prompt has a schema."""
    doc, app = spec(srv), srv.app
    own = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}  # the schema's pages
    served = {(route.path_format, m) for route in iter_route_contexts(app.routes) if route.path not in own
              for m in route.methods}
    documented = operations(doc)
    assert served == set(documented)
    for path, ops in doc["paths"].items():
        allowed = {m.upper() for m in ops}
        for method in {"GET", "POST", "PUT", "DELETE", "PATCH"} - allowed:
            r = httpx.request(method, srv.url + path.replace("{model}", srv.model),
                              headers={"Authorization": f"Bearer {KEY}"})
            assert_openai_error(r, 405, "Method Not Allowed")
            assert set(r.headers["allow"].split(", ")) == allowed, (method, path)
    assert all("422" not in op["responses"] for op in documented.values())
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    assert {"string", "array"} <= {alt["type"] for alt in prompt["anyOf"]}


def test_every_status_the_server_sends_is_documented_and_every_documented_one_is_sent(srv, monkeypatch):
    """Each operation is sent what brings about each error status (as a schema-following client
    sends it: a body only where one is documented); the statuses it answers are exactly those
    documented, each in a documented content type, each error in OpenAI's shape (ErrorResponse)."""
    doc, server = spec(srv), srv.app.state.server
    error, detail = doc["components"]["schemas"]["ErrorResponse"], doc["components"]["schemas"]["ErrorDetail"]
    assert error["required"] == ["error"] and error["properties"]["error"]["$ref"].endswith("/ErrorDetail")
    assert set(detail["required"]) == {"message", "type", "param", "code"}  # as assert_openai_error checks
    auth = {"Authorization": f"Bearer {KEY}"}

    def call(path, method, headers=auth, model=None, **more):
        """The operation with its first example body (if it takes one), model and more set in it."""
        body = dict(bodies(doc, path)[0], **({"model": model} if model else {}), **more) \
            if "requestBody" in doc["paths"][path][method.lower()] else None
        return httpx.request(method, srv.url + path.replace("{model}", model or srv.model), json=body,
                             headers=headers, timeout=120)

    def planted(target, name, value):
        def call_planted(path, method):
            with monkeypatch.context() as m:
                m.setattr(target, name, value)
                return call(path, method)
        return call_planted

    async def broken(*_, **__):
        raise RuntimeError("planted")
    triggers = [  # (path, method) -> a response
        call,
        lambda path, method: call(path, method, headers={**auth, "Host": "rebound.example"}),  # 400
        lambda path, method: call(path, method, headers={}),                                    # 401
        lambda path, method: call(path, method, model="gpt-4"),                                 # 404
        lambda path, method: call(path, method, padding="x" * 5000),                            # 413
        planted(server, "submit", broken),                                                      # 500
        planted(server.thread, "error", "planted"),                                             # 503
        planted(server, "closing", True),                                                       # 503
    ]
    for (path, method), op in operations(doc).items():
        sent = set()
        for trigger in triggers:
            r = trigger(path, method)
            sent.add(str(r.status_code))
            documented = op["responses"].get(str(r.status_code), {"content": {}})
            assert r.headers["content-type"].split(";")[0] in documented["content"], (path, method, r.status_code)
            if r.status_code >= 400:
                assert_openai_error(r, r.status_code)
                assert documented["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert sent == set(op["responses"]), (path, method)
    invalid = call("/v1/completions", "POST", temperature=-1)
    assert_openai_error(invalid, 400, "temperature")  # FastAPI's default would be a 422


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
def test_bodies_built_from_the_request_schemas_are_served(srv, path):
    """What a schema-driven fuzzer sends first reaches generation: every alternative of each
    union (the prompt's four shapes, a message's content as a string or as parts) answers 200."""
    doc = spec(srv)
    made = bodies(doc, path)
    assert len(made) >= {"/v1/completions": 4, "/v1/chat/completions": 2, "/v1/responses": 3,
                         "/tokenize": 3}.get(path, 1), made
    for body in made:
        r = post(srv, path, body)
        # A rule across items that no schema states: a function_call_output answers a function_call before it.
        if isinstance(body.get("input"), list) and body["input"][0].get("type") == "function_call_output":
            assert_openai_error(r, 400, "No tool call found for function call output with call_id")
            continue
        assert r.status_code == 200, (body, r.text)
    if path == "/v1/completions":
        streamed = post(srv, path, dict(made[0], stream=True))
        media = streamed.headers["content-type"].split(";")[0]
        assert media in doc["paths"][path]["post"]["responses"]["200"]["content"]
