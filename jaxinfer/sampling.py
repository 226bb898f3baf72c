"""Per-request sampling, vectorized over the B rows of a step: it runs inside the one jitted step.

Order per row (vLLM / HF semantics):
  1. penalties on the raw logits: repetition (HF: a seen token's logit > 0 is divided by the
     penalty, < 0 multiplied; "seen" = in prompt + output), then frequency and presence
     (OpenAI: logit -= frequency * count + presence * [count > 0], counts over OUTPUT tokens);
  2. temperature 0 (below MIN_TEMPERATURE) = greedy: exact argmax of the penalized logits;
  3. otherwise divide by temperature, keep top-k, then top-p (probabilities renormalized over the
     top-k set), then min-p (prob >= min_p * max prob), and draw by Gumbel-max over the full
     vocab with the row's own key.

Logprobs (`SampleOutput.logprob`, `rank`, `top_ids`, `top_logprobs`) are vLLM's default "raw
logprobs": log_softmax of the model's logits BEFORE penalties and temperature. Every row gets
the chosen token's logprob and rank (the tokens at least as likely, itself included) and the
top MAX_LOGPROBS (20) ids + logprobs; the host slices each request's n.

Keys: a row with a seed uses fold_in(key(seed), generated tokens so far), with key(seed) the
threefry key [seed >> 32, seed & 0xffffffff] (= jax.random.key(seed) under x64, or for seeds
< 2**32), so a seeded request samples the same tokens whatever else is in the batch and
whichever row it sits in. Rows without a seed take fresh bits from the engine's rng.

Two compiled variants per batch bucket, chosen on the host (static: the window width W):
  plain  (W = 0): every row greedy, no logprobs, no penalties: one argmax, nothing else. No
         conditional either: an XLA conditional on the GPU copies its predicate to the host
         and blocks the dispatching thread until the forward pass is done, so the host could
         not run ahead of the device.
  full   (W = `window`): any row sampled, asking for logprobs or using a penalty.

Cost control inside `full` without recompiles: top-k/top-p need sorted candidates. We take the
top TOP_CANDIDATES (256) per row with lax.top_k and fall back to a full sort of the vocab, under
lax.cond, only when a row's cut lies beyond them (top_k > 256, or top_p with the 256 best
holding less than top_p of the mass); results are exact either way. The candidate search, the
Gumbel draw and the logprobs each sit under a lax.cond on "does any row need it".

Penalties need each row's seen tokens. The host sends the last W (`window`, default 1024) tokens
of each row's context (prompt + output) as a [B, W] id window padded with -1, plus where its
output part starts; the device scatter-adds them into [B, V] counts. Limit: tokens older than the
last W of the context are not penalized. Host->device cost: 4*B*W bytes (1 MiB at B=256,
W=1024) in every `full` step (rows without a penalty send -1s: an identity); a `plain` step
sends nothing.

min_tokens: until a row has generated that many tokens its EOS and stop token ids (at most
MAX_BANNED_IDS, `banned` [B, N], -1 padded; N = 0 in `plain`) are masked out before sampling;
logprobs stay raw.

Structured output (structured_output.py): `full` takes a packed token bitmask [B, ceil(V/32)]
i32 beside the sampling arrays (bit v % 32 of word v // 32: token v may be sampled); tokens
whose bit is 0 are masked out after the penalties. It travels apart from the packed input:
a step with no grammar row passes a device-resident all-ones mask (no transfer).

Prompt logprobs (SamplingParams.prompt_logprobs; `prompt_logprobs` below): a step that
carries a prompt chunk of such a request is a third variant, `full` plus a [T] target per fed
token (the prompt's next token, -1 for none): the logits of all T tokens, PROMPT_CHUNK at a
time, give each target's raw logprob and rank and the top 20 there (SampleOutput.prompt).

Static (recompile triggers): B, V, W (0 or `window`: two variants per batch bucket), whether
the step has prompt targets, dtypes, `candidates`. Every parameter value is dynamic.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.request import MAX_BANNED_IDS, MAX_LOGPROBS, SamplingParams
from jaxinfer.sampling_columns import COLUMNS, MIN_TEMPERATURE, columns_of, penalty_window

TOP_CANDIDATES = 256
DEFAULT_WINDOW = 1024

_PAD = SamplingParams(max_tokens=1, temperature=0.0)  # padding rows: greedy, nothing else on


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "has_seed", "step",
                 "num_logprobs", "penalty_tokens", "output_start", "banned"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters of one step (padding rows: greedy, everything off)."""

    temperature: jax.Array         # [B] f32  0 = greedy
    top_k: jax.Array               # [B] i32  0 = off
    top_p: jax.Array               # [B] f32  1 = off
    min_p: jax.Array               # [B] f32  0 = off
    repetition_penalty: jax.Array  # [B] f32  1 = off
    presence_penalty: jax.Array    # [B] f32  0 = off
    frequency_penalty: jax.Array   # [B] f32  0 = off
    seed: jax.Array                # [B, 2] u32  (seed >> 32, seed & 0xffffffff)
    has_seed: jax.Array            # [B] bool
    step: jax.Array                # [B] i32  tokens already generated (folded into the key)
    num_logprobs: jax.Array        # [B] i32  requested top-n logprobs; -1 = none
    penalty_tokens: jax.Array      # [B, W] i32  last W context tokens, -1 padded; W = 0: no penalty
    output_start: jax.Array        # [B] i32  index in penalty_tokens where output tokens start
    banned: jax.Array              # [B, N] i32  ids not to sample yet (min_tokens), -1 padded

    @property
    def full(self) -> bool:
        """Static: the shape, not a value, says which variant is compiled (module doc)."""
        return self.penalty_tokens.shape[-1] > 0

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams | None],
                    generated_counts: Sequence[int],
                    token_ids: Sequence[Sequence[int] | None] | None = None, *,
                    batch_size: int, window: int = DEFAULT_WINDOW,
                    banned: Iterable[Sequence[int]] | None = None) -> "SamplingArrays":
        """Host side: numpy arrays for rows `params` (None = padding), padded to `batch_size`.

        generated_counts[b]: tokens row b has generated so far (its key's step; the last that
        many entries of token_ids[b] are its output). token_ids[b]: row b's context, prompt +
        output so far (only its last `window` ids are read); needed only when a row uses a
        repetition, presence or frequency penalty. banned[b]: ids row b may not sample now
        (its EOS and stop token ids while it is short of min_tokens), at most
        MAX_BANNED_IDS: any iterable, read only when a row needs the `full` variant."""
        n = len(params)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if n > batch_size:
            raise ValueError(f"{n} rows do not fit in batch_size {batch_size}")
        if len(generated_counts) != n:
            raise ValueError(f"generated_counts has {len(generated_counts)} entries for {n} rows")
        rows = [p or _PAD for p in params] + [_PAD] * (batch_size - n)
        # Each SamplingParams' columns are packed once (columns_of) and the rows' bytes joined:
        # no per-row numpy conversion, however many distinct objects the rows hold.
        cols = np.frombuffer(b"".join([columns_of(p) for p in rows]), np.float64).reshape(
            batch_size, COLUMNS).T
        seeds = cols[8:10].T.astype(np.uint32)
        has_seed = cols[10].astype(bool)
        step = np.zeros(batch_size, np.int32)
        step[:n] = generated_counts
        full = bool(cols[12].any())
        tokens, out_start = penalty_window(np.flatnonzero(cols[11][:n]), full, token_ids,
                                            generated_counts, batch_size, window)
        no_sample = np.full((batch_size, MAX_BANNED_IDS if full else 0), -1, np.int32)
        for b, ids in enumerate((banned or ()) if full else ()):
            if ids:
                no_sample[b, :len(ids)] = ids
        f32, i32 = (lambda i: cols[i].astype(np.float32)), (lambda i: cols[i].astype(np.int32))
        return cls(
            temperature=f32(0), top_k=i32(1), top_p=f32(2), min_p=f32(3),
            repetition_penalty=f32(4), presence_penalty=f32(5), frequency_penalty=f32(6),
            seed=seeds, has_seed=has_seed,
            step=step, num_logprobs=i32(7), penalty_tokens=tokens, output_start=out_start,
            banned=no_sample)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["logprob", "rank", "top_ids", "top_logprobs"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PromptLogprobOutput:
    """Per fed token t of a step asked for prompt logprobs: the raw logprob of its target
    (the prompt's next token, targets[t]) given the tokens up to t, the target's rank, and the
    top MAX_LOGPROBS there. Tokens without a target (-1): logprob -inf, rank 0."""

    logprob: jax.Array       # [T] f32
    rank: jax.Array          # [T] i32  (1: the best)
    top_ids: jax.Array       # [T, 20] i32
    top_logprobs: jax.Array  # [T, 20] f32


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "logprob", "top_ids", "top_logprobs", "rank", "prompt"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """Logprobs are raw (before penalties/temperature); all-zero ids / -inf logprobs when no
    row asked for logprobs."""

    tokens: jax.Array        # [B] i32  sampled token per row
    logprob: jax.Array       # [B] f32  the sampled token's logprob
    top_ids: jax.Array       # [B, 20] i32  best MAX_LOGPROBS token ids, descending
    top_logprobs: jax.Array  # [B, 20] f32  their logprobs
    rank: jax.Array          # [B] i32  the sampled token's rank in the vocabulary (1: best)
    # The step's prompt logprobs (prompt_logprobs below), None unless it was given targets.
    prompt: PromptLogprobOutput | None = None


PROMPT_CHUNK = 256   # tokens whose [chunk, V] f32 logits exist at once


def prompt_logprobs(logits_fn, h: jax.Array, targets: jax.Array) -> PromptLogprobOutput:
    """Raw logprobs of every fed token's target (PromptLogprobOutput). `h` [T, E] the hidden
    states of the step's tokens, `logits_fn` h [C, E] -> [C, V] f32, `targets` [T] i32 (-1:
    none). The logits are made PROMPT_CHUNK tokens at a time, so a 2,048-token step over a
    128k vocabulary never holds its 1 GiB of f32 logits at once."""
    t = h.shape[0]
    c = min(t, PROMPT_CHUNK)
    pad = -t % c
    hs = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, c, h.shape[-1])
    ts = jnp.pad(targets, (0, pad), constant_values=-1).reshape(-1, c)

    def chunk(args):
        hc, tc = args
        logits = logits_fn(hc).astype(jnp.float32)
        lp, ids, top, rank = _logprobs(logits, jnp.maximum(tc, 0))
        has = tc >= 0
        return (jnp.where(has, lp, -jnp.inf), jnp.where(has, rank, 0), ids, top)

    lp, rank, ids, top = jax.lax.map(chunk, (hs, ts))
    n = min(MAX_LOGPROBS, ids.shape[-1])
    return PromptLogprobOutput(lp.reshape(-1)[:t], rank.reshape(-1)[:t],
                               ids.reshape(-1, n)[:t], top.reshape(-1, n)[:t])


