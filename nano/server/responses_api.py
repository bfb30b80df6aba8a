"""POST /v1/responses: OpenAI's Responses API (as vLLM serves it) over the chat endpoint's
machinery. The input (and the instructions, as a system message first) goes through the
model's chat template, one Job is submitted as a chat completion's, and its events become a
Response object, or with "stream": true OpenAI's typed events (response.created ...
response.completed), each a server-sent event named by its type. text.format (structured
output) and function tools take the chat endpoint's paths too: the format is compiled as
response_format, the tools reach the template, tool_choice is checked and forced (tools.py) and
the calls read back (responses.tool_parser) as function_call output items. Failures, rejections
and a client that goes away take the chat endpoint's paths (completions.py's unless_gone, the jobs
released, a mid-stream error as an error event). nano keeps no responses: store is false."""
import asyncio
import itertools
import json
import time
import uuid

from fastapi import Request
from fastapi.sse import EventSourceResponse, format_sse_event

from nano.server import tools
from nano.server.engine_thread import Job
from nano.server.completions import collect, tool_parser, unless_gone, usage_of
from nano.server.responses_schemas import ResponsesRequest
from nano.server.schemas import BadRequest, error_response
from nano.server.serving import Server


async def create(server: Server, request: Request, body: ResponsesRequest):
    sampling = body.sampling()
    stops = server.check(sampling)
    if (server.chat_template or server.engine.tokenizer.chat_template) is None:
        raise BadRequest("this model has no chat template: use /v1/completions")
    given = body.chat_tools()
    server.check_tools(given)
    choice = tools.check(given, body.chat_tool_choice(), server.tool_parser, server.auto_tools)
    forced = tools.forced_schema(given, choice, body.parallel_tool_calls) if tools.forced(choice) else None
    grammar = await server.structured(sampling, forced, "text.format")
    prompt = await server.tokenize_chat(body.messages(), True, given)
    jobs = await server.submit(sampling, [prompt], stops, None, body.max_output_tokens, grammar=grammar)
    shape = Shape(server, body, jobs, tool_parser(server, given, choice))
    if body.stream:
        return EventSourceResponse(stream(server, jobs, shape))
    try:
        result = await unless_gone(request, collect(jobs[0]))
    finally:
        server.release(jobs)
    if result is None:
        return error_response("client disconnected", 499)
    if result["error"]:  # rejected by the engine (400), or the engine failed (500)
        status = result["status"]
        raise BadRequest(result["error"], status, "server_error" if status >= 500 else "invalid_request_error")
    counts = {0: (result["completion_tokens"], result["cached_tokens"])}
    status = shape.status(result["finish_reason"])
    content, calls = shape.parser.extract(result["text"]) if shape.parser else (result["text"], [])
    calls = calls if body.parallel_tool_calls else calls[:1]
    output = [shape.message(content or "", status)] if content or not calls else []
    output += [shape.call(c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    return shape.response(status, output, counts)


class Shape:
    """One request's Response object and output items, in OpenAI's shapes. parser: what reads
    the calls back (responses.tool_parser), or None."""

    def __init__(self, server: Server, body: ResponsesRequest, jobs: list[Job], parser=None):
        self.server, self.body, self.jobs, self.parser = server, body, jobs, parser
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

    @staticmethod
    def call(name: str, arguments: str, status: str) -> dict:
        """A function_call output item (ids as vLLM makes them: fc_..., and call_... for the client's reply)."""
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex}",
                "name": name, "arguments": arguments, "status": status}

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
        text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text.verbosity is not None:
            text["verbosity"] = body.text.verbosity
        echoed = [{"description": None, "parameters": None, "strict": None, **t} for t in body.tools or []]
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.server.name_of(self.jobs[0].lora), "output": output, "usage": usage if ended else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": 0,
                "text": text, "tools": echoed, "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls, "max_tool_calls": None, "reasoning": None,
                "store": False, "background": False, "previous_response_id": None, "truncation": "disabled",
                "service_tier": "default", "metadata": body.metadata or {}, "user": body.user,
                "safety_identifier": body.safety_identifier}


