"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it) over the chat endpoint's
machinery. The input (and the instructions, as a system message first) goes through the
model's chat template, one Job is submitted as a chat completion's, and its events become a
Response object, or with "stream": true OpenAI's typed events (response.created ...
response.completed), each a server-sent event named by its type. Failures, rejections and a
client that goes away take the chat endpoint's paths (responses.py's collect, the jobs
released, a mid-stream error as an error event). nano keeps no responses: store is false."""
import asyncio
import itertools
import json
import time
import uuid

from fastapi import Request
from fastapi.sse import EventSourceResponse, format_sse_event

from nano.server.engine_thread import Job
from nano.server.responses import collect, usage_of
from nano.server.schemas import BadRequest, ResponsesRequest, error_response
from nano.server.serving import Server


async def create(server: Server, request: Request, body: ResponsesRequest):
    sampling = body.sampling()
    stops = server.check(sampling)
    if server.engine.tokenizer.chat_template is None:
        raise BadRequest("this model has no chat template: use /v1/completions")
    prompt = await server.tokenize_chat(body.messages())
    jobs = await server.submit(sampling, [prompt], stops, None, body.max_output_tokens or server.engine.max_model_len)
    shape = Shape(server, body, jobs)
    if body.stream:
        return EventSourceResponse(stream(server, jobs, shape))
    try:
        result = await collect(jobs[0], request)
    finally:
        server.release(jobs)
    if result is None:
        return error_response("client disconnected", 499)
    if result["error"]:  # rejected by the engine (400), or the engine failed (500)
        status = result["status"]
        raise BadRequest(result["error"], status, "server_error" if status >= 500 else "invalid_request_error")
    counts = {0: (result["completion_tokens"], result["cached_tokens"])}
    status = shape.status(result["finish_reason"])
    return shape.response(status, [shape.message(result["text"], status)], counts)


class Shape:
    """One request's Response object and output message, in OpenAI's shapes."""

    def __init__(self, server: Server, body: ResponsesRequest, jobs: list[Job]):
        self.server, self.body, self.jobs = server, body, jobs
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    @staticmethod
    def status(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message(self, text: str | None, status: str) -> dict:
        """The output message; text None: one just begun (no content part yet)."""
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [] if text is None else [self.part(text)]}

    def response(self, status: str, output: list[dict], counts: dict | None, error: dict | None = None) -> dict:
        """The Response object; counts (as usage_of takes them): the usage, None while in progress."""
        body, usage = self.body, None
        if counts is not None:
            u = usage_of(self.jobs, 1, counts)
            # cache_write_tokens: OpenAI's explicit cache writes (nano's prefix cache is implicit: none)
            usage = {"input_tokens": u["prompt_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                              "cache_write_tokens": 0},
                     "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u["total_tokens"]}
        ended = status in ("completed", "incomplete", "failed")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.server.model_name, "output": output, "usage": usage if ended else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": 0,
                "text": {"format": {"type": "text"}}, "tools": [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": True, "max_tool_calls": None, "reasoning": None, "store": False,
                "background": False, "previous_response_id": None, "truncation": "disabled",
                "service_tier": "default", "metadata": body.metadata or {}, "user": body.user,
                "safety_identifier": body.safety_identifier}


async def stream(server: Server, jobs: list[Job], shape: Shape):
    """OpenAI's streaming events for one output message: response.created, response.in_progress,
    response.output_item.added, response.content_part.added, response.output_text.delta (per
    piece of text the engine produces), response.output_text.done, response.content_part.done,
    response.output_item.done, then response.completed (response.incomplete when
    max_output_tokens cut it short). An error ends it with an error event and response.failed.
    The client going away cancels this generator: its job is aborted in the finally."""
    job, numbers = jobs[0], itertools.count()
    events = asyncio.Queue()

    async def forward():  # as responses.stream's: a client that stops reading stops the generation
        while True:
            event = await job.events.get()
            if events.qsize() >= server.limits.stream_backlog:
                server.abort(job)
                event = {"error": f"the client left more than {server.limits.stream_backlog} events unread: "
                                  "the response was aborted"}
            events.put_nowait(event)
            if event.get("finish_reason") or event.get("error"):
                return

    def sse(kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": next(numbers), **fields}
        return format_sse_event(event=kind, data_str=json.dumps(payload, ensure_ascii=False))

    task = asyncio.create_task(forward())
    where = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
    text, counts = "", {}
    try:
        yield sse("response.created", response=shape.response("in_progress", [], None))
        yield sse("response.in_progress", response=shape.response("in_progress", [], None))
        yield sse("response.output_item.added", output_index=0, item=shape.message(None, "in_progress"))
        yield sse("response.content_part.added", **where, part=shape.part(""))
        while True:
            event = await events.get()
            if event.get("error"):
                failed = event.get("status", 400) >= 500
                yield sse("error", code="server_error" if failed else "invalid_request_error",
                          message=event["error"], param=None)
                error = {"code": "server_error", "message": event["error"]}
                output = [shape.message(text, "incomplete")]
                yield sse("response.failed", response=shape.response("failed", output, counts, error))
                return
            counts[0] = (event["completion_tokens"], event["cached_tokens"])
            if event["text"]:
                text += event["text"]
                yield sse("response.output_text.delta", **where, delta=event["text"], logprobs=[])
            if event["finish_reason"]:
                break
        status = shape.status(event["finish_reason"])
        yield sse("response.output_text.done", **where, text=text, logprobs=[])
        yield sse("response.content_part.done", **where, part=shape.part(text))
        message = shape.message(text, status)
        yield sse("response.output_item.done", output_index=0, item=message)
        yield sse(f"response.{status}", response=shape.response(status, [message], counts))
    finally:
        task.cancel()
        server.release(jobs)
