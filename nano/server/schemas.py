"""What the server takes: OpenAI's request bodies (pydantic models; top_k, ignore_eos and
prompt_logprobs are extensions, as in vLLM; a field nano does not implement, or an unknown
one, is a 400 naming it: fields.py), every text field through the command line's text check,
and errors in OpenAI's shape. The models are also /openapi.json's schemas: a field checked by
a function of ours names the JSON it takes (json_schema_input_type), so that the schema says
what the check accepts."""
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationInfo, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from nano import checks
from nano.errors import NanoError
from nano.server import json_values
from nano.server.fields import RefusedChat, RefusedCompletion, RefusedMessage


MAX_TOP_LOGPROBS = 20  # OpenAI's limit
INT64 = 2**63  # vLLM's seed range: [-INT64, INT64)
ROLES = ("system", "developer", "user", "assistant", "tool")  # the chat roles OpenAI takes


def _checked_text(value: str) -> str:
    """The check the command line's prompts get (nano/checks.py): JSON's \\ud800 escape can
    make a lone surrogate, which the tokenizer (and UTF-8) cannot take."""
    try:
        return checks.text("the text", value)
    except NanoError as e:
        raise PydanticCustomError("text", str(e)) from None


Text = Annotated[str, AfterValidator(_checked_text)]

# What the prompt's check (_prompts) takes, as its schema says it: a prompt is a string or a list of
# token ids, neither empty (an id must also be below the model's vocabulary size: a 400 otherwise).
OnePrompt = Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
PromptInput = OnePrompt | Annotated[list[OnePrompt], Field(min_length=1)]


class TextPart(BaseModel):
    """A chat message's content part of the one kind this server takes (_content)."""
    type: Literal["text"]
    text: str


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


class FunctionDef(BaseModel):
    """A tool's function, as OpenAI takes it (_tools)."""
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object: the arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


# A string that holds JSON (a call's arguments), as its schema says it
JsonText = Annotated[str, Field(examples=['{"city": "Paris"}'],
                                json_schema_extra={"contentMediaType": "application/json"})]


class CalledFunction(BaseModel):
    name: str
    arguments: JsonText  # as the model wrote it


class ToolCall(BaseModel):
    """An assistant message's earlier call (_tool_calls)."""
    id: str
    type: Literal["function"]
    function: CalledFunction


def _shape(value, kind: str, keys: dict, where: str) -> None:
    """value is an object whose keys are among `keys` (name -> (type, required))."""
    if not isinstance(value, dict):
        raise PydanticCustomError(kind, f"{where} must be an object")
    for key in value:
        if key not in keys:
            raise PydanticCustomError(kind, f"{where}: {key!r} is an unknown field")
    for key, (types, required) in keys.items():
        if key not in value:
            if required:
                raise PydanticCustomError(kind, f"{where}: {key!r} is required")
        elif not isinstance(value[key], types):
            raise PydanticCustomError(kind, f"{where}: {key!r} must be of type {_TYPE_NAMES[types]}")
        elif isinstance(value[key], str):
            _checked_text(value[key])


_TYPE_NAMES = {str: "string", dict: "object", bool: "boolean", (str, type(None)): "string or null",
               (dict, type(None)): "object or null", (bool, type(None)): "boolean or null"}


def _tools(value) -> list[dict]:
    """The request's tools as OpenAI takes them (type "function"; the function's name, and its
    description and parameters, a JSON schema of an object, if any); returned as given: the
    chat template gets them so."""
    if not isinstance(value, list):
        raise PydanticCustomError("tools", "must be a list of tools")
    for i, tool in enumerate(value):
        _shape(tool, "tools", {"type": (str, True), "function": (dict, True)}, f"tool {i}")
        if tool["type"] != "function":
            raise PydanticCustomError("tools", f"tool {i}: 'type' must be 'function'")
        _function(tool["function"], {}, i, f"tool {i}: 'function'")
    return value


# A function's fields, as a tool gives them: the chat API's (nested) and the Responses API's (flat)
_FUNCTION_KEYS = {"name": (str, True), "description": ((str, type(None)), False),
                  "parameters": ((dict, type(None)), False), "strict": ((bool, type(None)), False)}


def _function(function: dict, keys: dict, i: int, where: str) -> None:
    """A tool's function (its keys: _FUNCTION_KEYS and `keys`), its parameters the JSON schema of an object."""
    _shape(function, "tools", {**keys, **_FUNCTION_KEYS}, where)
    parameters = function.get("parameters")
    if parameters is not None and parameters.get("type", "object") != "object":
        raise PydanticCustomError("tools", f"tool {i}: 'parameters' must be the JSON schema of an object "
                                  "(\"type\": \"object\")")
    try:
        json_values.check_depth(parameters)
    except ValueError as e:
        raise PydanticCustomError("tools", f"tool {i}: 'parameters' {e}") from None


