"""An OpenAI-compatible HTTP server in front of one LLMEngine (FastAPI + uvicorn).

    python run.py --serve --port 8000
    mpirun -n 2 python run.py --serve --tp 2          (rank 0 serves, rank 1 replays its steps)

    POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models[/{id}],
    POST /tokenize, POST /detokenize (vLLM's), GET /health,
    GET /metrics (Prometheus text, vLLM's names: the registry --metrics-prom writes)

Two threads. uvicorn's event loop speaks HTTP: it validates a request (pydantic; unknown
fields are tolerated, wrong types and ranges are a 400), tokenizes it in a worker thread,
and hands the engine thread (engine_thread.py) one Job per choice. Nothing the engine does
blocks the event loop: /health answers while the engine is saturated. A client that goes away has its
jobs aborted: the engine drops them before its next step, blocks freed.

What one request may cost the others is bounded (limits.py: the body's bytes before it is
parsed, the prompt's characters before it is tokenized, stop strings, n x max_tokens, a
stream's unread chunks); --api-key guards /v1/* and the tokenizer's routes, --allowed-hosts
the Host header (DNS rebinding); SIGTERM or Ctrl-C ends open requests within
--shutdown-timeout (_Uvicorn). Every error, whatever its status, is in OpenAI's shape, and
every request is one line on the "nano.server" logger (AccessLog).
"""
import asyncio
import json
import logging
import secrets
import time
import uuid
from typing import Annotated, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from nano import checks
from nano.chat import template
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.server.engine_thread import EngineThread, Job, StopStrings
from nano.server.limits import SHUTDOWN_TIMEOUT, Limits

MAX_TOP_LOGPROBS = 20  # OpenAI's limit
ROLES = ("system", "developer", "user", "assistant", "tool")  # the chat roles OpenAI takes
log = logging.getLogger("nano.server")


def _checked_text(value: str) -> str:
    """The check the command line's prompts get (nano/checks.py): JSON's \\ud800 escape can
    make a lone surrogate, which the tokenizer (and UTF-8) cannot take."""
    try:
        return checks.text("the text", value)
    except NanoError as e:
        raise PydanticCustomError("text", str(e)) from None


Text = Annotated[str, AfterValidator(_checked_text)]


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(value) -> list[str | list[int]]:
    """A completion's prompt as OpenAI takes it: a string, a list of token ids, or a batch (a
    list of strings, or of token-id lists); returned as the batch (one prompt: a batch of one)."""
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and all(map(_is_id, value)))
    prompts = [value] if single else value
    if not isinstance(prompts, list) or not prompts:
        raise PydanticCustomError("prompt", "must be a string, a list of token ids, a list of strings or a list "
                                  "of token-id lists, and not empty")
    for i, p in enumerate(prompts):
        where = "" if single else f"prompt {i}: "
        if not (isinstance(p, str) or (isinstance(p, list) and all(map(_is_id, p)))):
            raise PydanticCustomError("prompt", f"{where}must be a string or a list of token ids")
        if not p:
            raise PydanticCustomError("prompt", f"{where}is empty")
        if isinstance(p, str):
            _checked_text(p)
    return prompts


def _content(value, info: ValidationInfo) -> str | None:
    """A message's content as OpenAI takes it: a string, a list of text parts (joined with
    newlines, as vLLM does), or null in an assistant's message (which may hold tool calls
    instead; as in vLLM it need not); other parts (images, audio, files) are a 400."""
    if value is None:
        if info.data.get("role") == "assistant":
            return None
        raise PydanticCustomError("content", "is required (it may be null only in an assistant's message)")
    if isinstance(value, str):
        return _checked_text(value)
    if not isinstance(value, list):
        raise PydanticCustomError("content", "must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise PydanticCustomError("content", f"part {i} is of type {kind!r}: this server takes text only "
                                      "({'type': 'text', 'text': ...})")
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("content", f"part {i}: 'text' must be a string")
        texts.append(_checked_text(part["text"]))
    return "\n".join(texts)


# ---- requests (what OpenAI's API takes; top_k and ignore_eos are extensions, as in vLLM) ----
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields: tolerated
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: the prompt's, scored


