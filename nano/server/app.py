"""An OpenAI-compatible HTTP server in front of one LLMEngine (FastAPI + uvicorn).

    python run.py --serve --port 8000
    mpirun -n 2 python run.py --serve --tp 2          (rank 0 serves, rank 1 replays its steps)

    POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (stream or not),
    GET /v1/models[/{id}], POST /tokenize, POST /detokenize (vLLM's), GET /health, GET|POST /ping, GET /version (vLLM's),
    GET /metrics (Prometheus text, vLLM's names: the registry --metrics-prom writes),
    with --enable-lora and runtime updating allowed: POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's),
    GET /openapi.json (each route's body, and the statuses it answers, as sent)

Two threads. uvicorn's event loop speaks HTTP: it validates a request (pydantic; a wrong
type or range, a field nano does not implement (fields.py) or an unknown one is a 400 naming
it), tokenizes it in a worker thread, and hands the engine thread (engine_thread.py) one Job
per choice. Nothing the engine does
blocks the event loop: /health answers while the engine is saturated, and /metrics from the
snapshot the engine thread publishes between steps. A client that goes away has its jobs
aborted: the engine drops them before its next step, blocks freed.

What one request may cost the others is bounded (limits.py: the body's bytes before it is
parsed, the prompt's characters before it is tokenized, stop strings, n x max_tokens, a
stream's unread chunks); --api-key guards /v1/* and the tokenizer's routes, --allowed-hosts
the Host header (DNS rebinding), --allowed-origins (and vLLM's other CORS flags) which web
pages' scripts may read the answers; SIGTERM or Ctrl-C ends open requests within
--shutdown-timeout (_Uvicorn). Every error, whatever its status, is in OpenAI's shape, and
every request is one line on the "nano.server" logger (AccessLog), escaped (LogFormatter).
"""
import asyncio
import gc
import secrets
import signal
import uuid
import warnings

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from nano.cli.output import exit_on_error
from nano.errors import NanoError
from nano.server import __version__, tool_parsers, tools
from nano.server.adapters import Adapters, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from nano.server.limits import CORS, SHUTDOWN_TIMEOUT, Limits
from nano.server.middleware import AccessLog, BodyLimit, Cors, HostCheck, log, log_config
from nano.server.completions import respond
from nano.server.responses_api import create as create_response
from nano.server.responses_schemas import ResponsesRequest
from nano.server.schemas import (BadRequest, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                 error_response, errors)
from nano.server.serving import Server
from nano.telemetry.watchdog import alone

# What /openapi.json says the routes answer beyond JSON: a generation, with "stream": true,
# server-sent events (and the errors it may end in); /metrics, Prometheus's text format.
GENERATION = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                    "description": "The completion; with stream: true, server-sent events ending in data: [DONE]."},
              **errors(400, 404, 413, 500, 503)}
RESPONSES = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                   "description": "The response; with stream: true, OpenAI's response.* events as server-sent "
                                  "events, ending in response.completed (its status incomplete when cut short) or "
                                  "in an error event and response.failed."},
             **errors(400, 404, 413, 500, 503)}
METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                 "description": "Prometheus's text format: vLLM's series and nano's."}}


