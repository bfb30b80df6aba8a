"""An OpenAI-compatible HTTP server in front of one LLMEngine (FastAPI + uvicorn).

    python run.py --serve --port 8000
    mpirun -n 2 python run.py --serve --tp 2          (rank 0 serves, rank 1 replays its steps)

    POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models,
    GET /health, GET /metrics (Prometheus text: the engine's snapshot, as --metrics-prom)

Two threads. uvicorn's event loop speaks HTTP: it validates a request (pydantic; unknown
fields are tolerated, wrong types and ranges are a 400), tokenizes it in a worker thread,
and hands the engine thread (engine_thread.py) one Job per choice. Nothing the engine does
blocks the event loop: /health answers while the engine is saturated. A client that goes away has its
jobs aborted: the engine drops them before its next step, blocks freed.
"""
import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel, ConfigDict, Field

from nano.chat.template import render as render_chat
from nano.errors import NanoError
from nano.sequence import SamplingParams
from nano.server.engine_thread import EngineThread, Job

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


# ---- requests (what OpenAI's API takes; top_k and ignore_eos are extensions, as in vLLM) ----
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields: tolerated
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_response(message: str, status: int = 400, kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)


# ---- the HTTP side ------------------------------------------------------------------------------
class Server:
    def __init__(self, engine, max_queued: int = 256, metrics=None, stall_timeout=None):
        self.engine, self.max_queued = engine, max_queued
        self.model_name = engine.shard.model_dir.name
        self.thread = EngineThread(engine, metrics, stall_timeout)
        self.active = 0  # jobs submitted and not yet ended (event loop only)
        self.created = int(time.time())

    async def submit(self, body: Sampling, prompt: list[int], top_logprobs: int | None, max_tokens: int):
        """Start body.n jobs for one prompt; returns them."""
        if self.stopped():
            raise BadRequest(f"engine stopped: {self.thread.error}", 503, "server_error")
        if self.active + body.n > self.max_queued:
            raise BadRequest(f"the server has {self.active} requests in flight (at most {self.max_queued}): "
                             "try again later", 503, "server_overloaded")
        if len(prompt) + 1 > self.engine.max_model_len:
            raise BadRequest(f"this model's maximum context length is {self.engine.max_model_len} tokens; the "
                             f"prompt has {len(prompt)}")
        max_tokens = min(max_tokens, self.engine.max_model_len - len(prompt))
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        loop, jobs = asyncio.get_running_loop(), []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                    max_tokens=max_tokens, seed=seed, ignore_eos=body.ignore_eos,
                                    return_logits=top_logprobs is not None)
            try:
                params.validate()
            except NanoError as e:
                raise BadRequest(str(e)) from None
            jobs.append(Job(prompt, params, [s for s in stops if s], top_logprobs, asyncio.Queue(), loop))
        for job in jobs:
            self.thread.inbox.put(("add", job))
        self.active += len(jobs)
        return jobs

    def release(self, jobs: list[Job]) -> None:
        """The request is over (finished, failed or gone): abort what still runs."""
        for job in jobs:
            self.thread.inbox.put(("abort", job))
        self.active -= len(jobs)

    async def tokenize(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.engine.tokenizer.encode, text)

    def stopped(self) -> JSONResponse | None:
        """A 503 if the engine thread is gone (it failed, or the server is shutting down)."""
        if self.thread.error or not self.thread.is_alive():
            return error_response(f"engine stopped: {self.thread.error}", 503, "server_error")
        return None

    def check_model(self, body: Sampling) -> None:
        if body.model is not None and body.model != self.model_name:
            raise BadRequest(f"the model {body.model!r} does not exist: this server has {self.model_name!r}",
                             404, "not_found_error")


