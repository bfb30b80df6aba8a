"""The request fields nano does not implement (yet): every field of OpenAI's chat-completions
and completions requests and of vLLM's extensions to them that schemas.py's models do not
honour. Each is declared with its type and the values that ask for nothing nano lacks (absent,
null, or the value vLLM reads as "off": 0 for a penalty, {"type": "text"} for a response
format, ...); any other value is a 400 whose param names the field, never a 200 that drops it.
A field in neither schema is a 400 too (the models forbid extra fields: vLLM logs and ignores
them, nano refuses what it would ignore). The mixins below are the table: schemas.py's
request models inherit them (and set their config: strict, no extra fields), so /openapi.json
lists these fields too."""
import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel
from pydantic_core import PydanticCustomError


class Refuse:
    """A refused field's check: the value is one of `off`, or the field is not implemented."""

    def __init__(self, *off):
        self.off = off

    def __call__(self, value):
        if value is None or value in self.off:  # (strict types: no True == 1 nor 0 == False)
            return value
        accepted = " or ".join(json.dumps(v) for v in (None, *self.off))
        raise PydanticCustomError("not_implemented", f"nano does not implement this field (yet): leave it out or send "
                                  f"{accepted}")


def off(kind, *values):
    """A refused field's type: `kind` (so a wrong type is still named as such), null, or values."""
    return Annotated[kind | None, AfterValidator(Refuse(*values))]


def refused(model: type[BaseModel]) -> dict[str, tuple]:
    """The model's refused fields and the values each accepts (null aside): the docs and tests' view."""
    return {name: check.func.off for name, field in model.model_fields.items() for check in field.metadata
            if isinstance(check, AfterValidator) and isinstance(check.func, Refuse)}


JSON = dict[str, Any]


class RefusedSampling(BaseModel):
    """Both endpoints' (OpenAI's, then vLLM's sampling and extra parameters)."""
    use_beam_search: off(bool, False) = None
    length_penalty: off(float, 1.0) = None  # beam search's
    skip_special_tokens: off(bool, True) = None  # nano's text skips them
    spaces_between_special_tokens: off(bool, True) = None
    truncate_prompt_tokens: off(int) = None
    allowed_token_ids: off(list[int]) = None
    priority: off(int, 0) = None
    request_id: off(str) = None
    logits_processors: off(list) = None
    return_tokens_as_token_ids: off(bool, False) = None
    return_token_ids: off(bool, False) = None
    cache_salt: off(str) = None
    kv_transfer_params: off(JSON) = None
    vllm_xargs: off(JSON) = None


class RefusedCompletion(RefusedSampling):
    suffix: off(str, "") = None
    best_of: off(int, 1) = None
    add_special_tokens: off(bool, True) = None  # a prompt's text gets them (BOS)
    prompt_embeds: off(str | list[str]) = None
    max_repetition_pattern_size: off(int, 0) = None
    min_repetition_pattern_size: off(int, 0) = None
    repetition_min_count: off(int, 0) = None


class RefusedChat(RefusedSampling):
    functions: off(list[JSON]) = None      # OpenAI's deprecated tools
    function_call: off(str | JSON, "none") = None
    audio: off(JSON) = None
    modalities: off(list[str], ["text"]) = None
    prediction: off(JSON) = None
    metadata: off(dict[str, str]) = None   # stored completions'
    store: off(bool, False) = None
    service_tier: off(str, "auto", "default") = None
    prompt_cache_key: off(str) = None
    prompt_cache_retention: off(str) = None
    verbosity: off(str) = None
    web_search_options: off(JSON) = None
    reasoning_effort: off(str) = None
    thinking_token_budget: off(int) = None
    include_reasoning: off(bool, True) = None
    watermarking: off(bool, False) = None
    logprob_token_ids: off(list[int]) = None
    echo: off(bool, False) = None  # vLLM's chat echo: the last message's text first
    continue_final_message: off(bool, False) = None
    add_special_tokens: off(bool, False) = None  # the template writes them
    documents: off(list[JSON]) = None
    chat_template: off(str) = None
    chat_template_kwargs: off(JSON, {}) = None
    media_io_kwargs: off(JSON) = None
    mm_processor_kwargs: off(JSON) = None
    session_id: off(str) = None
    routed_experts_prompt_start: off(int, 0) = None
    return_token_offsets: off(bool, False) = None
    return_prompt_text: off(bool, False) = None
    return_mm_kwargs: off(bool, True) = None
    ec_transfer_params: off(JSON) = None
    repetition_detection: off(JSON) = None
    stream_interval: off(int, 1) = None  # nano sends each token as it comes


class RefusedMessage(BaseModel):
    """A chat message's fields that the chat template does not receive (yet)."""
    function_call: off(JSON) = None
    refusal: off(str) = None
    audio: off(JSON) = None
    reasoning: off(str) = None
    reasoning_content: off(str) = None


class RefusedResponses(BaseModel):
    """POST /v1/responses' (OpenAI's Responses API): nano keeps no responses (store, background,
    previous_response_id, conversation), reasons not apart, and calls function tools only (the
    tools field takes no others)."""
    store: off(bool, False) = None  # OpenAI's default is true: nano stores nothing
    background: off(bool, False) = None
    background_options: off(JSON) = None
    previous_response_id: off(str) = None
    conversation: off(str | JSON) = None
    context_management: off(list[JSON], []) = None
    prompt: off(JSON) = None  # a stored prompt template's id
    max_tool_calls: off(int) = None
    reasoning: off(JSON, {}) = None
    include: off(list[str], []) = None
    truncation: off(str, "disabled") = None
    top_logprobs: off(int, 0) = None
    stream_options: off(JSON, {}, {"include_obfuscation": False}) = None  # nano pads no event
    service_tier: off(str, "auto", "default") = None
    prompt_cache_key: off(str) = None
    prompt_cache_retention: off(str) = None
    prompt_cache_options: off(JSON) = None
    access_programs: off(JSON) = None
    image: off(JSON) = None
    moderation: off(JSON) = None


class RefusedText(BaseModel):
    """The Responses API's text, beside its format."""
    verbosity: off(str, "medium") = None
