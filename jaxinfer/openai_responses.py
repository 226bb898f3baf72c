"""The OpenAI API's responses: completion and chat-completion objects, stream chunks and
logprobs, built from engine outputs (their requests: openai_protocol.py). Shared by the HTTP
server and the offline script's OpenAI batch format; no jax here."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Sequence

from jaxinfer.errors import InvalidRequestError
from jaxinfer.openai_protocol import FINISH_REASONS, TokenText
from jaxinfer.request import FinishReason, Logprob, PromptLogprobDicts, RequestOutput


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
    return tokenizer.token_text


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(d: dict[int, Logprob], n: int) -> list[tuple[int, float]]:
    """The n most likely (id, logprob) of a logprob dict (which also holds the chosen
    token)."""
    return sorted(((t, lp.logprob) for t, lp in d.items()), key=lambda kv: -kv[1])[:n]


@dataclasses.dataclass
class Choice:
    """One choice of a response as it streams: accumulates what a final response needs."""

    index: int
    logprobs: int | None             # top-n asked for (None: no logprobs)
    with_token_ids: bool = False     # return_token_ids
    n: int = 1                       # completions per prompt (SamplingParams.n)
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0           # the prompt's tokens, on its first choice only (usage)
    prompt_logprobs: PromptLogprobDicts | None = None   # on its prompt's first choice

    @classmethod
    def from_final(cls, index: int, logprobs: int | None, out: RequestOutput,
                   with_token_ids: bool = False) -> list["Choice"]:
        """The choices (one per completion, numbered from `index`) of a request seen only at
        its end: its final output holds the whole answer (token_ids, text, logprobs)."""
        return [cls(index + i, logprobs, with_token_ids, text=c.text,
                    token_ids=list(c.token_ids), token_logprobs=list(c.logprobs or ()),
                    finish_reason=FINISH_REASONS[FinishReason(c.finish_reason)],
                    prompt_tokens=0 if i else len(out.prompt_token_ids),
                    prompt_logprobs=None if i else out.prompt_logprobs)
                for i, c in enumerate(out.outputs)]

    def add(self, out: RequestOutput) -> tuple[list[int], list[dict[int, Logprob]]]:
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
            self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
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
    return {"tokens": tokens, "token_logprobs": [d[t].logprob for t, d in zip(ids, dicts)],
            "top_logprobs": [{token_text(t): lp for t, lp in _top(d, n)} for d in dicts],
            "text_offset": offsets}


def chat_logprobs(ids, dicts, n: int, token_text: TokenText) -> dict:
    """OpenAI's chat logprobs object ({"content": [...]}) for these tokens."""
    def entry(t, lp):
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, d[t].logprob), "top_logprobs": [entry(a, lp) for a, lp in _top(d, n)]}
                        for t, d in zip(ids, dicts)]}


def prompt_logprobs_json(entries: PromptLogprobDicts) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id (a string):
    {"logprob", "rank", "decoded_token"}}."""
    return [None if d is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in d.items()}
            for d in entries]


def _prompt_logprobs(choices: Sequence[Choice], c: Choice) -> dict:
    """{"prompt_logprobs": [...]} for a choice whose request asked for them (each choice of
    a prompt carries its prompt's), else {}."""
    entries = choices[c.index - c.index % c.n].prompt_logprobs
    return {} if entries is None else {"prompt_logprobs": prompt_logprobs_json(entries)}


def completion_response(rid: str, created: int, model: str, choices: Sequence[Choice],
                        token_text: TokenText) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": None if c.logprobs is None else completion_logprobs(
                             c.token_ids, c.token_logprobs, c.logprobs, token_text, 0),
                         **_token_ids(c, c.token_ids), **_prompt_logprobs(choices, c)}
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
            **(_prompt_logprobs(choices, choices[0]) if choices else {}),
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