def arguments(text: str, kind: str, where: str) -> dict:
    """A call's arguments as a client sends them back: a JSON object as a string, read strictly
    (json_values.loads); an empty string is {}, as vLLM reads it."""
    try:
        value = json_values.loads(text or "{}")
    except ValueError as e:
        raise PydanticCustomError(kind, f"{where}: 'arguments' must be a JSON string holding an object ({e})") from None
    if not isinstance(value, dict):
        raise PydanticCustomError(kind, f"{where}: 'arguments' must be a JSON string holding an object, not "
                                  f"{type(value).__name__}")
    return value


def _tool_calls(value) -> list[dict]:
    """An assistant message's earlier calls, as OpenAI takes them (id, type "function", the
    function's name and its arguments, a JSON object as a string: arguments()); returned with
    the arguments parsed, as vLLM hands them to the template: tool-use templates expect them
    as objects, as transformers documents."""
    if not isinstance(value, list):
        raise PydanticCustomError("tool_calls", "must be a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        _shape(call, "tool_calls", {"id": (str, True), "type": (str, True), "function": (dict, True)}, f"call {i}")
        if call["type"] != "function":
            raise PydanticCustomError("tool_calls", f"call {i}: 'type' must be 'function'")
        _shape(call["function"], "tool_calls", {"name": (str, True), "arguments": (str, True)}, f"call {i}: 'function'")
        parsed = arguments(call["function"]["arguments"], "tool_calls", f"call {i}")
        calls.append({**call, "function": {**call["function"], "arguments": parsed}})
    return calls


def _tool_choice(value) -> str | dict:
    """"none", "auto", "required", or a named function: {"type": "function", "function": {"name": ...}}."""
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        _shape(value, "tool_choice", {"type": (str, True), "function": (dict, True)}, "a named tool choice")
        _shape(value["function"], "tool_choice", {"name": (str, True)}, "a named tool choice's 'function'")
        if value["type"] == "function":
            return value
    raise PydanticCustomError("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[Literal["name"], str]


# ---- requests (OpenAI's; top_k, ignore_eos, prompt_logprobs, add_generation_prompt: vLLM's) ----
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema (OpenAI's): the schema the output must follow."""
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # absent: any JSON value
    strict: bool | None = None  # true (or absent): a keyword llguidance lacks is a 400; false: it is ignored


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("response_format", "json_schema is required with type json_schema, and only "
                                      "with it")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json (a JSON schema), json_object, regex,
    choice (the output is one of these strings) and grammar (Lark, or GBNF, as llguidance
    reads them)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @field_validator("json_", "regex", "choice", "grammar")
    @classmethod
    def _not_empty(cls, value):
        # An empty schema is JSON's any value (as response_format's absent one); an empty string or list asks nothing.
        if value is not None and not value and not isinstance(value, dict):
            raise PydanticCustomError("structured_outputs", "must not be empty")
        return value

    @model_validator(mode="after")
    def _exactly_one(self):
        if len(self.asked()) != 1:
            raise PydanticCustomError("structured_outputs", "set exactly one of json, json_object, regex, choice, "
                                      "grammar")
        return self

    def asked(self) -> list[str]:
        """The kinds set (json, json_object, regex, choice, grammar): one, once validated."""
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, "json_" if k == "json" else k)
                 is not None]
        return given + (["json_object"] if self.json_object else [])


class Sampling(BaseModel):
    """The fields both endpoints honour."""
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field: a 400, never ignored
    model: Text | None = None
    user: Text | None = None  # the end user's id, for OpenAI's abuse monitoring: asks nothing of the model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: the prompt's, scored
    # vLLM's sampling controls (nano/controls), with its ranges; a token id past the vocabulary is a 400 too
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=1e-6, le=1e6)  # finite in float32, its reciprocal too
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # OpenAI's: {"50256": -100}
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False  # a stop string found ends the text after it, not before
    bad_words: list[Text] | None = None
    response_format: ResponseFormat | None = None  # structured output (nano/structured)
    structured_outputs: StructuredOutputs | None = None  # vLLM's

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, body):
        # As vLLM reads it (temperature, n, stream, ... are Optional there): clients send "top_p": null.
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise PydanticCustomError("logit_bias", f"keys must be token ids, as strings of digits: got "
                                          f"{key!r:.40}")
        return bias

    @field_validator("stream_options")
    @classmethod
    def _streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # vLLM's check (and wording): options set, even to their defaults, without a stream
        if options is not None and options.model_fields_set and not info.data.get("stream"):
            raise PydanticCustomError("stream_options", "Stream options can only be defined when `stream=True`.")
        return options