class CompletionRequest(Sampling):
    prompt: Annotated[list[str | list[int]], PlainValidator(_prompts)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the text and logprobs start with the prompt's (scored by the engine)
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt scored, nothing generated


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal[ROLES]
    content: str | None = Field(None, validate_default=True)  # absent: as null

    validate_content = field_validator("content", mode="plain")(_content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion's prompt, or a chat's messages in the model's template."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: Text | None = None
    prompt: Text | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: Text | None = None
    tokens: list[int]


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error shape (a response's body, or a stream's last event)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(message: str, status: int = 400, kind: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=status)


# ---- the HTTP side ------------------------------------------------------------------------------
class Server:
    def __init__(self, engine, max_queued: int = 256, metrics=None, limits: Limits = Limits(),
                 stall_timeout: float | None = None):
        self.engine, self.max_queued, self.limits = engine, max_queued, limits
        self.model_name = engine.shard.model_dir.name
        self.thread = EngineThread(engine, metrics, stall_timeout)
        self.open: set[Job] = set()  # jobs submitted and not yet ended (event loop only)
        self.created = int(time.time())
        self.closing = False  # shutting down: no new requests
        self.deadline: asyncio.TimerHandle | None = None  # when the open jobs are ended

    def check_model(self, model: str | None) -> None:
        """A model named in a request (or a URL) is this server's, or a 404 as OpenAI answers it."""
        if model is not None and model != self.model_name:
            raise BadRequest(f"the model {model!r} does not exist: this server has {self.model_name!r}", 404,
                             code="model_not_found", param="model")

    def check(self, body: Sampling) -> StopStrings:
        """What can be checked before tokenizing: the model, and the stop strings (returned)."""
        self.check_model(body.model)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.limits.stop_strings:
            raise BadRequest(f"stop: {len(stops)} strings, more than this server's {self.limits.stop_strings}")
        if any(len(s) > self.limits.stop_chars for s in stops):
            raise BadRequest(f"stop: a string longer than this server's {self.limits.stop_chars} characters")
        return StopStrings(tuple(s for s in stops if s))

    def check_chars(self, chars: int) -> None:
        if chars > self.limits.prompt_chars:
            raise BadRequest(f"the prompt has {chars} characters, more than this server's {self.limits.prompt_chars}")

    def check_ids(self, name: str, ids: list[int]) -> None:
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise BadRequest(f"{name}: token ids must be in [0, {vocab})")

    async def submit(self, body: Sampling, prompts: list[list[int]], stops: StopStrings, top_logprobs: int | None,
                     max_tokens: int, echo: bool = False) -> list[Job]:
        """Start body.n jobs for each prompt, the whole request checked against the limits first;
        returns them in OpenAI's choice order (prompt i's choices are i*n .. i*n+n-1). echo: each
        prompt's text and (with top_logprobs) its logprobs come first."""
        if self.closing or self.stopped():
            raise BadRequest("the server is shutting down" if self.closing else f"engine stopped: {self.thread.error}",
                             503, "server_error")
        choices = body.n * len(prompts)
        if choices > self.max_queued:  # would never fit: not a "try again"
            raise BadRequest(f"n: {choices} choices" + (f" ({len(prompts)} prompts x {body.n})" if len(prompts) > 1
                                                        else "") +
                             f", more than this server's {self.max_queued} requests in flight")
        if len(self.open) + choices > self.max_queued:
            raise BadRequest(f"the server has {len(self.open)} requests in flight (at most {self.max_queued}): "
                             "try again later", 503, "server_overloaded")
        context, capped = self.engine.max_model_len, []
        for i, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt {i}"
            if len(prompt) + 1 > context:
                raise BadRequest(f"this model's maximum context length is {context} tokens; the {name} has "
                                 f"{len(prompt)}")
            self.check_ids(name, prompt)  # after the length: bounded
            capped.append(min(max_tokens, context - len(prompt)))
        if body.n * sum(capped) > self.limits.request_tokens:
            raise BadRequest(f"n x max_tokens is {body.n} x {sum(capped)}"
                             + (f" (over {len(prompts)} prompts)" if len(prompts) > 1 else "") +
                             f", more than this server's {self.limits.request_tokens} tokens a request: ask for "
                             "fewer choices or tokens")
        # The engine scores the prompt for echo's logprobs, for prompt_logprobs, and for max_tokens 0.
        asked = [k for k in (top_logprobs if echo else None, body.prompt_logprobs, 0 if max_tokens == 0 else None)
                 if k is not None]
        loop, jobs = asyncio.get_running_loop(), []
        for prompt, most in zip(prompts, capped):
            for i in range(body.n):
                seed = None if body.seed is None else body.seed + i
                params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                        max_tokens=most, seed=seed, ignore_eos=body.ignore_eos,
                                        return_logits=top_logprobs is not None, prompt_logprobs=max(asked, default=None))
                try:
                    params.validate()
                except NanoError as e:
                    raise BadRequest(str(e)) from None
                jobs.append(Job(prompt, params, stops, top_logprobs, asyncio.Queue(), loop, echo,
                                body.prompt_logprobs))
        for job in jobs:
            self.thread.inbox.put(("add", job))
        self.open.update(jobs)
        return jobs

    def abort(self, job: Job) -> None:
        self.thread.inbox.put(("abort", job))

    def release(self, jobs: list[Job]) -> None:
        """The request is over (finished, failed or gone): abort what still runs."""
        for job in jobs:
            self.abort(job)
        self.open.difference_update(jobs)

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Completion prompts, as plain text, on a worker thread (the event loop keeps serving)."""
        self.check_chars(sum(map(len, texts)))
        return await asyncio.to_thread(lambda: [self.engine.tokenizer.encode(t, True) for t in texts])

    async def tokenize_chat(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """The conversation in the model's chat template, on a worker thread (content null: empty)."""
        self.check_chars(sum(len(m.content or "") for m in messages))
        conversation = [{"role": m.role, "content": m.content or ""} for m in messages]
        try:
            return await asyncio.to_thread(template.encode, self.engine.tokenizer, conversation, add_generation_prompt)
        except NanoError as e:
            raise BadRequest(str(e)) from None

    def stopped(self) -> JSONResponse | None:
        """A 503 if the engine thread is gone (it failed, or the server is shutting down)."""
        if self.thread.error or not self.thread.is_alive():
            return error_response(f"engine stopped: {self.thread.error}", 503, "server_error")
        return None

    def shut_down(self, grace: float) -> None:
        """Take no new requests; end the open ones in `grace` seconds unless they finish first
        (sooner if asked again). On the event loop."""
        self.closing = True
        if self.deadline:
            self.deadline.cancel()
        self.deadline = asyncio.get_running_loop().call_later(grace, self._end_open)

    def _end_open(self) -> None:
        for job in self.open:  # each waiting response ends with this error (a stream: then [DONE])
            job.events.put_nowait({"error": "the server is shutting down", "status": 503})


class BodyLimit:
    """A request body over `limit` bytes gets 413 before it is parsed: one whose Content-Length
    says so at once, a chunked one once its bytes pass the limit. (FastAPI's max_body_size
    answers plain text, not OpenAI's error shape.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            return await error_response(self.message, 413)(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.limit:  # raised while FastAPI reads the body: answered by the HTTPException handler
                raise HTTPException(413, self.message)
            return message
        await self.app(scope, counted, send)

    @property
    def message(self) -> str:
        return f"the request body is larger than this server's {self.limit} bytes"


class HostCheck:
    """Starlette's Host header check (TrustedHostMiddleware), its refusal in OpenAI's error
    shape instead of Starlette's plain text."""

    def __init__(self, app, allowed_hosts: list[str]):
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope, receive, send):
        allowed = False

        async def passed(*_):
            nonlocal allowed
            allowed = True

        async def refused(_):  # Starlette's plain-text answer: not sent, ours is
            pass
        await TrustedHostMiddleware(passed, self.allowed_hosts, www_redirect=False)(scope, receive, refused)
        if allowed:
            return await self.app(scope, receive, send)
        await error_response("the Host header names a host this server does not answer for (--allowed-hosts)",
                             400)(scope, receive, send)


