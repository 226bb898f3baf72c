"""The engine's edges: prompts in (validated, tokenized), step inputs to the device, text out
(incremental detokenization, stop strings cut correctly), logprobs as dicts."""
from __future__ import annotations

import itertools
import operator
from typing import Sequence

import numpy as np

from jaxinfer.batch import StepArrays
from jaxinfer.errors import ConfigError, InvalidRequestError, InvalidTypeError
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.request import PENDING, Logprob, SamplingParams
from jaxinfer.step_input import StepInput, all_allowed, bitmask_words
from jaxinfer.sampling import DEFAULT_WINDOW, SampleOutput, SamplingArrays
from jaxinfer.scheduler_output import SchedulerOutput
from jaxinfer.tokenizer import IncrementalDetokenizer


def _check_text(text: str, field: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{field} is not valid UTF-8", field=field) from None
    return text


def _check_messages(messages: Sequence) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] must be {{'role': str, 'content': str}}",
                                      field="messages")
        out.append({"role": m["role"], "content": _check_text(m["content"], "messages")})
    if not out:
        raise InvalidRequestError("messages is empty", field="messages")
    return out


def _check_length(text: str, field: str, tokenizer, max_tokens: int | None) -> None:
    """Refuse, before tokenizing it, a text that cannot fit in max_tokens tokens."""
    if max_tokens is None:
        return
    limit = max_tokens * tokenizer.max_token_chars
    if len(text) > limit:
        raise InvalidRequestError(
            f"{field} has {len(text)} characters: more than {max_tokens} tokens (max_model_len) "
            f"can hold ({limit} at {tokenizer.max_token_chars} per token at most)", field=field)