def create_app(engine, max_queued: int = 256, metrics=None, limits: Limits = Limits(),
               api_key: str | None = None, hosts: list[str] = ("*",), stall_timeout: float | None = None,
               chat_template: str | None = None, tool_parser: str | None = None, auto_tools: bool = False,
               cors: dict = CORS, served_names: list[str] | None = None,
               generation_defaults: dict | None = None, adapters: Adapters | None = None,
               own_process: bool = False) -> FastAPI:
    """The FastAPI app; its engine thread starts with the app and stops with it. chat_template:
    the template's text in place of the model's; tool_parser, auto_tools: tools.py's; cors:
    CORSMiddleware's arguments (limits.CORS: vLLM's defaults); served_names: the model's names
    (None: its folder's); generation_defaults: generation_config.read's; adapters: the LoRA
    adapters served (adapters.py), or None; own_process: the engine steps in a child process
    (engine_process.py)."""
    if tool_parser is not None:
        tool_parsers.parser(tool_parser)  # an unknown name: a ValueError naming it
    server = Server(engine, max_queued, metrics, limits, stall_timeout, chat_template, tool_parser, auto_tools,
                    served_names, generation_defaults, adapters, own_process)
    # Every route may answer 400 for a Host header not allowed; the routes add what else they answer.
    app = FastAPI(title="nano", lifespan=_lifespan(server), responses=errors(400) if "*" not in hosts else None)
    app.state.server = server
    app.openapi = _without_422(app.openapi)
    app.add_middleware(BodyLimit, limit=limits.body_bytes)
    # Outside BodyLimit and the routes (the API key's check among them): a preflight is answered
    # before either, and their errors carry the CORS headers. Inside HostCheck: a request for a
    # name this server does not answer for gets nothing else.
    app.add_middleware(Cors, **cors)
    if "*" not in hosts:
        app.add_middleware(HostCheck, allowed_hosts=hosts)
    app.add_middleware(AccessLog)  # the outermost of these: it sees every answer

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        errors = exc.errors()  # a union field has one per member: the text check's says the most
        first = next((e for e in errors if e["type"] == "text"), errors[0])
        if first["type"] == "json_invalid":
            return error_response(f"the body is not valid JSON: {first['ctx']['error']}")
        # The fields' path; a union member's name (list[int], function-after[...]) is not a field, but
        # an unknown field's name, whatever its spelling, is.
        path, unknown = first["loc"][1:], first["type"] == "extra_forbidden"
        where = ".".join(str(p) for i, p in enumerate(path)
                         if isinstance(p, int) or p.isidentifier() or (unknown and i == len(path) - 1))
        message = "an unknown field (nano refuses what it would ignore)" if unknown else first["msg"]
        return error_response(f"{where}: {message}" if where else message, param=where or None)

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

    # One route for both methods, so that a 405 on /ping names both (two routes' would name one).
    @app.api_route("/ping", methods=["GET", "POST"], responses=errors(503))
    async def ping():  # vLLM's (SageMaker's health check): /health's answer
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses=METRICS)
    async def metrics():
        # The registry as the engine thread last set it (after its last step, request added or
        # abort): a step in progress never delays the answer.
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    guard, refused = ([Depends(_key_check(api_key))], errors(401)) if api_key else ([], {})
    v1 = APIRouter(prefix="/v1", dependencies=guard, responses=refused)
    tokenizer = APIRouter(dependencies=guard, responses={**refused, **errors(400, 404, 413)})

    permission = model_permission(server.created)

    def model_card(name: str) -> dict:
        """vLLM's ModelCard: root is the model folder, parent none (a base model)."""
        return {"id": name, "object": "model", "created": server.created, "owned_by": "nano",
                "root": str(server.model_dir), "parent": None, "max_model_len": engine.max_model_len,
                "permission": [permission]}

    def card_of(name: str) -> dict:
        lora = server.lora_of(name)
        return model_card(name) if lora is None else adapters.card(lora, model_card(server.model_name))

    @v1.get("/models")
    async def models():
        names = server.names + list(adapters.named if adapters else ())
        return {"object": "list", "data": [card_of(name) for name in names]}

    @v1.get("/models/{model:path}", responses=errors(404))
    async def model(model: str):
        server.check_model(model)
        return card_of(model)

    if adapters is not None and adapters.runtime_updates:  # vLLM's switch: else no such routes (404)
        log.warning("LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for "
                    "local development!")

        @v1.post("/load_lora_adapter", response_class=PlainTextResponse, responses=errors(400, 404))
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return await adapters.load(body.lora_name, body.lora_path, server.thread.inbox)

        @v1.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=errors(400, 404))
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return adapters.unload(body.lora_name, server.thread.inbox)

    @v1.post("/completions", responses=GENERATION)
    async def completions(body: CompletionRequest, request: Request):
        stops = server.check(body)
        if body.max_tokens == 0 and not body.echo:
            raise BadRequest("max_tokens: 0 generates nothing; it is allowed with echo, to score the prompt")
        texts = [p for p in body.prompt if isinstance(p, str)]
        grammar = await server.structured(body)
        encoded = iter(await server.tokenize(texts))
        prompts = [next(encoded) if isinstance(p, str) else p for p in body.prompt]
        jobs = await server.submit(body, prompts, stops, body.logprobs,
                                   16 if body.max_tokens is None else body.max_tokens, body.echo, grammar)
        return await respond(server, request, body, jobs, "text_completion", "cmpl")

    @v1.post("/chat/completions", responses=GENERATION)
    async def chat(body: ChatRequest, request: Request):
        stops = server.check(body)
        if (server.chat_template or engine.tokenizer.chat_template) is None:
            raise BadRequest("this model has no chat template: use /v1/completions")
        server.check_tools(body.tools)
        choice = tools.check(body.tools, body.tool_choice, server.tool_parser, server.auto_tools)
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens  # None: the rest of the context
        grammar = await server.structured(body, tools.forced_schema(body.tools, choice, body.parallel_tool_calls)
                                                  if tools.forced(choice) else None)
        prompt = await server.tokenize_chat(body.messages, body.add_generation_prompt, body.tools)
        jobs = await server.submit(body, [prompt], stops, top, max_tokens, grammar=grammar)
        return await respond(server, request, body, jobs, "chat.completion", "chatcmpl")

    @v1.post("/responses", responses=RESPONSES)
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(server, request, body)

    @tokenizer.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give either prompt or messages")
        if body.messages is None:
            if body.tools is not None:
                raise BadRequest("tools: only with messages", param="tools")
            tokens = (await server.tokenize([body.prompt]))[0]
        elif (server.chat_template or engine.tokenizer.chat_template) is None:
            raise BadRequest("this model has no chat template: tokenize a prompt")
        else:
            server.check_tools(body.tools)
            tokens = await server.tokenize_chat(body.messages, body.add_generation_prompt, body.tools)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @tokenizer.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        server.check_ids("tokens", body.tokens)
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens, False)}

    app.include_router(v1)
    app.include_router(tokenizer)
    return app