class AccessLog:
    """One line per request on the "nano.server" logger: method, path, status, milliseconds
    until the response's last byte (a stream's [DONE]) and, for an error, its message. Under
    2xx at INFO, 4xx at WARNING, 5xx at ERROR (--log-level picks what shows)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, body, failure = time.perf_counter(), 500, b"", None

        async def sending(message):
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status >= 400 and len(body) < 2**16:  # an error's body: small JSON
                body += message.get("body", b"")
            await send(message)
        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # a bug: answered 500 by Starlette's outermost middleware, after this
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            line = f"{scope['method']} {scope['path']} {status} {1e3 * (time.perf_counter() - start):.1f} ms"
            if failure or status >= 400:
                line += ": " + (failure or _reason(body))
            log.log(logging.ERROR if failure or status >= 500 else logging.WARNING if status >= 400
                    else logging.INFO, line)


def _reason(body: bytes) -> str:
    """An error response's message (OpenAI's shape), else its text."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")


def allowed_hosts(host: str, hosts: str | None) -> list[str]:
    """--allowed-hosts (comma-separated; '*': any). By default a server bound to one address
    answers only the names of that address and of loopback, so a web page whose name an attacker
    points at 127.0.0.1 (DNS rebinding) cannot reach it; one bound to every address takes any."""
    if hosts is not None:
        return [h.strip() for h in hosts.split(",") if h.strip()]
    if host in ("", "0.0.0.0", "::"):
        return ["*"]
    named = f"[{host}]" if ":" in host else host  # an IPv6 address, as a Host header writes it
    return list(dict.fromkeys(["localhost", "127.0.0.1", "[::1]", named]))