def apply_penalties(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Repetition (over the window: prompt + output), then frequency and presence (over its
    output part) penalties on [B, V] logits. Identity when the window is empty (W = 0)."""
    if not arrays.full:
        return logits
    b, v = logits.shape
    ids = arrays.penalty_tokens                                   # [B, W]
    is_out = jnp.arange(ids.shape[1])[None, :] >= arrays.output_start[:, None]
    ids = jnp.where(ids < 0, v, ids)  # padding -> out of bounds -> dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    seen = jnp.zeros((b, v), jnp.bool_).at[rows, ids].set(True, mode="drop")
    counts = jnp.zeros((b, v), jnp.float32).at[rows, ids].add(is_out.astype(jnp.float32),
                                                            mode="drop")
    rep = arrays.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - arrays.frequency_penalty[:, None] * counts
            - arrays.presence_penalty[:, None] * (counts > 0))


def _row_keys(arrays: SamplingArrays, rng: jax.Array) -> jax.Array:
    """[B] threefry keys: fold_in(key(seed), step) for seeded rows, engine bits otherwise."""
    fresh = jax.random.bits(rng, (arrays.step.shape[0], 2), jnp.uint32)   # [B, 2]
    data = jnp.where(arrays.has_seed[:, None], arrays.seed.astype(jnp.uint32), fresh)
    keys = jax.random.wrap_key_data(data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, arrays.step)


def _top_k_top_p_cut(scaled, top_k, top_p, n):
    """From the n best logits of each row: [B] logit threshold of top-k then top-p, and [B]
    whether the cut may lie beyond the n candidates (then n was too few for that row)."""
    v = scaled.shape[-1]
    vals, _ = jax.lax.top_k(scaled, n)                               # [B, n] descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)               # [B]
    in_k = jnp.arange(n)[None, :] < k[:, None]
    masked = jnp.where(in_k, vals, -jnp.inf)
    # top-p renormalizes over the top-k set: the candidates if it fits in them, else the row
    # (right when top-k is off; other rows are flagged `beyond`).
    log_z = jnp.where(k <= n, jax.nn.logsumexp(masked, axis=-1),
                      jax.nn.logsumexp(scaled, axis=-1))
    p = jnp.exp(masked - log_z[:, None])
    cum = jnp.cumsum(p, axis=-1)
    keep = in_k & ((cum - p < top_p[:, None]) | (top_p[:, None] >= 1))  # token 0 always kept
    kept = jnp.sum(keep, axis=-1)                                    # [B] >= 1
    cut = jnp.take_along_axis(vals, kept[:, None] - 1, axis=-1)[:, 0]
    # Past the candidates: a top-k set larger than them (its normalizer is unknown here), or
    # top-k off and the top-p cut not reached within them.
    beyond = (k > n) & ((k < v) | (keep[:, -1] & (cum[:, -1] < top_p)))
    return cut, beyond


def truncation_threshold(scaled: jax.Array, arrays: SamplingArrays,
                         candidates: int = TOP_CANDIDATES) -> jax.Array:
    """[B] top-k -> top-p -> min-p threshold on [B, V] temperature-scaled logits: a token is
    kept iff its scaled logit >= the threshold (-inf: keep all). Exact, see the module doc."""
    # Greedy rows need no cut: they must not send the batch down the full-sort path.
    active = ((arrays.top_k > 0) | (arrays.top_p < 1)) & (arrays.temperature >= MIN_TEMPERATURE)
    v = scaled.shape[-1]
    n = min(candidates, v)

    def top_k_top_p():
        cut, beyond = _top_k_top_p_cut(scaled, arrays.top_k, arrays.top_p, n)
        if n < v:
            cut = jax.lax.cond(jnp.any(beyond & active),
                               lambda: _top_k_top_p_cut(scaled, arrays.top_k, arrays.top_p, v)[0],
                               lambda: cut)
        return jnp.where(active, cut, -jnp.inf)

    kp = jax.lax.cond(jnp.any(active), top_k_top_p,
                      lambda: jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype))
    # min-p: p >= min_p * p_max  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps all.
    min_p = jnp.max(scaled, axis=-1) + jnp.log(arrays.min_p)
    return jnp.maximum(kp, min_p)


def _draw(adjusted, arrays, rng, candidates):
    """[B] tokens drawn from the tempered, truncated distribution (Gumbel-max, per-row keys)."""
    t = jnp.where(arrays.temperature >= MIN_TEMPERATURE, arrays.temperature, 1.0)
    scaled = adjusted / t[:, None]
    cut = truncation_threshold(scaled, arrays, candidates)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, scaled.shape[-1:], jnp.float32))(
        _row_keys(arrays, rng))
    return jnp.argmax(jnp.where(scaled >= cut[:, None], scaled + gumbel, -jnp.inf), axis=-1)


def _mask_banned(logits, banned):
    """[B, V] logits with each row's banned ids (>= 0) at -inf."""
    rows = jnp.arange(logits.shape[0])[:, None]
    # min: -inf for a banned id, +inf (no change) for padding, whatever the write order.
    return logits.at[rows, jnp.maximum(banned, 0)].min(jnp.where(banned >= 0, -jnp.inf,
                                                                 jnp.inf))


def mask_disallowed(logits, token_bitmask):
    """[B, V] logits with every token whose bit is 0 in the packed [B, ceil(V/32)] i32
    bitmask at -inf."""
    b, v = logits.shape
    bits = (token_bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1   # [B, M, 32]
    return jnp.where(bits.reshape(b, -1)[:, :v] != 0, logits, -jnp.inf)


def _logprobs(logits, tokens):
    logz = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)          # [B, 1]
    top, ids = jax.lax.top_k(logits, min(MAX_LOGPROBS, logits.shape[-1]))
    rank = jnp.sum(logits >= picked, axis=-1, dtype=jnp.int32)   # as vLLM: itself counted
    return picked[:, 0] - logz[:, 0], ids.astype(jnp.int32), top - logz, rank


def _no_logprobs(logits, tokens):
    b, n = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    return (jnp.full((b,), -jnp.inf, jnp.float32), jnp.zeros((b, n), jnp.int32),
            jnp.full((b, n), -jnp.inf, jnp.float32), jnp.zeros((b,), jnp.int32))


def sample(logits: jax.Array, arrays: SamplingArrays, rng: jax.Array, *,
           candidates: int = TOP_CANDIDATES, token_bitmask: jax.Array | None = None
           ) -> SampleOutput:
    """One token per row from [B, V] logits. `rng`: the engine's key for rows without a seed
    (the caller splits it per step). `candidates` (static): top-k/top-p candidate count.
    token_bitmask: [B, ceil(V/32)] i32, the tokens each row may sample (module doc); `full`
    only."""
    logits = logits.astype(jnp.float32)
    if not arrays.full:  # static: all rows greedy, no logprobs, no penalties
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return SampleOutput(tokens, *_no_logprobs(logits, tokens))
    adjusted = _mask_banned(apply_penalties(logits, arrays), arrays.banned)
    if token_bitmask is not None:
        adjusted = mask_disallowed(adjusted, token_bitmask)
    greedy = jnp.argmax(adjusted, axis=-1)
    sampled = arrays.temperature >= MIN_TEMPERATURE
    tokens = jax.lax.cond(
        jnp.any(sampled),
        lambda: jnp.where(sampled, _draw(adjusted, arrays, rng, candidates), greedy),
        lambda: greedy).astype(jnp.int32)
    logprob, top_ids, top_lp, rank = jax.lax.cond(jnp.any(arrays.num_logprobs >= 0),
                                                  _logprobs, _no_logprobs, logits, tokens)
    return SampleOutput(tokens, logprob, top_ids, top_lp, rank)


def verify_last_tokens(fed: jax.Array, sampled: jax.Array, query_start: jax.Array) -> jax.Array:
    """[B] each row's last kept token in a verify step (speculative.py): `fed` [T] the tokens
    fed (row b's at query_start[b]:query_start[b+1], its last token then its proposals),
    `sampled` [T] the token sampled at each; a row keeps sampled tokens while they equal the
    proposal fed after them, and the first that does not."""
    t, b = fed.shape[0], query_start.shape[0] - 1
    j = jnp.arange(t // b)                                      # static width: k + 1
    at = query_start[:-1, None] + j[None, :]                    # [B, k+1]
    n = (query_start[1:] - query_start[:-1])[:, None]
    s = sampled[jnp.minimum(at, t - 1)]
    held = (s == fed[jnp.minimum(at + 1, t - 1)]) & (j[None, :] + 1 < n)
    m = jnp.sum(jnp.cumprod(held.astype(jnp.int32), axis=1), axis=1)
    return jnp.take_along_axis(s, m[:, None], axis=1)[:, 0]
