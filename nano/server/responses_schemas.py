"""What POST /v1/responses takes: OpenAI's Responses API request (responses_api.py serves it),
as far as nano implements it; the fields it does not are refused by name (fields.py's
RefusedResponses). Its messages, tools and formats are checked as the chat endpoint's
(schemas.py) and turned into that endpoint's shapes."""
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from nano.server.fields import RefusedResponses, RefusedText
from nano.server.schemas import (JsonSchemaFormat, JsonText, Message, ResponseFormat, Sampling, Text, _checked_text,
                                 _function, _shape, arguments)

INPUT_ROLES = ("user", "system", "developer", "assistant")


class InputText(BaseModel):
    """An input message's content part of the kinds this server takes (_input)."""
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """An input item: a message (_input)."""
    type: Literal["message"] = "message"
    role: Literal[INPUT_ROLES]
    content: str | list[InputText]


class InputFunctionCall(BaseModel):
    """An input item: a call an earlier response made (its output item, sent back as it came)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: JsonText
    id: str | None = None
    status: str | None = None


class InputFunctionCallOutput(BaseModel):
    """An input item: what a call returned."""
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


# What an input item may hold beside its own fields: an earlier response's output item, sent back
# as it came (its id, status; its parts' annotations and logprobs describe it).
_ITEM_KEYS, _PART_KEYS = {"type", "role", "content", "id", "status"}, {"type", "text", "annotations", "logprobs"}
_CALL_KEYS = {"call_id": (str, True), "id": ((str, type(None)), False), "status": ((str, type(None)), False)}


def _input(value) -> list[dict]:
    """The Responses API's input as this server takes it: a string (one user message) or a list
    of items, returned as chat messages: a message item's content a string or a list of
    input_text / output_text parts (joined with newlines, as the chat endpoint joins its parts);
    function_call items an assistant message's tool_calls (the message before, if it is the
    assistant's: one turn), a function_call_output a tool message (its tool_call_id the
    call_id, which a function_call before it must have), as vLLM turns them. Other items (reasoning, ...) and other parts (images, files,
    audio) are a 400 naming them."""
    if isinstance(value, str):
        return [{"role": "user", "content": _checked_text(value)}]
    if not isinstance(value, list) or not value:
        raise PydanticCustomError("input", "must be a string or a non-empty list of items")
    messages, called = [], set()
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise PydanticCustomError("input", f"item {i} must be an object (a message)")
        kind = item.get("type", "message")
        if kind == "function_call":
            _shape(item, "input", {"type": (str, True), "name": (str, True), "arguments": (str, True), **_CALL_KEYS},
                   f"item {i}")
            arguments(item["arguments"], "input", f"item {i}")
            called.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = messages[-1].get("tool_calls", []) + [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            _shape(item, "input", {"type": (str, True), "output": (str, True), **_CALL_KEYS}, f"item {i}")
            if item["call_id"] not in called:  # OpenAI's words
                raise PydanticCustomError("input", f"item {i}: No tool call found for function call output with "
                                          f"call_id {item['call_id']:.80}.")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            continue
        if kind != "message":
            raise PydanticCustomError("input", f"item {i} is of type {kind!r}: nano takes messages, function_call "
                                      "and function_call_output items (reasoning and other items are not "
                                      "implemented)")
        extra = sorted(set(item) - _ITEM_KEYS)
        if extra:
            raise PydanticCustomError("input", f"item {i}: {extra[0]!r} is an unknown field (nano refuses what it "
                                      "would ignore)")
        if item.get("role") not in INPUT_ROLES:
            raise PydanticCustomError("input", f"item {i}: 'role' must be one of {', '.join(INPUT_ROLES)}")
        content = item.get("content")
        if isinstance(content, str):
            text = _checked_text(content)
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                part_kind = part.get("type") if isinstance(part, dict) else None
                if part_kind not in ("input_text", "output_text"):
                    raise PydanticCustomError("input", f"item {i}: content part {j} is of type {part_kind!r}: this "
                                              "server takes text only ({'type': 'input_text', 'text': ...})")
                if set(part) - _PART_KEYS:
                    raise PydanticCustomError("input", f"item {i}: content part {j}: "
                                              f"{sorted(set(part) - _PART_KEYS)[0]!r} is an unknown field")
                if not isinstance(part.get("text"), str):
                    raise PydanticCustomError("input", f"item {i}: content part {j}: 'text' must be a string")
                texts.append(_checked_text(part["text"]))
            text = "\n".join(texts)
        else:
            raise PydanticCustomError("input", f"item {i}: 'content' must be a string or a list of text parts")
        messages.append({"role": item["role"], "content": text})
    return messages


class TextFormat(BaseModel):
    """The Responses API's text.format: text (no constraint), json_object, or json_schema (its
    name, schema, strict and description flat in the format: chat's response_format nests them)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        given = [k.rstrip("_") for k in ("name", "description", "schema_", "strict") if getattr(self, k) is not None]
        if self.type == "json_schema" and self.name is None:
            raise PydanticCustomError("text", "a json_schema format needs its name")
        if self.type != "json_schema" and given:
            raise PydanticCustomError("text", f"{given[0]!r} goes with type json_schema only")
        return self

    def response_format(self) -> ResponseFormat:
        """The format as chat's response_format (what Server.structured compiles)."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        spec = JsonSchemaFormat.model_validate({"name": self.name, "description": self.description,
                                                "schema": self.schema_ or {}, "strict": self.strict})
        return ResponseFormat(type="json_schema", json_schema=spec)


class ResponseText(RefusedText):
    """The Responses API's text: its format."""
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat = TextFormat(type="text")