class CompletionRequest(Sampling, RefusedCompletion):
    prompt: Annotated[list[str | list[int]], PlainValidator(_prompts, json_schema_input_type=PromptInput)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the text and logprobs start with the prompt's (scored by the engine)
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt scored, nothing generated


class Message(RefusedMessage):
    # The schema: content may be null or absent in an assistant's message only.
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})
    role: Literal[ROLES]
    content: str | None = Field(None, validate_default=True)  # absent: as null
    # The template gets these as sent (tool calls: their arguments parsed, as vLLM does).
    name: Text | None = None
    tool_calls: Annotated[list[dict], PlainValidator(_tool_calls, json_schema_input_type=list[ToolCall])] | None = None
    tool_call_id: Text | None = Field(None, validate_default=True)  # a tool message's: the call it answers

    def conversation(self) -> dict:
        """The message as the chat template gets it: role, content (null: empty), and the tool
        fields that were sent."""
        extra = {k: getattr(self, k) for k in ("name", "tool_calls", "tool_call_id") if getattr(self, k) is not None}
        return {"role": self.role, "content": self.content or "", **extra}

    validate_content = field_validator("content", mode="plain",
                                       json_schema_input_type=str | list[TextPart] | None)(_content)

    @field_validator("tool_calls")
    @classmethod
    def _only_the_assistants(cls, calls: list[dict] | None, info: ValidationInfo) -> list[dict] | None:
        if calls is not None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError("tool_calls", "only an assistant's message may have tool_calls")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _only_a_tools(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")  # None: the role itself was refused
        if call_id is not None and role not in ("tool", None):
            raise PydanticCustomError("tool_call_id", "only a tool message may have a tool_call_id")
        if call_id is None and role == "tool":
            raise PydanticCustomError("tool_call_id", "a tool message needs its tool_call_id: the id of the call "
                                      "it answers")
        return call_id


def _answered(messages: list[Message]) -> list[Message]:
    """The conversation, each tool message answering a call an earlier assistant message made
    (OpenAI's check; its wording)."""
    called = set()
    for i, message in enumerate(messages):
        called.update(call["id"] for call in message.tool_calls or [])
        if message.role == "tool" and message.tool_call_id not in called:
            raise PydanticCustomError("messages", f"message {i}: messages with role 'tool' must be a response to a "
                                      f"preceding message with 'tool_calls' (no call has the id "
                                      f"{message.tool_call_id!r:.80})")
    return messages


class ChatRequest(Sampling, RefusedChat):
    messages: Annotated[list[Message], Field(min_length=1), AfterValidator(_answered)]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True  # vLLM's: the template's opening of the assistant's turn
    safety_identifier: Text | None = None  # OpenAI's successor to `user`: an end user's id, asks nothing of the model
    # Tool calls (tools.py): the tools reach the template as sent
    tools: Annotated[list[dict], PlainValidator(_tools, json_schema_input_type=list[Tool])] | None = None
    tool_choice: Annotated[str | dict, PlainValidator(
        _tool_choice, json_schema_input_type=Literal["none", "auto", "required"] | NamedToolChoice)] | None = None
    parallel_tool_calls: bool = True  # false: at most one call is returned (the first)

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):  # vLLM's check and wording
            raise PydanticCustomError("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
        return top


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion's prompt, or a chat's messages in the model's template."""
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"oneOf": [  # one of the two, not null
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in ("prompt", "messages")]})
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[Message], Field(min_length=1), AfterValidator(_answered)] | None = None
    add_generation_prompt: bool = True
    # with messages: the tools, in the template
    tools: Annotated[list[dict], PlainValidator(_tools, json_schema_input_type=list[Tool])] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: Text | None = None
    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str
    type: str                    # invalid_request_error (4xx) or server_error (5xx)
    param: str | None            # the field at fault, if one is
    code: str | None             # model_not_found, invalid_api_key, server_overloaded


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every error the server answers, whatever its status, and a stream's
    error event."""
    error: ErrorDetail


# What each error status the server sends means (/openapi.json's descriptions).
ERRORS = {
    400: "A request the server does not take: a field's type or range (param names it), a limit passed, "
         "a prompt longer than the context, a Host header not allowed (--allowed-hosts).",
    401: "No valid API key (--api-key): send Authorization: Bearer KEY.",
    404: "No such model: this server serves one (GET /v1/models).",
    413: "The body is larger than --max-request-bytes.",
    500: "The engine failed while the request ran (or a bug: internal error).",
    503: "The server is shutting down, its engine stopped, or (code server_overloaded) "
         "--max-queued-requests are in flight: try again later.",
}


def errors(*statuses: int) -> dict:
    """OpenAPI's entries for these error statuses (a route's or router's responses=)."""
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error shape (a response's body, or a stream's last event)."""
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code)).model_dump()


def error_response(message: str, status: int = 400, kind: str = "invalid_request_error",
                   code: str | None = None, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)