def prompt_token_ids(prompt, tokenizer, vocab_size: int, max_tokens: int | None = None
                     ) -> list[int]:
    """Text, chat messages or {"prompt_token_ids": [...]} -> validated token ids. With
    `max_tokens`, a text (or the messages' content) too long to fit is refused before it is
    tokenized: tokenizing megabytes takes seconds."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        try:
            if any(isinstance(t, bool) for t in ids):
                raise TypeError
            ids = [operator.index(t) for t in ids]
        except TypeError:
            raise InvalidRequestError("prompt_token_ids must be integers",
                                      field="prompt_token_ids") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt_token_ids holds ids outside the vocabulary "
                                      f"[0, {vocab_size}): {bad[:5]}", field="prompt_token_ids")
        if not ids:
            raise InvalidRequestError("prompt is empty", field="prompt_token_ids")
        return ids
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: pass {'prompt_token_ids': [...]}",
                                  field="messages" if isinstance(prompt, list) else "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", field="prompt")
        _check_length(prompt, "prompt", tokenizer, max_tokens)
        return tokenizer.encode(_check_text(prompt, "prompt"))
    if isinstance(prompt, (list, tuple)):
        from jinja2.exceptions import TemplateError
        messages = _check_messages(prompt)
        _check_length("".join(m["content"] for m in messages), "messages", tokenizer,
                      max_tokens)
        try:
            return tokenizer.encode_chat(messages)
        except (ConfigError, TemplateError) as e:   # no template / the template refused
            raise InvalidRequestError(f"messages: {e}", field="messages") from None
    raise InvalidTypeError(f"a prompt is text, a list of chat messages or "
                           f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}",
                           field="prompt")


def check_params_for_model(params: SamplingParams, tokenizer, vocab_size: int) -> None:
    """What SamplingParams cannot check alone: ids within this vocabulary, stop strings
    needing a tokenizer."""
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids holds ids outside the vocabulary "
                                  f"[0, {vocab_size}): {bad[:5]}", field="stop_token_ids")
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; this model has none: use "
                                  "stop_token_ids", field="stop")


class Detokenized:
    """One request's output text (and logprobs). Deltas never hold broken UTF-8
    (IncrementalDetokenizer) nor a possible beginning of a stop string (the last
    len(longest stop) - 1 characters wait)."""

    def __init__(self, tokenizer, prompt_ids, params: SamplingParams, prompt: str | None):
        self._detok = (IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
                       if tokenizer else None)
        self._stop = params.stop
        self._keep_stop = params.include_stop_str_in_output
        self._min_tokens, self._count = params.min_tokens, 0   # stop strings wait for these
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._full = ""      # decoded text of all output tokens
        self._held: list[int] = []   # tokens not decoded yet (add(defer=True))
        self.text = ""       # emitted so far (what the caller has seen)
        self.prompt = prompt
        self.logprobs: list[dict[int, Logprob]] = []  # per output token, when asked for

    def keep(self, token: int) -> bool:
        """`add(token, done=False, defer=True)` where that only keeps the token (no stop
        strings to look for): True, and the token is kept; False: nothing was done."""
        if self._stop:
            return False
        if self._detok is not None:
            self._count += 1
            self._held.append(token)
        return True

    def add(self, token: int, done: bool, defer: bool = False) -> tuple[str, bool]:
        """Append a token; returns (delta to emit, whether a stop string ended the text).
        `done`: the request ends with this token (flush everything held back). `defer`: no
        one reads the delta, so without stop strings to look for the token is only kept, and
        decoded with the rest later (once, not a window per token)."""
        if self._detok is None:
            return "", False
        if defer and not done and self.keep(token):
            return "", False
        self._count += 1
        if self._held:
            self._held.append(token)
            new = self._detok.add(self._held)
            self._held = []
        else:
            new = self._detok.add([token])
        if done:
            new += self._detok.flush()
        start = max(0, len(self._full) - self._hold)
        self._full += new
        hits = [] if self._count < self._min_tokens else [
            (i, len(s)) for i, s in ((self._full.find(s, start), s) for s in self._stop) if i >= 0]
        if hits:   # the earliest stop string in the text wins
            at, length = min(hits)
            self._full = self._full[:at + length if self._keep_stop else at]
            return self._emit(len(self._full)), True
        return self._emit(len(self._full) if done else len(self._full) - self._hold), False

    def finish(self) -> str:
        """The rest, held back or mid-character, when the request ends from outside (abort)."""
        if self._detok is not None:
            if self._held:
                self._full += self._detok.add(self._held)
                self._held = []
            self._full += self._detok.flush()
        return self._emit(len(self._full))

    def _emit(self, upto: int) -> str:
        upto = max(upto, len(self.text))
        delta = self._full[len(self.text):upto]
        self.text += delta
        return delta


_params_of = operator.attrgetter("sampling_params")
_outputs_of = operator.attrgetter("output_token_ids")
_tokens_of = operator.attrgetter("all_token_ids")


def build_step_input(arrays: StepArrays, out: SchedulerOutput, scheduler, prev_tokens,
                     prev_index, vocab_size: int, matchers=None,
                     prompt_targets=None) -> StepInput:
    """The step's StepInput, numpy leaves (the runner packs them into one transfer).
    prev_tokens / prev_index: where PENDING tokens come from (step_input.StepInput); prev_tokens
    may already be on the device (the previous step's output). matchers: request id ->
    structured_output.Matcher of the requests with a grammar (their rows' token bitmask).
    prompt_targets: [T] i32 (prompt_logprobs.step_targets) or None."""
    reqs = list(map(scheduler.requests.__getitem__, arrays.request_ids))
    if out.verify:
        samp = verify_sampling(out, reqs, scheduler, len(arrays.logits_index))
    else:   # the rows' columns read in C (map, attrgetter); the banned ids only if read
        samp = SamplingArrays.from_params(
            list(map(_params_of, reqs)), list(map(len, map(_outputs_of, reqs))),
            list(map(_tokens_of, reqs)), batch_size=len(arrays.seq_lens),
            banned=(scheduler.banned_ids(r) if r.sampling_params.min_tokens else ()
                    for r in reqs))
    md = AttentionMetadata(arrays.positions, arrays.slot_mapping, arrays.token_seq,
                           arrays.page_table, arrays.seq_lens, arrays.query_start,
                           decode_only=arrays.decode_only)
    bitmask = token_bitmask(arrays, matchers, vocab_size) if samp.full else None
    return StepInput(arrays.tokens, md, arrays.logits_index, samp, prev_tokens, prev_index,
                     bitmask, lora_index(arrays, reqs, scheduler.lora_slots), prompt_targets)


class _DraftContexts:
    """Per sampled token of a verify step, its context: the request's tokens and the
    proposals before it. Built only for the rows the penalty window reads."""

    def __init__(self):
        self.items: list = []

    def __getitem__(self, i: int) -> list[int]:
        ids, draft, j = self.items[i]
        return [*ids[-DEFAULT_WINDOW:], *draft[:j]]


def verify_sampling(out: SchedulerOutput, reqs, scheduler, num_samples: int) -> SamplingArrays:
    """A verify step's sampling arrays: a row per fed token (speculative.py), each drawn as a
    plain step would draw it there: the request's parameters, its generated count (the
    seeded key's step) and penalty context advanced by the proposals before it."""
    params, counts, banned = [], [], []
    contexts = _DraftContexts()
    for row, r in zip(out.rows, reqs):
        count, draft, p = r.num_output_tokens, row.token_ids[1:], r.sampling_params
        for j in range(row.num_tokens):
            params.append(p)
            counts.append(count + j)
            contexts.items.append((r.all_token_ids, draft, j))
            banned.append(scheduler.banned_ids(r, count + j) if p.min_tokens else ())
    return SamplingArrays.from_params(params, counts, contexts, batch_size=num_samples,
                                      banned=banned)


def lora_index(arrays: StepArrays, reqs, slots) -> np.ndarray | None:
    """Each token's LoRA slot [T] i32 (-1: no adapter, and padding); None without LoRA."""
    if slots is None:
        return None
    row = np.array([-1 if r.lora is None else slots.slot(r.lora) for r in reqs], np.int32)
    index = row[arrays.token_seq]
    index[arrays.query_start[len(reqs)]:] = -1
    return index


def pending_source(row_of: dict | None, prev_tokens, no_prev, out: SchedulerOutput,
                   arrays: StepArrays):
    """(prev_tokens, prev_index) for the step input: where each PENDING token is. row_of /
    prev_tokens: the step in flight's rows by request id and its sampled tokens on the device
    (None: no step in flight; then `no_prev`, zeros on the device, stands in)."""
    index = np.full(len(arrays.tokens), -1, np.int32)
    n = out.num_rows
    starts, ends = arrays.query_start[:n], arrays.query_start[1:n + 1]
    # A row's PENDING token is its last fed one (the arrays' tokens; none in an empty row).
    pending = np.flatnonzero((ends > starts) & (arrays.tokens[np.maximum(ends - 1, 0)] == PENDING))
    if len(pending):
        # Only ever the one token of a decode row, sampled by the step in flight.
        ids = arrays.request_ids
        source = np.fromiter(map((row_of or {}).get, (ids[b] for b in pending.tolist()),
                                 itertools.repeat(-1)), np.int32, len(pending))
        bad = pending[(source < 0) | (ends[pending] - starts[pending] != 1)]
        if len(bad):
            raise RuntimeError(f"pending token of {ids[bad[0]]!r} has no source")
        index[starts[pending]] = source
    return (no_prev if row_of is None else prev_tokens), index


def token_bitmask(arrays: StepArrays, matchers, vocab_size: int):
    """The `full` step's [B, ceil(V/32)] token bitmask: each sampling row with a grammar gets
    its matcher's allowed tokens; with no such row, the shared device-resident all-ones mask
    (nothing to transfer). A grammar complete since the step was scheduled (a split step's
    masks are filled after the step before is read) leaves its row unmasked: the row's token
    is dropped."""
    rows = len(arrays.logits_index)   # verify steps: a row per token (no grammar there)
    guided = [(b, m) for b, rid in enumerate(arrays.request_ids)
              if arrays.samples[b] and (m := matchers.get(rid)) is not None
              and not m.terminated] if matchers else ()
    if not guided:
        return all_allowed(rows, vocab_size)
    mask = np.full((rows, bitmask_words(vocab_size)), -1, np.int32)
    guided[0][1].fill_rows(mask, guided)
    return mask


def logprob_dict(sampled: SampleOutput, row: int, n: int, token_text=None
                 ) -> dict[int, Logprob]:
    """Row's top-n logprobs plus its chosen token's: {token_id: Logprob}, ranked 1..n for
    the top-n and by the device's rank for a chosen token outside them; token_text: a token
    id's text (None: no decoded_token)."""
    return ranked_dict(sampled.top_ids[row], sampled.top_logprobs[row], n,
                       int(sampled.tokens[row]), sampled.logprob[row], sampled.rank[row],
                       token_text)


def ranked_dict(top_ids, top_logprobs, n: int, chosen: int, logprob, rank, token_text=None
                ) -> dict[int, Logprob]:
    """{token_id: Logprob} of the first n of `top_ids`/`top_logprobs` (ranked 1..n) and of
    `chosen` (with its `logprob` and `rank` when it is not among them)."""
    def text(t):
        return None if token_text is None else token_text(t)
    d = {int(t): Logprob(float(lp), i + 1, text(int(t)))
         for i, (t, lp) in enumerate(zip(top_ids[:n], top_logprobs[:n]))}
    if chosen not in d:
        d[chosen] = Logprob(float(logprob), int(rank), text(chosen))
    return d
