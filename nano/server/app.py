"""An OpenAI-compatible HTTP server in front of one LLMEngine (FastAPI + uvicorn).

    python run.py --serve --port 8000
    mpirun -n 2 python run.py --serve --tp 2          (rank 0 serves, rank 1 replays its steps)

    POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models[/{id}],
    POST /tokenize, POST /detokenize (vLLM's), GET /health,
    GET /metrics (Prometheus text, vLLM's names: the registry --metrics-prom writes),
    GET /openapi.json (each route's body, and the statuses it answers, as sent)

Two threads. uvicorn's event loop speaks HTTP: it validates a request (pydantic; unknown
fields are tolerated, wrong types and ranges are a 400), tokenizes it in a worker thread,
and hands the engine thread (engine_thread.py) one Job per choice. Nothing the engine does
blocks the event loop: /health answers while the engine is saturated, and /metrics from the
snapshot the engine thread publishes between steps. A client that goes away has its jobs
aborted: the engine drops them before its next step, blocks freed.

What one request may cost the others is bounded (limits.py: the body's bytes before it is
parsed, the prompt's characters before it is tokenized, stop strings, n x max_tokens, a
stream's unread chunks); --api-key guards /v1/* and the tokenizer's routes, --allowed-hosts
the Host header (DNS rebinding); SIGTERM or Ctrl-C ends open requests within
--shutdown-timeout (_Uvicorn). Every error, whatever its status, is in OpenAI's shape, and
every request is one line on the "nano.server" logger (AccessLog), escaped (LogFormatter).
"""
import asyncio
import secrets
import time

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from nano.chat import template
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.server.engine_thread import EngineThread, Job, StopStrings
from nano.server.limits import SHUTDOWN_TIMEOUT, Limits
from nano.server.middleware import AccessLog, BodyLimit, HostCheck, log_config
from nano.server.responses import respond
from nano.server.schemas import (BadRequest, ChatRequest, CompletionRequest, DetokenizeRequest, Message, Sampling,
                                 TokenizeRequest, error_response, errors)

# What /openapi.json says the routes answer beyond JSON: a generation, with "stream": true,
# server-sent events (and the errors it may end in); /metrics, Prometheus's text format.
GENERATION = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                    "description": "The completion; with stream: true, server-sent events ending in data: [DONE]."},
              **errors(400, 404, 413, 500, 503)}
METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                 "description": "Prometheus's text format: vLLM's series and nano's."}}


# ---- the HTTP side ------------------------------------------------------------------------------
class Server:
    def __init__(self, engine, max_queued: int = 256, metrics=None, limits: Limits = Limits(),
                 stall_timeout: float | None = None):
        self.engine, self.max_queued, self.limits = engine, max_queued, limits
        self.model_name = engine.model_name
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


def create_app(engine, max_queued: int = 256, metrics=None, limits: Limits = Limits(),
               api_key: str | None = None, hosts: list[str] = ("*",), stall_timeout: float | None = None) -> FastAPI:
    """The FastAPI app; its engine thread starts with the app and stops with it."""
    server = Server(engine, max_queued, metrics, limits, stall_timeout)
    # Every route may answer 400 for a Host header not allowed; the routes add what else they answer.
    app = FastAPI(title="nano", lifespan=_lifespan(server), responses=errors(400) if "*" not in hosts else None)
    app.state.server = server
    app.openapi = _without_422(app.openapi)
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

    @app.exception_handler(HTTPException)  # Starlette's and FastAPI's: 404, 405 (with Allow), 413, a body not parsed
    async def http_error(_, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code, "server_error" if exc.status_code >= 500
                              else "invalid_request_error", headers=exc.headers)

    @app.exception_handler(BadRequest)
    async def bad(_, exc: BadRequest):
        return error_response(str(exc), exc.status, exc.kind, exc.code, exc.param)

    @app.exception_handler(Exception)  # a bug: Starlette's outermost middleware answers with this, then raises
    async def failed(_, exc: Exception):
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")

    @app.get("/health", responses=errors(503))
    async def health():
        return server.stopped() or {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses=METRICS)
    async def metrics():
        # The registry as the engine thread last set it (after its last step, request added or
        # abort): a step in progress never delays the answer.
        return Response(server.thread.export.text(), media_type=CONTENT_TYPE_LATEST)

    guard, refused = ([Depends(_key_check(api_key))], errors(401)) if api_key else ([], {})
    v1 = APIRouter(prefix="/v1", dependencies=guard, responses=refused)
    tokenizer = APIRouter(dependencies=guard, responses={**refused, **errors(400, 404, 413)})

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "nano"}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}", responses=errors(404))
    async def model(model: str):
        server.check_model(model)
        return model_card()

    @v1.post("/completions", responses=GENERATION)
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

    @v1.post("/chat/completions", responses=GENERATION)
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


def _without_422(openapi):
    """FastAPI's openapi(), less the 422 it documents for every route with a body or a path
    parameter: this server answers a body it cannot validate with 400 (the handler above)."""
    def documented() -> dict:
        schema = openapi()  # built once, then FastAPI's cached copy
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)
        return schema
    return documented


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
    # uvicorn's own lines at the same level and through the same formatter; its access log off:
    # AccessLog writes one line a request. uvicorn's limit on the graceful wait is a backstop: the
    # server ends its requests before it.
    config = uvicorn.Config(app, host=host, port=port, log_config=log_config(log_level), log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=shutdown_timeout + 5)
    _Uvicorn(config, app.state.server, shutdown_timeout).run()