async def stream(server: Server, jobs: list[Job], shape: Shape):
    """OpenAI's streaming events: response.created, response.in_progress; for the output message
    (when it has text, or there is no call) response.output_item.added,
    response.content_part.added, response.output_text.delta (per piece of text),
    response.output_text.done, response.content_part.done, response.output_item.done; for each
    function call (read back by the shape's parser, whose Stream holds back what may be a call)
    response.output_item.added (its arguments empty), response.function_call_arguments.delta
    and .done, response.output_item.done; then response.completed, as vLLM ends every stream,
    whose response says "incomplete" when max_output_tokens cut it short (OpenAI sends
    response.incomplete then, which the openai client's responses.stream() does not take as an
    end). An error ends it with an error event and response.failed.
    The client going away cancels this generator: its job is aborted in the finally."""
    job, numbers = jobs[0], itertools.count()
    events = asyncio.Queue()
    reading = shape.parser.Stream(None if shape.body.parallel_tool_calls else 1) if shape.parser else None

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

    output: list[dict] = []  # the items so far, in order
    message = {"index": None, "text": "", "open": False}  # the message item: its output index, text, whether open

    def open_message():
        message["index"], message["open"] = len(output), True
        output.append(shape.message(None, "in_progress"))
        where = {"item_id": shape.message_id, "output_index": message["index"]}
        yield sse("response.output_item.added", output_index=message["index"], item=output[-1])
        yield sse("response.content_part.added", **where, content_index=0, part=shape.part(""))

    def close_message(status: str):
        text, message["open"] = message["text"], False
        where = {"item_id": shape.message_id, "output_index": message["index"], "content_index": 0}
        yield sse("response.output_text.done", **where, text=text, logprobs=[])
        yield sse("response.content_part.done", **where, part=shape.part(text))
        output[message["index"]] = shape.message(text, status)
        yield sse("response.output_item.done", output_index=message["index"], item=output[message["index"]])

    def deliver(delta: dict):
        """One delta (a parser's, or the text's): message text, a call's head, or its arguments."""
        if "content" in delta:
            if message["index"] is None:
                yield from open_message()
            message["text"] += delta["content"]
            yield sse("response.output_text.delta", item_id=shape.message_id, output_index=message["index"],
                      content_index=0, delta=delta["content"], logprobs=[])
            return
        [call] = delta["tool_calls"]
        if "id" in call:  # a call begins: the message (if any) is over
            if message["open"]:
                yield from close_message("completed")
            output.append(shape.call(call["function"]["name"], "", "in_progress"))
            yield sse("response.output_item.added", output_index=len(output) - 1, item=output[-1])
            return
        item, arguments = output[-1], call["function"]["arguments"]
        where = {"item_id": item["id"], "output_index": len(output) - 1}
        yield sse("response.function_call_arguments.delta", **where, delta=arguments)
        yield sse("response.function_call_arguments.done", **where, arguments=arguments, name=item["name"])
        output[-1] = {**item, "arguments": arguments, "status": "completed"}
        yield sse("response.output_item.done", output_index=len(output) - 1, item=output[-1])

    task = asyncio.create_task(forward())
    counts = {}
    try:
        yield sse("response.created", response=shape.response("in_progress", [], None))
        yield sse("response.in_progress", response=shape.response("in_progress", [], None))
        while True:
            event = await events.get()
            if event.get("error"):
                failed = event.get("status", 400) >= 500
                yield sse("error", code="server_error" if failed else "invalid_request_error",
                          message=event["error"], param=None)
                error = {"code": "server_error", "message": event["error"]}
                if message["open"]:
                    output[message["index"]] = shape.message(message["text"], "incomplete")
                yield sse("response.failed", response=shape.response("failed", output, counts, error))
                return
            counts[0] = (event["completion_tokens"], event["cached_tokens"])
            if reading is not None:
                deltas = reading.feed(event["text"]) + (reading.end() if event["finish_reason"] else [])
            else:
                deltas = [{"content": event["text"]}] if event["text"] else []
            for delta in deltas:
                for out in deliver(delta):
                    yield out
            if event["finish_reason"]:
                break
        status = shape.status(event["finish_reason"])
        if not output:  # no text and no call: an empty message
            for out in open_message():
                yield out
        if message["open"]:
            for out in close_message(status):
                yield out
        yield sse("response.completed", response=shape.response(status, output, counts))
    finally:
        task.cancel()
        server.release(jobs)
