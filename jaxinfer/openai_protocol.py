"""The OpenAI API's shapes: completion and chat-completion requests in (validated, turned into
engine prompts and SamplingParams), response objects and stream chunks out. Shared by the HTTP
server and the offline script's OpenAI batch format; no jax here.

Requests are checked strictly, as OpenAI checks them: an unknown field, a value of the wrong
type, or a known OpenAI field jaxinfer does not implement (`logit_bias`, `tools`, ...) set to
anything but null is an InvalidRequestError naming the field. Fields beyond OpenAI's follow
vLLM's names: `top_k` (-1 or 0: off), `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `return_token_ids` (each choice, and each stream chunk, carries its token ids:
the only output of a model without a tokenizer), and on chat `add_generation_prompt`.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import MAX_LOGPROBS, FinishReason, RequestOutput, SamplingParams
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
                          skip_special_tokens=req.skip_special_tokens, logprobs=logprobs, **kw)


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


# --- responses ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def invalid_request_body(e: InvalidRequestError) -> dict:
    """The 400 response body of an invalid request: `param` is the field it names ("body" when
    none), and the message starts with that field."""
    field, msg = e.field or "body", str(e)
    return {"error": {"message": msg if msg.startswith(field) else f"{field}: {msg}",
                      "type": "invalid_request_error", "param": field, "code": "invalid_value"}}


def token_text_fn(tokenizer) -> TokenText:
    """The token_text of logprobs: a token's text, special tokens included (`token_id:<id>`
    for a model without a tokenizer)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(d: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely of a logprob dict (which also holds the chosen token)."""
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]


@dataclasses.dataclass
class Choice:
    """One choice of a response as it streams: accumulates what a final response needs."""

    index: int
    logprobs: int | None             # top-n asked for (None: no logprobs)
    with_token_ids: bool = False     # return_token_ids
    n: int = 1                       # completions per prompt (SamplingParams.n)
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0           # the prompt's tokens, on its first choice only (usage)

    @classmethod
    def from_final(cls, index: int, logprobs: int | None, out: RequestOutput,
                   with_token_ids: bool = False) -> list["Choice"]:
        """The choices (one per completion, numbered from `index`) of a request seen only at
        its end: its final output holds the whole answer (token_ids, text, logprobs)."""
        return [cls(index + i, logprobs, with_token_ids, text=c.text,
                    token_ids=list(c.token_ids), token_logprobs=list(c.logprobs or ()),
                    finish_reason=FINISH_REASONS[FinishReason(c.finish_reason)],
                    prompt_tokens=0 if i else len(out.prompt_token_ids))
                for i, c in enumerate(out.outputs)]

    def add(self, out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
        """Take one delta; returns its new token ids and their logprob dicts. With n > 1 a
        delta is one completion's (its finish reason in out.outputs[0])."""
        new = list(out.new_token_ids)
        dicts = (out.logprobs[len(out.logprobs) - len(new):] if out.logprobs is not None and new
                 else [])
        self.text += out.text_delta
        self.token_ids += new
        self.token_logprobs += dicts
        if self.index % self.n == 0:
            self.prompt_tokens = len(out.prompt_token_ids)
        reason = out.finish_reason if out.completions is None else out.completions[0].finish_reason
        if reason is not None and FinishReason(reason) in FINISH_REASONS:
            self.finish_reason = FINISH_REASONS[FinishReason(reason)]
        return new, dicts


def choices_for(prompts: int, n: int, logprobs: int | None, with_token_ids: bool
                ) -> list[Choice]:
    """A response's choices: n per prompt, prompt p's completion i at index p * n + i."""
    return [Choice(i, logprobs, with_token_ids, n=n) for i in range(prompts * n)]


def choice_of(choices: Sequence[Choice], prompt_index: int, out: RequestOutput) -> Choice | None:
    """The choice a streamed output advances: prompt `prompt_index`'s, or with n > 1 the
    completion's it carries; None for an n > 1 request's final output (its completions'
    deltas came before it)."""
    n = choices[0].n
    if n == 1:
        return choices[prompt_index]
    if out.finished:
        return None
    return choices[prompt_index * n + out.completions[0].index]


def _token_ids(choice: Choice, ids) -> dict:
    return {"token_ids": list(ids)} if choice.with_token_ids else {}


def completion_logprobs(ids, dicts, n: int, token_text: TokenText, offset: int) -> dict:
    """OpenAI's completions logprobs object for these tokens; `offset`: text before them."""
    tokens = [token_text(t) for t in ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [d[t] for t, d in zip(ids, dicts)],
            "top_logprobs": [{token_text(t): lp for t, lp in _top(d, n)} for d in dicts],
            "text_offset": offsets}


def chat_logprobs(ids, dicts, n: int, token_text: TokenText) -> dict:
    """OpenAI's chat logprobs object ({"content": [...]}) for these tokens."""
    def entry(t, lp):
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(a, lp) for a, lp in _top(d, n)]}
                        for t, d in zip(ids, dicts)]}


def completion_response(rid: str, created: int, model: str, choices: Sequence[Choice],
                        token_text: TokenText) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": None if c.logprobs is None else completion_logprobs(
                             c.token_ids, c.token_logprobs, c.logprobs, token_text, 0),
                         **_token_ids(c, c.token_ids)}
                        for c in choices],
            "usage": usage(sum(c.prompt_tokens for c in choices),
                           sum(len(c.token_ids) for c in choices))}


def chat_response(rid: str, created: int, model: str, choices: Sequence[Choice],
                  token_text: TokenText) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "finish_reason": c.finish_reason,
                         "message": {"role": "assistant", "content": c.text},
                         "logprobs": None if c.logprobs is None else chat_logprobs(
                             c.token_ids, c.token_logprobs, c.logprobs, token_text),
                         **_token_ids(c, c.token_ids)}
                        for c in choices],
            "usage": usage(sum(c.prompt_tokens for c in choices),
                           sum(len(c.token_ids) for c in choices))}


def chat_chunk(rid: str, created: int, model: str, index: int | None, delta: dict | None,
               finish_reason: str | None = None, logprobs: dict | None = None,
               usage_: dict | None = None, with_usage: bool = False,
               token_ids: list[int] | None = None) -> dict:
    """A chat.completion.chunk; index None: the usage-only chunk (no choices)."""
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [] if index is None else [{
                 "index": index, "delta": delta, "logprobs": logprobs,
                 "finish_reason": finish_reason,
                 **({} if token_ids is None else {"token_ids": token_ids})}]}
    if with_usage:
        chunk["usage"] = usage_
    return chunk


def now() -> int:
    return int(time.time())