def create_app(engine, max_queued: int = 256, metrics=None, limits: Limits = Limits(),
               api_key: str | None = None, hosts: list[str] = ("*",), stall_timeout: float | None = None) -> FastAPI:
    """The FastAPI app; its engine thread starts with the app and stops with it."""
    server = Server(engine, max_queued, metrics, limits, stall_timeout)
    app = FastAPI(title="nano", lifespan=_lifespan(server))
    app.state.server = server
    app.add_middleware(BodyLimit, limit=limits.body_bytes)
    if "*" not in hosts:
        app.add_middleware(HostCheck, allowed_hosts=hosts)
    app.add_middleware(AccessLog)  # the outermost of these: it sees every answer

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        errors = exc.errors()  # a union field has one per member: the text check's says the most
        first = next((e for e in errors if e["type"] == "text"), errors[0])
        if first["type"] == "json_invalid":
            return error_response(f"the body is not valid JSON: {first['ctx']['error']}")
        # The fields' path; a union member's name (list[int], function-after[...]) is not a field.
        where = ".".join(str(p) for p in first["loc"] if p != "body" and (isinstance(p, int) or p.isidentifier()))
        return error_response(f"{where}: {first['msg']}" if where else first["msg"], param=where or None)

    @app.exception_handler(HTTPException)  # Starlette's and FastAPI's own: 404, 405, 413, a body not parsed
    async def http_error(_, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code, "server_error" if exc.status_code >= 500
                              else "invalid_request_error")

    @app.exception_handler(BadRequest)
    async def bad(_, exc: BadRequest):
        return error_response(str(exc), exc.status, exc.kind, exc.code, exc.param)

    @app.exception_handler(Exception)  # a bug: Starlette's outermost middleware answers with this, then raises
    async def failed(_, exc: Exception):
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")

    @app.get("/health")
    async def health():
        return server.stopped() or {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if server.stopped():  # no one would answer
            return server.stopped()
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        server.thread.inbox.put(("metrics", lambda text: loop.call_soon_threadsafe(done.set_result, text)))
        return Response(await done, media_type=CONTENT_TYPE_LATEST)

    guard = [Depends(_key_check(api_key))] if api_key else []
    v1, tokenizer = APIRouter(prefix="/v1", dependencies=guard), APIRouter(dependencies=guard)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "nano"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")
    async def model(model: str):
        server.check_model(model)
        return model_card()

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        stops = server.check(body)
        if body.max_tokens == 0 and not body.echo:
            raise BadRequest("max_tokens: 0 generates nothing; it is allowed with echo, to score the prompt")
        texts = [p for p in body.prompt if isinstance(p, str)]
        encoded = iter(await server.tokenize(texts))
        prompts = [next(encoded) if isinstance(p, str) else p for p in body.prompt]
        jobs = await server.submit(body, prompts, stops, body.logprobs,
                                   16 if body.max_tokens is None else body.max_tokens, body.echo)
        return await respond(server, request, body, jobs, "text_completion", "cmpl")

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        stops = server.check(body)
        if engine.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template: use /v1/completions")
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens or engine.max_model_len
        jobs = await server.submit(body, [await server.tokenize_chat(body.messages)], stops, top, max_tokens)
        return await respond(server, request, body, jobs, "chat.completion", "chatcmpl")

    @tokenizer.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give either prompt or messages")
        if body.messages is None:
            tokens = (await server.tokenize([body.prompt]))[0]
        elif engine.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template: tokenize a prompt")
        else:
            tokens = await server.tokenize_chat(body.messages, body.add_generation_prompt)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @tokenizer.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        server.check_ids("tokens", body.tokens)
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens, False)}

    app.include_router(v1)
    app.include_router(tokenizer)
    return app


