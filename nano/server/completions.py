"""What the server answers: a request's jobs gathered into one OpenAI response, or streamed
as server-sent events; usage and logprobs in OpenAI's shapes."""
import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.sse import EventSourceResponse, format_sse_event

from nano.server import tool_parsers, tools
from nano.server.engine_thread import Job
from nano.server.schemas import BadRequest, Sampling, StreamOptions, error_body, error_response
from nano.server.serving import Server


async def respond(server: Server, request: Request, body: Sampling, jobs: list[Job], kind: str, prefix: str):
    rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": kind, "created": created, "model": server.name_of(jobs[0].lora)}
    parser = tool_parser(server, body.tools, body.tool_choice) if kind == "chat.completion" else None
    choice = tools.choice_of(getattr(body, "tools", None), getattr(body, "tool_choice", None))
    if body.stream:
        options = body.stream_options or StreamOptions()
        return EventSourceResponse(stream(server, request, jobs, body.n, head, kind, options, parser,
                                          None if getattr(body, "parallel_tool_calls", True) else 1, choice))
    try:
        results = await unless_gone(request, asyncio.gather(*(collect(job) for job in jobs)))
    finally:
        server.release(jobs)
    if results is None:
        return error_response("client disconnected", 499)
    failed = [r for r in results if r["error"]]
    if failed:  # rejected by the engine (400), or the engine failed (500)
        status = failed[0]["status"]
        raise BadRequest(failed[0]["error"], status, "server_error" if status >= 500 else "invalid_request_error")
    choices = []
    for i, r in enumerate(results):
        if kind == "chat.completion":
            message, finish = {"role": "assistant", "content": r["text"]}, r["finish_reason"]
            if parser is not None:  # the calls the model wrote, read back (tools.py)
                content, calls = parser.extract(r["text"])
                calls = calls if body.parallel_tool_calls else calls[:1]
                message = {**message, "content": content, "tool_calls": calls}
                finish = tools.finish_reason(finish, bool(calls), choice)
            choice = {"index": i, "message": message,
                      "logprobs": chat_logprobs(r["logprobs"]) if jobs[i].top_logprobs is not None else None,
                      "finish_reason": finish, "stop_reason": jobs[i].stop_reason}
        else:
            choice = {"index": i, "text": r["text"], "finish_reason": r["finish_reason"],
                      "stop_reason": jobs[i].stop_reason,
                      "logprobs": completion_logprobs(r["logprobs"]) if jobs[i].top_logprobs is not None else None}
        if jobs[i].prompt_logprobs is not None:
            choice["prompt_logprobs"] = r["prompt_logprobs"]
        choices.append(choice)
    counts = {i: (r["completion_tokens"], r["cached_tokens"]) for i, r in enumerate(results)}
    return {**head, "choices": choices, "usage": usage_of(jobs, body.n, counts)}


def tool_parser(server: Server, given: list[dict] | None, tool_choice):
    """What reads a request's tool calls back (its tools and tool_choice in chat's shapes), or
    None: with tool_choice "auto" the server's parser for these tools (tool_parsers.py;
    tools.check made sure there is one), with a forced choice ("required", a named function) tools.Forced."""
    choice = tools.choice_of(given, tool_choice)
    if tools.forced(choice):
        return tools.Forced(choice)
    if choice != "auto" or server.tool_parser is None:
        return None
    return tool_parsers.parser(server.tool_parser)([tool["function"]["name"] for tool in given])


async def unless_gone(request: Request, work):
    """work's result, or None if the client goes away first. The connection itself is watched
    (Starlette's receive() answers http.disconnect the moment it closes), so a client that
    leaves is noticed at once, however steadily the engine keeps sending work its tokens."""
    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, watcher = asyncio.ensure_future(work), asyncio.create_task(gone())
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        return work.result() if work.done() else None
    finally:
        work.cancel()
        watcher.cancel()


async def collect(job: Job) -> dict:
    """A job's events gathered into one result."""
    out = {"text": "", "logprobs": [], "finish_reason": None, "error": None, "prompt_logprobs": None}
    while out["finish_reason"] is None and out["error"] is None:
        event = await job.events.get()
        out["text"] += event.get("text", "")
        out["logprobs"] += event.get("logprobs") or []
        out["prompt_logprobs"] = out["prompt_logprobs"] or event.get("prompt_logprobs")
        out["error"], out["status"] = event.get("error"), event.get("status", 400)
        out["finish_reason"] = event.get("finish_reason")
        out["completion_tokens"], out["cached_tokens"] = event.get("completion_tokens", 0), event.get("cached_tokens", 0)
    return out


async def stream(server: Server, request: Request, jobs: list[Job], n: int, head: dict, kind: str,
                 options: StreamOptions, parser=None, max_calls: int | None = None, tool_choice="none"):
    """SSE chunks in OpenAI's format as the engine produces text, then usage (include_usage),
    then [DONE]; with continuous_usage_stats every chunk carries the request's usage so far.
    The client going away cancels this generator: its jobs are aborted in the finally. parser: a
    tool-call parser (tool_parsers.py): the text goes through its Stream (at most max_calls
    calls), whose deltas are sent one a chunk (the event's logprobs with the first, its
    finish_reason with the last: tools.finish_reason's under the request's tool_choice)."""
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
    reading = [parser.Stream(max_calls) for _ in jobs] if parser else None
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
            if reading is not None:
                deltas = reading[i].feed(event["text"]) + (reading[i].end() if event["finish_reason"] else [])
                finish = event["finish_reason"] and tools.finish_reason(event["finish_reason"], reading[i].called,
                                                                        tool_choice)
                choices = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas or [{}]]
                choices[0]["logprobs"] = chat_logprobs(lp) if lp else None
                choices[-1]["finish_reason"] = finish
                if finish:
                    choices[-1]["stop_reason"] = jobs[i].stop_reason
                if event.get("prompt_logprobs"):
                    choices[0]["prompt_logprobs"] = event["prompt_logprobs"]
                for choice in choices:
                    yield chunk([choice])
                live -= event["finish_reason"] is not None
                continue
            if kind == "chat.completion":
                choice = {"index": i, "delta": {"content": event["text"]} if event["text"] else {},
                          "logprobs": chat_logprobs(lp) if lp else None, "finish_reason": event["finish_reason"]}
            else:
                choice = {"index": i, "text": event["text"], "logprobs": completion_logprobs(lp) if lp else None,
                          "finish_reason": event["finish_reason"]}
            if event["finish_reason"]:
                choice["stop_reason"] = jobs[i].stop_reason
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