class FunctionTool(BaseModel):
    """A Responses API tool of the one kind this server takes: a function (_response_tools)."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


def _response_tools(value) -> list[dict]:
    """The Responses API's tools, flat ({"type": "function", "name", "description", "parameters",
    "strict"}), checked as chat's (_tools); returned as given. Other tools (web search, file
    search, MCP, ...) are a 400."""
    if not isinstance(value, list):
        raise PydanticCustomError("tools", "must be a list of tools")
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise PydanticCustomError("tools", f"tool {i} is of type {kind!r}: nano calls function tools only "
                                      "({'type': 'function', 'name': ...})")
        _function(tool, {"type": (str, True)}, i, f"tool {i}")
    return value


def _response_tool_choice(value) -> str | dict:
    """"none", "auto", "required", or a named function: {"type": "function", "name": ...}."""
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        _shape(value, "tool_choice", {"type": (str, True), "name": (str, True)}, "a named tool choice")
        return value
    raise PydanticCustomError("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"name\": ...}: nano calls function tools only")


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(RefusedResponses):
    """OpenAI's Responses API request, as far as nano implements it: a conversation in, a text
    (structured output: text.format) or function calls out (fields.py's RefusedResponses: what
    it does not)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Text | None = None
    input: Annotated[list[dict], PlainValidator(_input, json_schema_input_type=str | list[
        InputMessage | InputFunctionCall | InputFunctionCallOutput])]
    instructions: Text | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    # Echoed in the response, it asks nothing of the model; bounded as OpenAI bounds it.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512), AfterValidator(_checked_text)]],
                        Field(max_length=16)] | None = None
    user: Text | None = None  # an end user's id, for abuse monitoring: asks nothing of the model
    safety_identifier: Text | None = None  # `user`'s successor: asks nothing of the model
    text: ResponseText = ResponseText()  # structured output, as chat's response_format
    # Function tools (tools.py), as chat's: the tools reach the template (in chat's shape)
    tools: Annotated[list[dict], PlainValidator(_response_tools, json_schema_input_type=list[FunctionTool])] | None \
        = None
    tool_choice: Annotated[str | dict, PlainValidator(
        _response_tool_choice, json_schema_input_type=Literal["none", "auto", "required"] | NamedFunction)] | None \
        = None
    parallel_tool_calls: bool = True  # false: at most one call is returned (the first)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, body):  # as Sampling's: clients send "temperature": null
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    def sampling(self) -> Sampling:
        """The request as the chat endpoint's sampling fields (what Server.check and submit take)."""
        # Only the fields the request gave: the others get the generation config's defaults, as chat's do.
        given = {k: getattr(self, k) for k in ("temperature", "top_p") if k in self.model_fields_set}
        return Sampling(model=self.model, stream=self.stream, response_format=self.text.format.response_format(),
                        **given)

    def chat_tools(self) -> list[dict] | None:
        """The tools in chat's shape ({"type": "function", "function": {...}}), as the template gets them."""
        if self.tools is None:
            return None
        return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in self.tools]

    def chat_tool_choice(self) -> str | dict | None:
        """tool_choice in chat's shape; "auto" with no tools (OpenAI's default, echoed so): none asked."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            return {"type": "function", "function": {"name": choice["name"]}}
        return None if choice == "auto" and not self.tools else choice

    def messages(self) -> list[Message]:
        """The conversation the chat template gets: instructions first, as a system message."""
        system = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        return [Message.model_validate(m) for m in system + self.input]