def create_app(engine, max_queued: int = 256, metrics=None, stall_timeout=None) -> FastAPI:
    """The FastAPI app; its engine thread starts with the app and stops with it."""
    server = Server(engine, max_queued, metrics, stall_timeout)
    app = FastAPI(title="nano", lifespan=_lifespan(server))
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return error_response(f"{where}: {first['msg']}" if where else first["msg"])

    @app.exception_handler(BadRequest)
    async def bad(_, exc: BadRequest):
        return error_response(str(exc), exc.status, exc.kind)

    @app.get("/health")
    async def health():
        return server.stopped() or {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "created": server.created, "owned_by": "nano"}]}

    @app.get("/metrics")
    async def metrics():
        if server.stopped():  # no one would answer
            return server.stopped()
        loop, done = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        server.thread.inbox.put(("metrics", lambda text: loop.call_soon_threadsafe(done.set_result, text)))
        return PlainTextResponse(await done, media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body)
        prompt = await server.tokenize(body.prompt) if isinstance(body.prompt, str) else body.prompt
        if any(not 0 <= t < engine.model_config.vocab_size for t in prompt):
            raise BadRequest(f"prompt: token ids must be in [0, {engine.model_config.vocab_size})")
        jobs = await server.submit(body, prompt, body.logprobs, body.max_tokens or 16)
        return await respond(server, request, body, jobs, "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        server.check_model(body)
        if engine.tokenizer.chat_template is None:
            raise BadRequest("this model has no chat template: use /v1/completions")
        try:
            text = render_chat(engine.tokenizer, [m.model_dump(include={"role", "content"})
                                                         for m in body.messages])
        except NanoError as e:
            raise BadRequest(str(e)) from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens or engine.max_model_len
        jobs = await server.submit(body, await server.tokenize(text), top, max_tokens)
        return await respond(server, request, body, jobs, "chat.completion", "chatcmpl")

    return app


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
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(stream(server, request, jobs, head, kind, usage))
    try:
        results = await asyncio.gather(*(collect(job, request) for job in jobs))
    finally:
        server.release(jobs)
    if any(r is None for r in results):
        return error_response("client disconnected", 499)
    failed = [r for r in results if r["error"]]
    if failed:  # rejected by the engine (400), or the engine failed (500)
        status = failed[0]["status"]
        raise BadRequest(failed[0]["error"], status, "server_error" if status == 500 else "invalid_request_error")
    choices = []
    for i, r in enumerate(results):
        if kind == "chat.completion":
            choice = {"index": i, "message": {"role": "assistant", "content": r["text"]},
                      "logprobs": chat_logprobs(r["logprobs"]) if jobs[i].top_logprobs is not None else None,
                      "finish_reason": r["finish_reason"]}
        else:
            choice = {"index": i, "text": r["text"], "finish_reason": r["finish_reason"],
                      "logprobs": completion_logprobs(r["logprobs"]) if jobs[i].top_logprobs is not None else None}
        choices.append(choice)
    return {**head, "choices": choices, "usage": usage_of(results)}


async def collect(job: Job, request: Request) -> dict | None:
    """A job's events gathered into one result; None if the client went away first."""
    out = {"text": "", "logprobs": [], "finish_reason": None, "error": None}
    while out["finish_reason"] is None and out["error"] is None:
        try:
            event = await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None
            continue
        out["text"] += event.get("text", "")
        out["logprobs"] += event.get("logprobs") or []
        out["error"], out["status"] = event.get("error"), event.get("status", 400)
        out["finish_reason"] = event.get("finish_reason")
        out["prompt_tokens"], out["completion_tokens"] = event.get("prompt_tokens", 0), event.get("completion_tokens", 0)
    return out


async def stream(server: Server, request: Request, jobs: list[Job], head: dict, kind: str, usage: bool):
    """SSE chunks in OpenAI's format as the engine produces text, then usage, then [DONE].
    The client going away cancels this generator: its jobs are aborted in the finally."""
    chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
    events = asyncio.Queue()

    async def forward(i, job):
        while True:
            event = await job.events.get()
            await events.put((i, event))
            if event.get("finish_reason") or event.get("error"):
                return

    tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    counts, live = {}, len(jobs)
    try:
        if kind == "chat.completion":
            yield sse({**head, "object": chunk_kind, "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(jobs))]})
        while live:
            i, event = await events.get()
            if event.get("error"):
                yield sse({"error": {"message": event["error"], "type": "invalid_request_error"}})
                live -= 1
                continue
            counts[i] = (event["prompt_tokens"], event["completion_tokens"])
            lp = event.get("logprobs")
            if kind == "chat.completion":
                choice = {"index": i, "delta": {"content": event["text"]} if event["text"] else {},
                          "logprobs": chat_logprobs(lp) if lp else None, "finish_reason": event["finish_reason"]}
            else:
                choice = {"index": i, "text": event["text"], "logprobs": completion_logprobs(lp) if lp else None,
                          "finish_reason": event["finish_reason"]}
            yield sse({**head, "object": chunk_kind, "choices": [choice]})
            live -= event["finish_reason"] is not None
        if usage:
            yield sse({**head, "object": chunk_kind, "choices": [], "usage": usage_of(
                [{"prompt_tokens": p, "completion_tokens": c} for p, c in counts.values()])})
        yield format_sse_event(data_str="[DONE]")
    finally:
        for task in tasks:
            task.cancel()
        server.release(jobs)


def sse(payload: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False))


def usage_of(results: list[dict]) -> dict:
    prompt = results[0]["prompt_tokens"] if results else 0
    completion = sum(r["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(entries: list[dict]) -> dict:
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": []}


def chat_logprobs(entries: list[dict]) -> dict:
    def item(token, logprob):
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


def serve(engine, host: str, port: int, max_queued: int, metrics=None, stall_timeout=None) -> None:
    import uvicorn
    uvicorn.run(create_app(engine, max_queued, metrics, stall_timeout), host=host, port=port, log_level="warning")
