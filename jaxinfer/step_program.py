"""The programs ModelRunner jits: the step on a packed input (forward, logits of each row's
last token, sampling, the next step's pending tokens), the same step as two programs
(`forward_step`, then `sample_step`), the page copy of n > 1 forks, teacher-forced logits,
and the steps' output shapes. Pure functions of their arguments; runner.py owns the buffers,
the executables and when each runs.

A `full` step without prompt targets that verifies nothing runs as the two programs
(`splits`): the sampling program takes the token bitmask, so the host can fill a grammar's
masks while the forward pass of the same step runs (engine.py), and its conditionals block
the dispatching thread only for the sampling itself (dispatch_thread.py)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer import sampling
from jaxinfer.step_input import unpack


def packed_step(graphdef, routes, treedef, leaves, kv, slot, outs, buf, prev_tokens, bitmask,
                 lora, rng, step_index, spec, kv_sharding=None):
    """The step on a packed input, its values kept at fixed device addresses: XLA updates a
    command buffer's (CUDA graph's) kernels whose buffers moved since the last call, and a
    step whose layers read a moved buffer pays that on every call.
    - `buf` is copied into `slot` first, a donated buffer one element longer that comes back
      as an output: every layer reads positions and page tables from there, and only the
      copy reads the fresh `buf`. The barrier keeps XLA from reading `buf` directly through
      the copy; the extra element keeps the update from covering the whole slot.
    - `outs` (None, or buffers shaped like the step's SampleOutput and next_tokens) are
      donated and the step's results written into them. Fresh outputs moved on every call,
      and XLA places step-wide values (the RoPE tables, the unpacked metadata) in output
      allocations whose live ranges allow it: on the H200 every layer's K/V write and
      attention kernels were updated on each batch-1 call (docs/performance.md). The caller
      copies the results out (ModelRunner.dispatch) before the next call overwrites them.
    `lora`: the adapters' slots (lora_layers.py), None without LoRA.
    Returns (kv, slot, (SampleOutput, next_tokens)): the donated ones in their argument
    order, so jit pairs each output with its own buffer."""
    model, inp, tokens, h, kv, slot, logits = _forward(
        graphdef, routes, treedef, leaves, kv, slot, buf, prev_tokens, bitmask, lora, spec,
        kv_sharding)
    out = sampling.sample(logits, inp.sampling, jax.random.fold_in(rng, step_index),
                          token_bitmask=inp.token_bitmask)
    if inp.prompt_targets is not None:
        out = dataclasses.replace(out, prompt=sampling.prompt_logprobs(
            lambda x: model.logits(x, routes), h, inp.prompt_targets))
    # The sampled tokens padded to [S]: the next step's prev_tokens (one shape for all buckets);
    # a verify step's: each row's last kept token.
    last = (sampling.verify_last_tokens(tokens, out.tokens, inp.md.query_start)
            if inp.verify else out.tokens)
    next_tokens = jnp.zeros_like(inp.prev_tokens).at[:last.shape[0]].set(last)
    return kv, slot, _into(outs, (out, next_tokens), kv_sharding)


def _forward(graphdef, routes, treedef, leaves, kv, slot, buf, prev_tokens, bitmask, lora,
             spec, kv_sharding):
    """The forward pass of packed_step: (model, StepInput, fed tokens, hidden states, kv,
    slot, logits [B, V] f32 of each row's last token)."""
    slot = jax.lax.optimization_barrier(jax.lax.dynamic_update_slice(slot, buf, (0,)))
    inp = unpack(slot, spec, prev_tokens, bitmask)
    # The params travel as a flat list of arrays: flattening the nnx.State (hundreds of
    # leaves with per-layer weights) in Python on every dispatch cost more than the rest.
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    tokens = jnp.where(inp.prev_index >= 0,
                       inp.prev_tokens[jnp.maximum(inp.prev_index, 0)], inp.tokens)
    h, kv = model(tokens, kv, inp.md, routes,
                  None if inp.lora_index is None else (lora, inp.lora_index))
    if kv_sharding is not None:     # pinned, so the donated buffers are reused in place
        kv = jax.lax.with_sharding_constraint(kv, kv_sharding)
    logits = model.logits(h[inp.logits_index], routes)                  # [B, V] f32
    return model, inp, tokens, h, kv, slot, logits


def _into(outs, results, kv_sharding, replicate: bool = False):
    """`results` written into the donated buffers `outs` (None: fresh outputs), replicated
    on a mesh when written into buffers (their layout) or `replicate`."""
    if outs is not None:
        # A use of `outs` that XLA folds away (a select on a constant): jit drops an argument
        # the program never reads, and with it the donation. (keep_unused=True would keep
        # them too, but also the greedy variant's unread rng and step index: a host->device
        # transfer each call.)
        results = jax.tree.map(lambda r, o: jnp.where(False, o, r), results, outs)
    if kv_sharding is not None and (outs is not None or replicate):
        results = jax.lax.with_sharding_constraint(results, jax.sharding.NamedSharding(
            kv_sharding.mesh, jax.sharding.PartitionSpec()))
    return results


def forward_step(graphdef, routes, treedef, leaves, kv, slot, outs, buf, prev_tokens, lora,
                 spec, kv_sharding=None):
    """The forward half of a split step (`splits`): packed_step up to the logits. Returns
    (kv, slot, (logits [B, V] f32, SamplingArrays)), `outs` (None, or buffers shaped like
    those results: `forward_shapes`) donated as in packed_step; the sampling arrays come out
    unpacked, so `sample_step` compiles once per row count, not per bucket."""
    _, inp, _, _, kv, slot, logits = _forward(graphdef, routes, treedef, leaves, kv, slot,
                                              buf, prev_tokens, None, lora, spec, kv_sharding)
    return kv, slot, _into(outs, (logits, inp.sampling), kv_sharding, replicate=True)


def sample_step(logits, arrays, bitmask, rng, step_index, *, num_seqs: int):
    """The sampling half of a split step: (SampleOutput, next_tokens [num_seqs]) as
    packed_step returns them, from forward_step's results and the token bitmask."""
    out = sampling.sample(logits, arrays, jax.random.fold_in(rng, step_index),
                          token_bitmask=bitmask)
    return out, jnp.zeros(num_seqs, jnp.int32).at[:out.tokens.shape[0]].set(out.tokens)


@functools.lru_cache(maxsize=256)
def _input_shapes(spec):
    tree, fields = spec
    return jax.tree_util.tree_unflatten(tree, [jax.ShapeDtypeStruct(shape, np.dtype(name))
                                               for shape, name in fields])


@functools.lru_cache(maxsize=256)
def splits(spec) -> bool:
    """Whether a step of `spec` (PackedInput.spec) runs as forward_step + sample_step: the
    `full` variant, without prompt targets, not a verify step."""
    return splits_host(_input_shapes(spec))


def splits_host(inp) -> bool:
    """`splits` of a StepInput (host arrays or shapes)."""
    return inp.sampling.full and inp.prompt_targets is None and not inp.verify


@functools.lru_cache(maxsize=256)
def forward_shapes(spec, vocab_size: int):
    """forward_step's results (logits, SamplingArrays) as ShapeDtypeStructs."""
    inp = _input_shapes(spec)
    return (jax.ShapeDtypeStruct((inp.logits_index.shape[0], vocab_size), jnp.float32),
            inp.sampling)


@functools.lru_cache(maxsize=256)
def sample_signature(spec, bitmask_shape, num_seqs: int) -> tuple:
    """What selects a compiled sample_step: the rows' sampling arrays (shapes, dtypes), the
    bitmask's shape and the pending-token length; buckets of one row count share it."""
    arrays = _input_shapes(spec).sampling
    leaves, tree = jax.tree_util.tree_flatten(arrays)
    return ("sample", str(tree), tuple((x.shape, x.dtype.name) for x in leaves),
            tuple(bitmask_shape), num_seqs)


@jax.jit
def copy_out(results):
    """The step's results copied out of its persistent buffers for the caller (one small
    program per shape, shared by every runner of the process)."""
    return jax.tree.map(jnp.copy, results)


def copy_pages_program(kv, src, dst):
    """kv with page src[i] copied onto page dst[i] in every array that has pages (K, V and
    per-token scales; static scales [L, K] have none). Pairs (0, 0) are padding."""
    def copy(a):
        return a.at[:, :, dst].set(a[:, :, src]) if a.ndim >= 4 else a
    return jax.tree.map(copy, kv)


@functools.lru_cache(maxsize=256)
def output_shapes(spec, vocab_size: int, num_seqs: int):
    """(SampleOutput, next_tokens [S]) of ShapeDtypeStructs: what the step returns for an
    input of `spec` (PackedInput.spec) with S = num_seqs (prev_tokens' length)."""
    inp = _input_shapes(spec)
    logits = jax.ShapeDtypeStruct((inp.logits_index.shape[0], vocab_size), jnp.float32)
    out = jax.eval_shape(sampling.sample, logits, inp.sampling, jax.random.key(0))
    if inp.prompt_targets is not None:
        t, n = inp.prompt_targets.shape[0], min(sampling.MAX_LOGPROBS, vocab_size)
        f32, i32 = jnp.float32, jnp.int32
        out = dataclasses.replace(out, prompt=sampling.PromptLogprobOutput(
            *(jax.ShapeDtypeStruct(s, d) for s, d in (((t,), f32), ((t,), i32),
                                                       ((t, n), i32), ((t, n), f32)))))
    return out, jax.ShapeDtypeStruct((num_seqs,), jnp.int32)


def all_logits_program(graphdef, routes, params, kv, tokens, md, kv_sharding=None):
    model = nnx.merge(graphdef, params)
    h, kv = model(tokens, kv, md, routes)
    logits = model.logits(h, routes)                                     # [T, V] f32
    if kv_sharding is not None:   # the logits replicated: every process reads them
        kv = jax.lax.with_sharding_constraint(kv, kv_sharding)
        logits = jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(
            kv_sharding.mesh, jax.sharding.PartitionSpec()))
    return kv, logits
