"""What a step takes: the StepInput pytree (tokens, attention metadata, sampling arrays, the
async scheduling's pending-token source), its one-buffer form for the host->device transfer
(PackedInput: pack_host on the host, unpack inside the jitted step) and the all-padding
inputs that compile each bucket ahead of time (dummy_input, warmup_inputs).
runner.py runs it."""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxinfer import sampling
from jaxinfer.kv_cache import AttentionMetadata
from jaxinfer.request import SamplingParams


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "md", "logits_index", "sampling", "prev_tokens",
                                "prev_index", "token_bitmask", "lora_index", "prompt_targets"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StepInput:
    tokens: jax.Array                  # [T] i32 (padding: 0)
    md: AttentionMetadata
    logits_index: jax.Array            # [B] i32  index in T of each row's last new token;
                                       # [T] (every token) in a verify step (speculative.py)
    sampling: sampling.SamplingArrays  # per-row parameters [B, ...] ([T, ...] in a verify step)

    @property
    def verify(self) -> bool:
        """Static: a verify step (speculative.py), a token sampled at every one of the T."""
        return self.logits_index.shape[0] > self.md.seq_lens.shape[0]
    # Async scheduling: tokens the host does not know yet come from the previous step's
    # sampled tokens (its third output, padded to max_num_seqs; a verify step's: each row's
    # last kept token), still on the device.
    prev_tokens: jax.Array             # [S] i32  S = max_num_seqs (zeros when unused)
    prev_index: jax.Array              # [T] i32  row of prev_tokens for token t, -1 = tokens[t]
    # Structured output: the tokens each row may sample (sampling.py), [B, ceil(V/32)] i32 in
    # the `full` variant (all_allowed() when no row has a grammar), None in `plain`.
    token_bitmask: jax.Array | None = None
    # LoRA (lora_layers.py): each token's adapter slot, -1 for none (padding: -1); None when
    # the engine serves no adapters (max_loras 0): then the step has no LoRA work.
    lora_index: jax.Array | None = None    # [T] i32
    # Prompt logprobs (sampling.prompt_logprobs): each token's target, the prompt's next token
    # (-1: none); None when no row of the step asks (`full` only: the third variant).
    prompt_targets: jax.Array | None = None    # [T] i32


@dataclasses.dataclass(frozen=True)
class PackedInput:
    """A StepInput as it travels to the device: every leaf but prev_tokens bit-cast to int32
    and concatenated into ONE buffer (one host->device transfer instead of ~20, which on the
    CPU take a third of the host's time per step at 256 rows), unpacked inside the jitted
    step by static offsets. prev_tokens and token_bitmask stay apart: prev_tokens is usually
    the previous step's output, already on the device, and the bitmask a device-resident
    all-ones mask unless a row has a grammar."""
    buf: jax.Array          # [N] i32
    prev_tokens: jax.Array  # [S] i32
    spec: tuple             # static: (tree structure, ((shape, dtype name), ...) per leaf)
    bitmask: jax.Array | None = None   # [B, ceil(V/32)] i32 (`full`), None (`plain`)
    # the host form it was packed from (the steps multihost.py sends other processes)
    source: StepInput | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def signature(self) -> tuple:
        """What selects a compiled step: the spec (tree structure with its static fields,
        every leaf's shape and dtype), prev_tokens' length and the bitmask's shape."""
        return (self.spec, tuple(np.shape(self.prev_tokens)),
                None if self.bitmask is None else tuple(np.shape(self.bitmask)))


_INT32, _BOOL = np.dtype(np.int32), np.dtype(np.bool_)
_DTYPE_NAMES: dict = {}   # np.dtype -> its name: numpy computes .name in Python (~2 us each)