def _key_check(api_key: str):
    """A dependency: the request's Authorization: Bearer KEY is the server's key, or a 401."""
    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(HTTPBearer(auto_error=False))):
        # compare_digest: the time taken does not tell how much of a guess was right
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise BadRequest("a valid API key is needed: send the header Authorization: Bearer KEY", 401,
                             code="invalid_api_key")
    return check


def _lifespan(server: Server):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.thread.start()
        yield
        server.thread.inbox.put(None)
        server.thread.join(timeout=30)
    return lifespan


# ---- responses ------------------------------------------------------------------------------------
async def respond(server: Server, request: Request, body: Sampling, jobs: list[Job], kind: str, prefix: str):
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": kind, "created": created, "model": server.model_name}
    if body.stream:
        options = body.stream_options or StreamOptions()
        return EventSourceResponse(stream(server, request, jobs, body.n, head, kind, options))
    try:
        results = await asyncio.gather(*(collect(job, request) for job in jobs))
    finally:
        server.release(jobs)
    if any(r is None for r in results):
        return error_response("client disconnected", 499)
    failed = [r for r in results if r["error"]]
    if failed:  # rejected by the engine (400), or the engine failed (500)
        status = failed[0]["status"]
        raise BadRequest(failed[0]["error"], status, "server_error" if status >= 500 else "invalid_request_error")
    choices = []
    for i, r in enumerate(results):
        if kind == "chat.completion":
            choice = {"index": i, "message": {"role": "assistant", "content": r["text"]},
                      "logprobs": chat_logprobs(r["logprobs"]) if jobs[i].top_logprobs is not None else None,
                      "finish_reason": r["finish_reason"]}
        else:
            choice = {"index": i, "text": r["text"], "finish_reason": r["finish_reason"],
                      "logprobs": completion_logprobs(r["logprobs"]) if jobs[i].top_logprobs is not None else None}
        if jobs[i].prompt_logprobs is not None:
            choice["prompt_logprobs"] = r["prompt_logprobs"]
        choices.append(choice)
    counts = {i: (r["completion_tokens"], r["cached_tokens"]) for i, r in enumerate(results)}
    return {**head, "choices": choices, "usage": usage_of(jobs, body.n, counts)}


async def collect(job: Job, request: Request) -> dict | None:
    """A job's events gathered into one result; None if the client went away first."""
    out = {"text": "", "logprobs": [], "finish_reason": None, "error": None, "prompt_logprobs": None}
    while out["finish_reason"] is None and out["error"] is None:
        try:
            event = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None
            continue
        out["text"] += event.get("text", "")
        out["logprobs"] += event.get("logprobs") or []
        out["prompt_logprobs"] = out["prompt_logprobs"] or event.get("prompt_logprobs")
        out["error"], out["status"] = event.get("error"), event.get("status", 400)
        out["finish_reason"] = event.get("finish_reason")
        out["completion_tokens"], out["cached_tokens"] = event.get("completion_tokens", 0), event.get("cached_tokens", 0)
    return out


