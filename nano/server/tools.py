"""Tool calls on the chat endpoint, as vLLM serves them: a request's tools and tool_choice
checked, and the calls read back from what the model wrote.

tool_choice "none": the tools reach the template, no call is read back. "auto" (the default
when tools are given): needs --enable-auto-tool-choice and --tool-call-parser (tool_parsers.py),
which reads the calls from the text. "required" and a named function: the output is forced by a
grammar (nano/structured) into forced_schema(), the JSON schema vLLM forces for them, and read
back by Forced, which has a parser's interface (tool_parsers.py)."""
import copy
import json

from nano.server import json_values
from nano.server.schemas import BadRequest
from nano.server.tool_parsers import call_deltas, tool_call

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def choice_of(tools: list[dict] | None, tool_choice) -> str | dict:
    """The request's tool_choice as vLLM reads it: absent, "auto" if there are tools, else "none"."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def check(tools: list[dict] | None, tool_choice, parser: str | None, auto: bool) -> str | dict:
    """The request's tool_choice (choice_of), or a 400 naming tool_choice: vLLM's checks and wording."""
    choice = choice_of(tools, tool_choice)
    if choice == "none":
        return choice
    if not tools:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        if not (auto and parser):
            raise BadRequest(AUTO_NEEDS_FLAGS, param="tool_choice")
        return choice
    if isinstance(choice, dict):
        name = named(choice)
        if name not in [t["function"]["name"] for t in tools]:
            raise BadRequest(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return choice


def forced(choice) -> bool:
    """Whether a checked tool_choice forces a call: "required" or a named function."""
    return choice == "required" or isinstance(choice, dict)


def named(choice) -> str | None:
    """The function a named tool_choice names ({"type": "function", "function": {"name": ...}})."""
    return choice["function"]["name"] if isinstance(choice, dict) else None


def forced_schema(tools: list[dict], tool_choice: str | dict, parallel: bool = True) -> dict:
    """The JSON schema vLLM forces the output into for tool_choice "required" (an array, at least
    one item, of {"name", "parameters"} objects, anyOf the tools; their $defs gathered at the
    top; parallel False, parallel_tool_calls': at most one item) or a named function (that
    function's parameters: the arguments alone). The tools are not changed. Unlike vLLM's, an
    item allows no other keys: read back, they would be dropped, and a small model given room
    for them writes them on until max_tokens."""
    if isinstance(tool_choice, dict):
        name = named(tool_choice)
        tool = next(t for t in tools if t["function"]["name"] == name)
        return copy.deepcopy(tool["function"].get("parameters") or {"type": "object", "properties": {}})
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} forces no output")
    items, defs = [], {}
    for tool in tools:
        parameters = copy.deepcopy(tool["function"].get("parameters")) or {"type": "object", "properties": {}}
        for def_name, schema in parameters.pop("$defs", {}).items():
            if defs.get(def_name, schema) != schema:
                raise BadRequest(f"Tool definition '{def_name}' has multiple schemas, which is not supported.",
                                 param="tools")
            defs[def_name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
              "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema


def forced_calls(text: str, tool_choice: str | dict) -> list[dict]:
    """The tool_calls of an output forced into forced_schema(): "required", one call per item
    of the array (arguments: its parameters as a JSON string); a named function, one call to it
    with the output as its arguments, as written. A ValueError if the output is not whole
    JSON (cut short by max_tokens): no call is made of arguments that do not parse."""
    if isinstance(tool_choice, dict):
        json_values.loads(text)
        return [tool_call(named(tool_choice), text)]
    return [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in json_values.loads(text)]


def finish_reason(reason: str, called: bool, tool_choice) -> str:
    """A chat choice's finish_reason, as OpenAI and vLLM give it: "tool_calls" when calls were
    read back from an output that ended by itself under "auto" or "required", "stop" under a
    named function (OpenAI's rule for a forced call); an output cut short keeps "length", so
    that no client takes it for a finished call."""
    if reason != "stop" or not called:
        return reason
    return "stop" if isinstance(tool_choice, dict) else "tool_calls"


class Forced:
    """The output forced_schema() forced, read back as tool_calls, with a tool-call parser's
    interface (tool_parsers.Hermes): extract() a whole text, or a Stream that sends the calls
    when the output ends (a JSON array is a call only once it is whole). An output cut short
    (max_tokens) is not JSON: it comes back as content, with no call."""

    def __init__(self, choice: str | dict):
        self.choice = choice

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        try:
            return None, forced_calls(text, self.choice)
        except (ValueError, TypeError, KeyError):
            return text, []

    def Stream(self, max_calls: int | None = None):
        return ForcedStream(self, max_calls)


class ForcedStream:
    def __init__(self, forced: Forced, max_calls: int | None):
        self.forced, self.max_calls, self.text, self.calls = forced, max_calls, "", 0

    def feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def end(self) -> list[dict]:
        content, calls = self.forced.extract(self.text)
        calls = calls[:self.max_calls] if self.max_calls is not None else calls
        self.calls = len(calls)
        if content:
            return [{"content": content}]
        return [delta for i, call in enumerate(calls) for delta in call_deltas(i, call)]

    @property
    def called(self) -> bool:
        return self.calls > 0
