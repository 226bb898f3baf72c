"""Protobuf messages <-> engine types. Everything a client sends is validated here or by the
engine, and every rejection is an InvalidRequestError naming the field."""
from __future__ import annotations

from jaxinfer.errors import InvalidRequestError
from jaxinfer.request import FinishReason, RequestOutput, SamplingParams
from serve import jaxinfer_pb2 as pb

MAX_REQUEST_ID_CHARS = 128
# Sampling fields that are proto3 `optional` scalars: unset means the engine's default.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "logprobs", "n",
                    "prompt_logprobs")
_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED}


def _utf8(data: bytes, field: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"{field} is not valid UTF-8 (byte {e.start})",
                                  field=field) from None


def prompt_from_proto(req: pb.GenerateRequest):
    """The engine's prompt: text, chat messages, or {"prompt_token_ids": [...]}."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return _utf8(req.text, "prompt")
    if kind == "token_ids":
        return {"prompt_token_ids": list(req.token_ids.ids)}
    if kind == "messages":
        return [{"role": m.role, "content": _utf8(m.content, "messages")}
                for m in req.messages.messages]
    raise InvalidRequestError("no prompt: set one of text, token_ids, messages", field="prompt")


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    kw = {f: getattr(sp, f) for f in _OPTIONAL_FIELDS if sp.HasField(f)}
    kw["stop"] = tuple(_utf8(s, "stop") for s in sp.stop)
    kw["stop_token_ids"] = tuple(sp.stop_token_ids)
    kw["ignore_eos"] = sp.ignore_eos
    kw["min_tokens"] = sp.min_tokens
    kw["include_stop_str_in_output"] = sp.include_stop_str_in_output
    if sp.HasField("skip_special_tokens"):
        kw["skip_special_tokens"] = sp.skip_special_tokens
    if sp.HasField("structured_outputs"):
        kw["structured_outputs"] = structured_from_proto(sp.structured_outputs)
    if sp.lora:
        kw["lora"] = _utf8(sp.lora, "lora")
    return SamplingParams(**kw)  # validates; errors name the field


def structured_from_proto(so: pb.StructuredOutputs) -> dict:
    """StructuredOutputsParams' fields (SamplingParams validates them)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs: set one of json, regex, choice, "
                                  "grammar, json_object", field="structured_outputs")
    value = getattr(so, kind)
    return {kind: list(value.choices) if kind == "choice" else value,
            "any_whitespace": so.any_whitespace}


def structured_to_proto(fields: dict, so: pb.StructuredOutputs) -> None:
    """StructuredOutputsParams' fields (a dict) into `so` (the client's side)."""
    so.SetInParent()
    for kind, value in fields.items():
        if value is None or value is False:
            continue
        if kind == "choice":
            so.choice.choices.extend(value)
        else:
            setattr(so, kind, value)


def request_id_from_proto(req: pb.GenerateRequest) -> str | None:
    rid = req.request_id
    if not rid:
        return None
    if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable "
                                  f"characters", field="request_id")
    return rid


def _add_logprobs(field, tokens, dicts) -> None:
    """One TokenLogprobs per token into the repeated `field` (a None dict: the first prompt
    token's, which has no logprob)."""
    for tok, lp in zip(tokens, dicts):
        if lp is None:
            field.add(token_id=tok)
            continue
        chosen = lp[tok]
        field.add(token_id=tok, logprob=chosen.logprob, rank=chosen.rank or 0,
                  decoded_token=chosen.decoded_token or "",
                  top=[pb.TopLogprob(token_id=t, logprob=v.logprob, rank=v.rank or 0,
                                     decoded_token=v.decoded_token or "")
                       for t, v in lp.items()])


def response_from_output(out: RequestOutput, prompt_logprobs: bool = False
                         ) -> pb.GenerateResponse:
    """One streamed delta. Usage and finish reason are added by the caller on the last one.
    prompt_logprobs: include the prompt's logprobs if the output has them (the caller sends
    them once)."""
    resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids,
                               text=out.text_delta)
    if out.logprobs is not None and out.new_token_ids:
        # RequestOutput.logprobs accumulates; the new tokens' entries are its tail.
        _add_logprobs(resp.logprobs, out.new_token_ids,
                      out.logprobs[-len(out.new_token_ids):])
    if prompt_logprobs and out.prompt_logprobs is not None:
        _add_logprobs(resp.prompt_logprobs, out.prompt_token_ids, out.prompt_logprobs)
    if out.finish_reason is not None:
        resp.finish_reason = _FINISH[out.finish_reason]
    elif out.completions is not None:       # n > 1: one completion's delta
        [c] = out.completions
        resp.index = c.index
        if c.finish_reason is not None and FinishReason(c.finish_reason) in _FINISH:
            resp.finish_reason = _FINISH[FinishReason(c.finish_reason)]
    return resp


def device_name() -> str:
    import os

    import jax

    d = jax.devices()[0]
    return d.device_kind if d.platform == "gpu" else f"{d.platform} ({os.cpu_count()} cores)"


def model_info(engine, max_waiting: int) -> pb.ModelInfoResponse:
    import jax

    cfg, mcfg = engine.config, engine.model_config
    kv_dtype = cfg.dtype if cfg.kv_dtype == "auto" else cfg.kv_dtype
    return pb.ModelInfoResponse(
        model=engine.model_name, context_length=cfg.max_model_len, dtype=cfg.dtype,
        weights_dtype=cfg.dtype if cfg.weights == "bf16" else cfg.weights, kv_dtype=kv_dtype,
        vocab_size=mcfg.vocab_size, has_tokenizer=engine.tokenizer is not None,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        page_size=cfg.page_size, max_waiting_requests=max_waiting, device=device_name(),
        jax_version=jax.__version__, lora_adapters=engine.lora_names(),
        buckets=[pb.Bucket(num_tokens=b.num_tokens, num_seqs=b.num_seqs,
                           pages_per_seq=b.pages_per_seq, decode_only=b.decode_only)
                 for b in engine.buckets.all_buckets()])
