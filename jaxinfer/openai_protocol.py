"""The OpenAI API's requests: completion and chat-completion bodies in, validated and turned
into engine prompts and SamplingParams (their response objects and stream chunks:
openai_responses.py). Shared by the HTTP server and the offline script's OpenAI batch format;
no jax here.

Requests are checked strictly, as OpenAI checks them: an unknown field, a value of the wrong
type, or a known OpenAI field jaxinfer does not implement (`logit_bias`, `tools`, ...) set to
anything but null is an InvalidRequestError naming the field. Fields beyond OpenAI's follow
vLLM's names: `top_k` (-1 or 0: off), `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `return_token_ids` (each choice, and each stream chunk, carries its token ids:
the only output of a model without a tokenizer), and on chat `add_generation_prompt`.
"""
from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import MAX_LOGPROBS, FinishReason, SamplingParams
from jaxinfer.structured_output import StructuredOutputsParams

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.CANCELLED: "abort"}
# OpenAI request fields with no implementation here: accepted only when absent or null.
_UNSUPPORTED = ("logit_bias", "suffix", "tools", "tool_choice", "functions", "function_call",
                "parallel_tool_calls", "audio", "modalities", "prediction",
                "reasoning_effort", "web_search_options")
# Where response_format's JSON schema lands in SamplingParams.structured_outputs: errors about
# it name the OpenAI field.
_RESPONSE_FORMAT_FIELDS = {"structured_outputs.json": "response_format.json_schema.schema",
                           "structured_outputs.json_object": "response_format"}
TokenText = Callable[[int], str]   # token id -> its text (logprobs)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    # "schema" shadows a BaseModel attribute: the field travels under its alias.
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra field: StructuredOutputsParams' fields (json, regex, choice, grammar,
    # json_object, any_whitespace).
    structured_outputs: dict | None = None
    # vLLM's extra field: top-n logprobs of every prompt token (not with stream=true).
    prompt_logprobs: int | None = None
    # vLLM's extra field: the server's queue takes lower values first.
    priority: int = 0
    # Known to OpenAI, not implemented: must stay null (checked in _check_unsupported).
    logit_bias: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter, as vLLM's."""
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter, as vLLM's (lora_int_id is accepted and unused)."""
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _path(loc: Sequence) -> str:
    """pydantic's error location as a field path: messages[0].content. Union branch names
    (str, list[int], ...) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "dict", "list"):
            continue
        else:
            out += ("." if out else "") + part
    return out or "body"


def parse(model_cls: type[_Strict], body) -> Any:
    """Validate a decoded JSON body; InvalidRequestError names the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", field="body")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = _path(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            msg = "unrecognized request argument"
        elif kind == "missing":
            msg = "is required"
        else:
            msg = err["msg"][0].lower() + err["msg"][1:]
        raise InvalidRequestError(f"{field}: {msg}", field=field) from None


def _check_unsupported(req: _Sampling) -> None:
    for name in _UNSUPPORTED:
        if getattr(req, name) is not None:
            raise InvalidRequestError(f"{name} is not supported by this server", field=name)
    if req.best_of not in (None, 1):
        raise InvalidRequestError(f"best_of: only best_of=1 is supported, got {req.best_of}",
                                  field="best_of")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options: only allowed with stream=true",
                                  field="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequestError("prompt_logprobs: not available with stream=true",
                                  field="prompt_logprobs")


def _sampling(req: _Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
    kw = {f: getattr(req, f) for f in ("temperature", "top_p", "min_p", "seed",
                                       "presence_penalty", "frequency_penalty",
                                       "repetition_penalty") if getattr(req, f) is not None}
    if req.top_k is not None:
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k
    kw["structured_outputs"] = _structured_outputs(req)
    return SamplingParams(max_tokens=max_tokens, n=req.n, stop=req.stop or (),
                          stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                          min_tokens=req.min_tokens,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
                          prompt_logprobs=req.prompt_logprobs, **kw)


def _structured_outputs(req: _Sampling) -> StructuredOutputsParams | None:
    """response_format (OpenAI) or structured_outputs (vLLM) as StructuredOutputsParams."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both",
                                  field="structured_outputs")
    if so is not None:
        return StructuredOutputsParams.coerce(so)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise InvalidRequestError("response_format.json_schema.schema is required with type "
                                  "json_schema", field="response_format.json_schema.schema")
    try:
        return StructuredOutputsParams(json=rf.json_schema.schema_)
    except InvalidRequestError as e:
        raise response_format_error(e) from None


def response_format_error(e: InvalidRequestError) -> InvalidRequestError:
    """An error about the structured output response_format asked for, naming that field
    (the error itself unchanged when it is about something else)."""
    field = _RESPONSE_FORMAT_FIELDS.get(e.field)
    if field is None:
        return e
    return type(e)(str(e).replace(e.field, field, 1), field=field)


def _max_tokens(value: int | None, field: str, default: int) -> int:
    if value is None:
        return default
    if value < 1:
        raise InvalidRequestError(f"{field} must be >= 1, got {value}", field=field)
    return value


def completion_prompts(req: CompletionRequest) -> list[str | dict]:
    """The engine prompts of a completion request: one per prompt in `prompt`."""
    p = req.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and isinstance(p[0], int):
        prompts = [{"prompt_token_ids": list(p)}]
    elif p and isinstance(p[0], list):
        prompts = [{"prompt_token_ids": list(ids)} for ids in p]
    else:
        prompts = list(p)
    if not prompts:
        raise InvalidRequestError("prompt is empty", field="prompt")
    return prompts


def completion_params(req: CompletionRequest) -> SamplingParams:
    _check_unsupported(req)
    if req.echo:
        raise InvalidRequestError("echo is not supported by this server", field="echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
                                  field="logprobs")
    return _sampling(req, _max_tokens(req.max_tokens, "max_tokens", 16), req.logprobs)


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """Chat messages as the engine's chat template takes them (text parts joined)."""
    out = []
    for i, m in enumerate(messages):
        if m.tool_call_id is not None:
            raise InvalidRequestError("tool messages are not supported by this server",
                                      field=f"messages[{i}].tool_call_id")
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        elif content is None:
            raise InvalidRequestError(f"messages[{i}].content is required",
                                      field=f"messages[{i}].content")
        out.append({"role": m.role, "content": content})
    if not out:
        raise InvalidRequestError("messages is empty", field="messages")
    return out


def chat_prompt(req: ChatRequest) -> list[dict]:
    """The engine prompt of a chat request: its messages (the generation prompt is always
    added)."""
    messages = chat_messages(req.messages)
    if not req.add_generation_prompt:
        raise InvalidRequestError("add_generation_prompt=false is not supported by this server",
                                  field="add_generation_prompt")
    return messages


def chat_params(req: ChatRequest, max_model_len: int) -> SamplingParams:
    """A chat's SamplingParams; no max_tokens means up to the context length."""
    _check_unsupported(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", field="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                      f"{req.top_logprobs}", field="top_logprobs")
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None
                             else req.max_tokens, field, max_model_len)
    return _sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
