"""Beam search over the engine, in the shape of vLLM's `LLM.beam_search`.

Each round extends every live beam by one token: the beams run as requests of one token
(greedy, with the top 2 x beam_width raw logprobs), each candidate scores its beam's
cumulative logprob plus its own, and the best beam_width non-finished candidates of each
prompt survive. A candidate ending in an EOS token is set aside as finished (unless
ignore_eos). At the end the finished beams and the survivors are ranked by
cumulative_logprob / length ** length_penalty (length counting the prompt, less a final EOS)
and the best beam_width returned, best first.

Beams of one prompt share their common prefix's KV pages through the prefix cache (reference
counts, no copies); each round computes only what the cache does not hold: a beam's last,
partly filled page and its new token. Nothing compiles: every round is ordinary steps.
"""
from __future__ import annotations

import dataclasses
import math

from jaxinfer.errors import InvalidRequestError, InvalidTypeError, JaxinferError
from jaxinfer.request import MAX_LOGPROBS, FinishReason, LogprobDicts, SamplingParams


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """Validated at construction; errors name the field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise InvalidTypeError(f"{name} must be an integer, got {type(v).__name__}",
                                       field=name)
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise InvalidRequestError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got "
                                      f"{self.beam_width}", field="beam_width")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}",
                                      field="max_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidTypeError("ignore_eos must be a bool", field="ignore_eos")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {lp!r}",
                                      field="length_penalty")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones; `logprobs` the top
    logprobs of each generated token ({id: logprob}); `text` the generated text."""

    tokens: list[int]
    logprobs: LogprobDicts
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None    # "stop" (an EOS token) or "length"


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_ids, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, the length not counting a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
    return cum_logprob / (length ** length_penalty)


@dataclasses.dataclass
class _Prompt:
    num_prompt_tokens: int
    beams: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


def beam_search(engine, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt (text, chat messages or {"prompt_token_ids": [...]}) on
    `engine`, which must have no other requests; outputs in prompt order."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidTypeError(f"params must be a BeamSearchParams, got "
                               f"{type(params).__name__}", field="params")
    probe = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width)
    states = []
    for prompt in prompts:
        ids = engine.encode_prompt(prompt, probe)
        states.append(_Prompt(len(ids), [BeamSearchSequence(list(ids), [])]))
    eos = engine.scheduler.eos_token_ids
    limit = engine.config.max_model_len
    for _ in range(params.max_tokens):
        live = [(s, b) for s in states for b in s.beams]
        if not live:
            break
        for s, candidates in _extend(engine, live, probe, params.beam_width):
            kept = []
            for beam in candidates:
                if not params.ignore_eos and beam.tokens[-1] in eos:
                    beam.finish_reason = str(FinishReason.STOP)
                    s.finished.append(beam)
                elif len(beam.tokens) >= limit:     # no room to feed it back
                    beam.finish_reason = str(FinishReason.LENGTH)
                    s.finished.append(beam)
                else:
                    kept.append(beam)
            s.beams = _best(kept, params, eos)[:params.beam_width]
    outputs = []
    for s in states:
        for beam in s.beams:
            beam.finish_reason = str(FinishReason.LENGTH)
        best = _best(s.finished + s.beams, params, eos)[:params.beam_width]
        for beam in best:
            beam.text = _text(engine.tokenizer, beam.tokens[s.num_prompt_tokens:])
        outputs.append(BeamSearchOutput(best))
    return outputs


def _extend(engine, live, probe: SamplingParams, width: int):
    """One round: run each live beam for one token; (prompt state, its new candidate beams)
    per prompt that had live beams, candidates in beam then logprob order."""
    rids = []
    try:
        for _, beam in live:
            rids.append(engine.add_request({"prompt_token_ids": beam.tokens}, probe))
        done = engine.run_until_done(use_tqdm=False)
    except BaseException:
        for rid in rids:
            engine.abort_request(rid)
        raise
    by_state: dict[int, tuple] = {}
    for (state, beam), rid in zip(live, rids):
        out = done[rid]
        if out.finish_reason == FinishReason.ERROR:
            raise JaxinferError(f"beam search: an engine step failed: {out.error}")
        top = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:2 * width]
        entry = by_state.setdefault(id(state), (state, []))
        entry[1].extend(BeamSearchSequence(beam.tokens + [token], beam.logprobs + [out.logprobs[0]],
                                           beam.cum_logprob + lp.logprob)
                        for token, lp in top)
    return list(by_state.values())


def _best(beams, params: BeamSearchParams, eos) -> list[BeamSearchSequence]:
    """Beams ranked by score, best first (a stable sort: ties keep their order)."""
    return sorted(beams, key=lambda b: -beam_score(b.tokens, b.cum_logprob, eos,
                                                   params.length_penalty))


def _text(tokenizer, token_ids: list[int]) -> str | None:
    return None if tokenizer is None else tokenizer.decode(token_ids)