def pack_host(inp: StepInput) -> tuple[np.ndarray, tuple]:
    """(int32 buffer, spec) of every leaf of `inp` but prev_tokens (numpy or jax leaves)."""
    leaves, tree = jax.tree_util.tree_flatten(dataclasses.replace(inp, prev_tokens=None,
                                                                  token_bitmask=None))
    parts, fields = [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        dt = a.dtype
        if dt == _INT32:
            parts.append(a.ravel())
        elif dt == _BOOL:
            parts.append(a.astype(np.int32).ravel())
        elif dt.itemsize == 4:
            parts.append(np.ascontiguousarray(a).view(np.int32).ravel())
        else:
            raise TypeError(f"StepInput leaf of dtype {dt} cannot be packed (4-byte "
                            f"dtypes and bool only)")
        name = _DTYPE_NAMES.get(dt)
        if name is None:
            name = _DTYPE_NAMES[dt] = dt.name
        fields.append((a.shape, name))
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, (tree, tuple(fields))


def step_shape(spec) -> tuple[int, bool]:
    """(T, decode_only) of a packed input's spec (pack_host's)."""
    tree, fields = spec
    shapes = jax.tree_util.tree_unflatten(tree, [shape for shape, _ in fields])
    return shapes.tokens[0], shapes.md.decode_only


def unpack(buf, spec, prev_tokens, token_bitmask=None) -> StepInput:
    """Inside the jitted step: the StepInput back from its buffer (static slices)."""
    tree, fields = spec
    leaves, off = [], 0
    for shape, name in fields:
        n = int(np.prod(shape, dtype=np.int64))
        x = buf[off:off + n].reshape(shape)
        off += n
        dt = np.dtype(name)
        if dt == np.bool_:
            x = x != 0
        elif dt != np.int32:
            x = jax.lax.bitcast_convert_type(x, dt)
        leaves.append(x)
    return dataclasses.replace(jax.tree_util.tree_unflatten(tree, leaves),
                               prev_tokens=prev_tokens, token_bitmask=token_bitmask)


_ALL_ALLOWED: dict = {}   # (rows, words) -> device array


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def all_allowed(rows: int, vocab_size: int) -> jax.Array:
    """A [rows, ceil(V/32)] token bitmask that allows every token, on the default device,
    made once per shape: the bitmask of `full` steps without a grammar row."""
    key = (rows, bitmask_words(vocab_size))
    mask = _ALL_ALLOWED.get(key)
    if mask is None:
        mask = _ALL_ALLOWED[key] = jax.device_put(np.full(key, -1, np.int32))
    return mask


def dummy_input(bucket, full: bool = False, max_num_seqs: int | None = None,
                vocab_size: int | None = None, lora: bool = False,
                prompt: bool = False) -> StepInput:
    """An all-padding input of `bucket`'s shapes: writes nothing, used to compile ahead.
    full: the `full` sampling variant (penalty window, token bitmask; sampling.py's module
    doc) instead of the all-greedy `plain` one: the two compiled variants of each bucket;
    it needs the model's vocab_size. max_num_seqs: the engine's (the prev_tokens length;
    default the bucket's rows, for one-off compiles). lora: with a LoRA slot per token
    (all -1), the form of an engine that serves adapters. prompt: with prompt targets (all
    -1), the `prompt` variant (implies full)."""
    full = full or prompt
    if full and vocab_size is None:
        raise ValueError("dummy_input: the full variant needs vocab_size (its token bitmask)")
    t, b, w = bucket.num_tokens, bucket.num_seqs, bucket.pages_per_seq
    r = bucket.num_samples
    zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    md = AttentionMetadata(zeros(t), np.full(t, -1, np.int32), zeros(t), zeros(b, w), zeros(b),
                           zeros(b + 1), decode_only=bucket.decode_only)
    rows = [SamplingParams(repetition_penalty=1.1)] if full else []
    samp = sampling.SamplingArrays.from_params(rows, [0] * len(rows), [[0]] * len(rows),
                                               batch_size=r)
    return StepInput(zeros(t), md, zeros(r), samp, zeros(max_num_seqs or b),
                     np.full(t, -1, np.int32), all_allowed(r, vocab_size) if full else None,
                     np.full(t, -1, np.int32) if lora else None,
                     np.full(t, -1, np.int32) if prompt else None)


VARIANTS = ("plain", "full", "prompt")


def warmup_inputs(buckets, max_num_seqs: int, variants=("plain", "full"),
                  vocab_size: int | None = None, lora: bool = False) -> list[StepInput]:
    """The all-padding inputs that compile `variants` (VARIANTS: sampling `plain` / `full`,
    and `prompt`, full with prompt logprobs) of every bucket: what Engine.warmup compiles
    ahead of time."""
    if not variants or set(variants) - set(VARIANTS):
        raise ValueError(f"warmup: variants must be from {VARIANTS}, got {variants}")
    return [dummy_input(b, v != "plain", max_num_seqs, vocab_size, lora, v == "prompt")
            for b in buckets for v in VARIANTS if v in variants]