async def stream(server: Server, request: Request, jobs: list[Job], n: int, head: dict, kind: str,
                 options: StreamOptions):
    """SSE chunks in OpenAI's format as the engine produces text, then usage (include_usage),
    then [DONE]; with continuous_usage_stats every chunk carries the request's usage so far.
    The client going away cancels this generator: its jobs are aborted in the finally."""
    chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
    events = asyncio.Queue()

    async def forward(i, job):
        while True:
            event = await job.events.get()
            if events.qsize() >= server.limits.stream_backlog:  # the client stopped reading: stop generating
                server.abort(job)
                event = {"error": f"the client left more than {server.limits.stream_backlog} chunks unread: "
                                  "the choice was aborted"}
            events.put_nowait((i, event))
            if event.get("finish_reason") or event.get("error"):
                return

    tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    counts, live = {}, len(jobs)  # counts: as usage_of takes them

    def chunk(choices: list[dict]) -> bytes:
        usage = {"usage": usage_of(jobs, n, counts)} if options.continuous_usage_stats else {}
        return sse({**head, "object": chunk_kind, "choices": choices, **usage})
    try:
        if kind == "chat.completion":
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(jobs))])
        while live:
            i, event = await events.get()
            if event.get("error"):
                yield sse(error_body(event["error"], "server_error" if event.get("status", 400) >= 500
                                     else "invalid_request_error"))
                live -= 1
                continue
            counts[i] = (event["completion_tokens"], event["cached_tokens"])
            lp = event.get("logprobs")
            if kind == "chat.completion":
                choice = {"index": i, "delta": {"content": event["text"]} if event["text"] else {},
                          "logprobs": chat_logprobs(lp) if lp else None, "finish_reason": event["finish_reason"]}
            else:
                choice = {"index": i, "text": event["text"], "logprobs": completion_logprobs(lp) if lp else None,
                          "finish_reason": event["finish_reason"]}
            if event.get("prompt_logprobs"):  # the first chunk of a choice, as vLLM sends it
                choice["prompt_logprobs"] = event["prompt_logprobs"]
            yield chunk([choice])
            live -= event["finish_reason"] is not None
        if options.include_usage:
            yield sse({**head, "object": chunk_kind, "choices": [], "usage": usage_of(jobs, n, counts)})
        yield format_sse_event(data_str="[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        server.release(jobs)


def sse(payload: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False))


def usage_of(jobs: list[Job], n: int, counts: dict[int, tuple[int, int]]) -> dict:
    """A request's usage (so far): each prompt's tokens once, and of those the ones its first
    choice found in the prefix cache; every choice's generated tokens. counts: choice index ->
    (tokens generated, cached prompt tokens), for the choices heard from."""
    prompt = sum(len(jobs[i].prompt) for i in range(0, len(jobs), n))
    cached = sum(counts.get(i, (0, 0))[1] for i in range(0, len(jobs), n))
    completion = sum(c for c, _ in counts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(entries: list[dict]) -> dict:
    """OpenAI's legacy shape from engine_thread's entries (an echoed prompt's first: its first
    token has no logprob and no top ones)."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else top_by_token(e["top"]) for e in entries],
            "text_offset": [e["offset"] for e in entries]}


def top_by_token(top: list[dict]) -> dict[str, float]:
    """The top logprobs keyed by token text, as the legacy shape wants: one key each, should
    two tokens show the same text (the second is keyed by its id, as vLLM's token_id:N)."""
    out = {}
    for e in top:
        out[f"token_id:{e['id']}" if e["token"] in out else e["token"]] = e["logprob"]
    return out


def chat_logprobs(entries: list[dict]) -> dict:
    def item(e):
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}
    return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top"]]} for e in entries]}


class _Uvicorn(uvicorn.Server):
    """uvicorn, with a signal's shutdown bounded: SIGTERM or Ctrl-C stops taking connections
    and gives the open requests `grace` seconds, then ends them (a stream: an error event,
    then [DONE]); a second signal ends them at once. Not uvicorn's own handling, which waits
    for open streams without limit, cuts them on a second Ctrl-C (no [DONE], tracebacks) and
    raises the signal again once done (exit status 143 on SIGTERM)."""

    def __init__(self, config: uvicorn.Config, server: Server, grace: float):
        super().__init__(config)
        self.nano, self.grace = server, grace
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # A signal handler: it may run while the loop waits in select, hence call_soon_threadsafe.
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.nano.shut_down, 0 if self.should_exit else self.grace)
        self.should_exit = True


def serve(engine, host: str, port: int, max_queued: int, metrics=None, limits: Limits = Limits(),
          api_key: str | None = None, hosts: list[str] = ("*",), shutdown_timeout: float = SHUTDOWN_TIMEOUT,
          stall_timeout: float | None = None, log_level: str = "info") -> None:
    app = create_app(engine, max_queued, metrics, limits, api_key, hosts, stall_timeout)
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(log_level.upper())
    # uvicorn's own lines at the same level; its access log off: AccessLog writes one line a request.
    # uvicorn's limit on the graceful wait is a backstop: the server ends its requests before it.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    _Uvicorn(config, app.state.server, shutdown_timeout).run()
