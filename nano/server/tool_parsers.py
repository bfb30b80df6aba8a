"""Tool-call parsers: a model's text read back into OpenAI's tool_calls, as vLLM's
--tool-call-parser does it. Each parser reads a whole text (extract) and a stream
(Stream: text pieces in, OpenAI deltas out), built for one request from the names of its
tools: a call to any other function is not a call. PARSERS is the registry by name
(--tool-call-parser NAME); a parser is added with @register("name")."""
import json
import re
import uuid

from nano.server import json_values


def tool_call_id() -> str:
    """vLLM's id for a call it parsed: chatcmpl-tool-<hex>."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    """A call in OpenAI's shape (arguments: a JSON string)."""
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


PARSERS: dict[str, type] = {}


def register(name: str):
    def add(cls):
        PARSERS[name] = cls
        return cls
    return add


def parser(name: str):
    """The parser class registered as `name` (its instances take the request's tool names); an
    unknown name is a ValueError naming it and the known ones."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r}: no such parser (known: {', '.join(sorted(PARSERS))})")
    return PARSERS[name]


@register("hermes")
class Hermes:
    """NousResearch Hermes' (and Qwen2.5's, Qwen3's) calls: <tool_call>{"name": ..., "arguments":
    {...}}</tool_call> blocks, one or more; a last block the text ends in before its closing tag
    (max_tokens) counts too. As vLLM reads them: the message's content is the text before the
    first block (null if none); a block that is not a call leaves the whole text as content, no
    call. A call is strict JSON (json_values: no NaN, no Infinity) with a name among the
    request's tools and arguments that are an object."""
    START, END = "<tool_call>", "</tool_call>"
    BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def __init__(self, tools: list[str]):
        self.tools = set(tools)  # the names of the functions the request gives

    def call(self, body: str) -> dict | None:
        """A block's body as a call, or None if it is not one."""
        try:
            parsed = json_values.loads(body)
            name, arguments = parsed["name"], parsed["arguments"]
        except (ValueError, TypeError, KeyError):
            return None
        if not (isinstance(name, str) and name in self.tools and isinstance(arguments, dict)):
            return None
        return tool_call(name, json.dumps(arguments, ensure_ascii=False))

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole text: (text, []) if it holds no valid call."""
        if self.START not in text:
            return text, []
        calls = [self.call(closed or open_) for closed, open_ in self.BLOCKS.findall(text)]
        if None in calls:
            return text, []
        return text[:text.index(self.START)] or None, calls

    def Stream(self, max_calls: int | None = None) -> "HermesStream":
        return HermesStream(self, max_calls)


class HermesStream:
    """One choice's stream: feed() each text piece, then end(); each returns OpenAI delta
    dicts ({"content": ...} or {"tool_calls": [...]}), in order. Text that may be the start of
    <tool_call> is held back until it is known not to be. A call is sent once its block is
    closed (or the text ends): its id, type and name first, its arguments in the next delta.
    A block that is not a call is sent as content, and so is everything after it."""

    def __init__(self, hermes: Hermes, max_calls: int | None = None):
        self.hermes, self.buffer, self.calls, self.max_calls = hermes, "", 0, max_calls
        self.state = "text"  # text: before a block; call: inside one; after: after a call; plain: all content

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        out = []
        while True:
            if self.state == "plain":
                if self.buffer:
                    out.append({"content": self.buffer})
                self.buffer = ""
                return out
            if self.state in ("text", "after"):
                at = self.buffer.find(Hermes.START)
                if at < 0:
                    keep = _partial_suffix(self.buffer, Hermes.START)
                    if self.state == "text" and len(self.buffer) > keep:
                        out.append({"content": self.buffer[:len(self.buffer) - keep]})
                    self.buffer = self.buffer[len(self.buffer) - keep:]  # after a call: text is dropped (vLLM)
                    return out
                if self.state == "text" and at:
                    out.append({"content": self.buffer[:at]})
                self.buffer, self.state = self.buffer[at + len(Hermes.START):], "call"
                continue
            end = self.buffer.find(Hermes.END)  # state "call"
            if end < 0:
                return out
            body, self.buffer = self.buffer[:end], self.buffer[end + len(Hermes.END):]
            out += self._close(body)

    def end(self) -> list[dict]:
        """The text is over: what was held back, or a block left open."""
        if self.state == "call":
            body, self.buffer = self.buffer, ""
            return self._close(body, closed=False)
        if self.state == "text" and self.buffer:
            out, self.buffer = [{"content": self.buffer}], ""
            return out
        return []

    def _close(self, body: str, closed: bool = True) -> list[dict]:
        call = self.hermes.call(body)
        if call is None:  # not a call: the block's text goes out as content, and so does the rest
            self.state = "plain"
            return [{"content": Hermes.START + body + (Hermes.END if closed else "")}]
        self.state = "after"
        if self.max_calls is not None and self.calls >= self.max_calls:
            return []
        index, self.calls = self.calls, self.calls + 1
        return call_deltas(index, call)

    @property
    def called(self) -> bool:
        return self.calls > 0


def call_deltas(index: int, call: dict) -> list[dict]:
    """A call as a stream sends it: its id, type and name first, its arguments in the next delta."""
    head = {"index": index, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
    return [{"tool_calls": [head]},
            {"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