def model_permission(created: int) -> dict:
    """vLLM's ModelPermission, with its values: what OpenAI's retired permission objects said."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def _without_422(openapi):
    """FastAPI's openapi(), less the 422 it documents for every route with a body or a path
    parameter: this server answers a body it cannot validate with 400 (the handler above). Each
    operation's id is made unique by its method: FastAPI gives a route's methods one id (and
    warns of it)."""
    def documented() -> dict:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Duplicate Operation ID")
            schema = openapi()  # built once, then FastAPI's cached copy
        for operations in schema["paths"].values():
            for method, operation in operations.items():
                operation["operationId"] = f"{operation['operationId'].rsplit('_', 1)[0]}_{method}"
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
        if server.defaults:  # vLLM's warning, once, with the values
            log.info("Default sampling parameters have been overridden by the model's Hugging Face generation "
                     "config: %s (--generation-config vllm: nano's own)", server.defaults)
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
          stall_timeout: float | None = None, log_level: str = "info", chat_template: str | None = None,
          tool_parser: str | None = None, auto_tools: bool = False, cors: dict = CORS,
          served_names: list[str] | None = None, generation_defaults: dict | None = None,
          adapters: Adapters | None = None) -> None:
    """The server until a signal ends it, or its engine's process ends (then one error line, status 1).
    The engine steps in a process of its own when it is the whole run on the CPU: not under
    mpirun (its ranks step together), not a data-parallel front, not with LoRA adapters (whose
    host copies the server's side reads), not on a GPU (a CUDA context does not survive a fork)."""
    own_process = (alone() and adapters is None and not hasattr(engine, "snapshot")
                   and engine.device.kind == "cpu")
    app = create_app(engine, max_queued, metrics, limits, api_key, hosts, stall_timeout, chat_template, tool_parser,
                     auto_tools, cors, served_names, generation_defaults, adapters, own_process)
    # Before the first request: the grammars' vocabulary, then the heap as it stands frozen out of
    # the collector's full passes (vLLM's freeze_gc_heap), each of which would otherwise walk every
    # object of the model, tokenizer and app while all threads wait (0.1 s and more on 2 cores).
    app.state.server.build_vocabulary()
    gc.collect()
    gc.freeze()
    # uvicorn's own lines at the same level and through the same formatter; its access log off:
    # AccessLog writes one line a request. uvicorn's limit on the graceful wait is a backstop: the
    # server ends its requests before it.
    config = uvicorn.Config(app, host=host, port=port, log_config=log_config(log_level), log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=shutdown_timeout + 5)
    server = app.state.server
    http = _Uvicorn(config, server, shutdown_timeout)
    if own_process:
        server.thread.on_death = lambda: http.handle_exit(signal.SIGTERM, None)
    http.run()
    if own_process and server.thread.error:  # a failure, not bad input: status 1
        exit_on_error(NanoError(f"engine stopped: {server.thread.error}"), 1)
