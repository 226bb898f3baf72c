"""The OpenAI Batch API's lines for the offline script (jaxinfer/batch_generate.py): a request
line ({"custom_id", "method", "url", "body"}) parsed into engine prompts and SamplingParams
with jaxinfer.openai_protocol, and the output line ({"id", "custom_id", "response",
"error"}) built from its finished requests, as vLLM's `run-batch` reads and writes them."""
from __future__ import annotations

import dataclasses
import uuid

from jaxinfer import openai_protocol as oai
from jaxinfer import openai_responses as oresp
from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import RequestOutput, SamplingParams

BATCH_FIELDS = ("custom_id", "method", "url", "body")
BATCH_URLS = (oai.COMPLETIONS_URL, oai.CHAT_URL)


@dataclasses.dataclass
class BatchLine:
    """An OpenAI batch line: its engine prompts, and their final outputs as they finish."""
    custom_id: str
    chat: bool                 # /v1/chat/completions (else /v1/completions)
    prompts: list              # what Engine.add_request takes, one per choice
    params: SamplingParams
    with_token_ids: bool = False    # return_token_ids
    created: int = 0
    outputs: dict[int, RequestOutput] = dataclasses.field(default_factory=dict)


def batch_custom_id(obj: dict) -> str:
    """A batch line's custom_id; without a usable one the line gets no result."""
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid:
        raise InvalidRequestError(f"custom_id must be a non-empty string, got {cid!r}",
                                  field="custom_id")
    return cid


def parse_batch_line(obj: dict, custom_id: str, max_model_len: int) -> BatchLine:
    """An OpenAI batch line -> BatchLine; InvalidRequestError names the field as a path from
    the line (`url`, `body.messages[0].content`, ...)."""
    unknown = sorted(set(obj) - set(BATCH_FIELDS))
    if unknown:
        raise InvalidRequestError(f"{unknown[0]}: unknown field (known: "
                                  f"{', '.join(BATCH_FIELDS)})", field=unknown[0])
    for field, allowed in (("method", ("POST",)), ("url", BATCH_URLS), ("body", None)):
        if field not in obj:
            raise InvalidRequestError(f"{field}: is required", field=field)
        if allowed is not None and obj[field] not in allowed:
            raise InvalidRequestError(f"{field}: must be {' or '.join(map(repr, allowed))}, got "
                                      f"{obj[field]!r}", field=field)
    chat = obj["url"] == oai.CHAT_URL
    try:
        req = oai.parse(oai.ChatRequest if chat else oai.CompletionRequest, obj["body"])
        if req.stream:
            raise InvalidRequestError("stream=true is not supported in a batch", field="stream")
        if chat:
            params, prompts = oai.chat_params(req, max_model_len), [oai.chat_prompt(req)]
        else:
            params, prompts = oai.completion_params(req), oai.completion_prompts(req)
    except InvalidRequestError as e:
        raise in_body(e) from None
    return BatchLine(custom_id, chat, prompts, params, req.return_token_ids)


def in_body(e: InvalidRequestError, field: str | None = None) -> InvalidRequestError:
    """An error about a batch line's body, its field as a path from the line (body.<field>);
    `field` replaces the one `e` names."""
    own, msg = e.field or "body", str(e)
    if msg.startswith(own + ": "):
        msg = msg[len(own) + 2:]
    own = field or own
    param = own if own == "body" else f"body.{own}"
    return InvalidRequestError(f"{param}: {msg}", field=param)


def batch_record(custom_id: str, status: int, request_id: str | None, body: dict) -> dict:
    """A batch line's result: OpenAI's batch output line."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def batch_response(b: BatchLine, model: str, token_text: oai.TokenText) -> dict:
    """The 200 result of a batch line whose prompts have all finished."""
    choices = [c for i in range(len(b.prompts))
               for c in oresp.Choice.from_final(i * b.params.n, b.params.logprobs, b.outputs[i],
                                              b.with_token_ids)]
    rid = oresp.new_id("chatcmpl" if b.chat else "cmpl")
    build = oresp.chat_response if b.chat else oresp.completion_response
    return batch_record(b.custom_id, 200, rid, build(rid, b.created, model, choices, token_text))
