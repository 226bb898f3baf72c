"""`jaxinfer bench lora_kernels`: LoRA's update of one projection group, the Pallas kernels
(pallas_kernels/lora.py) against XLA's form (jaxinfer/lora_layers.delta plus the add), at a
model's shapes over step sizes.

For each step size T and group (q/k/v, o, gate/up, down), the rows name slots as a decode step
does: T=1..8 one row with an adapter among padding rows (batch 1), larger T every slot in turn.
Each timed call cycles --sets different weight sets (so L2 never holds the next call's, as in a
step that streams every layer's weights), and `us` is the kernels' time per call on the device
under the profiler (no launch gaps): `shrink_us` and `expand_us` split the Pallas pair.
`speedup` = XLA's us / the kernels' us; `routed` whether the model takes the kernels at that
shape (lora_kernels.faster). On the CPU the kernels run interpreted: the suite runs end to end
but judges nothing.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import new_result, print_table, save
from bench.profile import device_events, trace_events
from jaxinfer.config import standard_config
from jaxinfer.lora_layers import delta
from pallas_kernels import lora as lk

KEYS = ["T", "group", "xla_us", "us", "shrink_us", "expand_us", "speedup", "routed"]


def group_shapes(cfg) -> dict[str, tuple[int, tuple[int, ...]]]:
    """group -> (its input width, its modules' output widths) on one device."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (e, (cfg.q_size, cfg.kv_size, cfg.kv_size)), "o": (cfg.q_size, (e,)),
            "gateup": (e, (f, f)), "down": (f, (e,))}


def kernel_us(fn, y, x, sets, index) -> dict[str, float]:
    """Device time per call of fn over the weight sets, by kernel family (microseconds)."""
    def run():
        return jax.block_until_ready([fn(y, x, a, b, index) for a, b in sets])
    run()
    by = collections.defaultdict(float)
    for e in device_events(trace_events(run)):
        name = e["name"]
        key = "shrink" if "lora_shrink" in name else "expand" if "lora_expand" in name else "xla"
        by[key] += e["dur"] / len(sets)
    return by


def run(args) -> int:
    cfg = standard_config(args.model)
    n, r = args.slots, args.rank
    interpret = jax.default_backend() != "gpu"
    result = new_result(args, model=args.model, slots=n, rank=r, sets=args.sets)
    rng = np.random.default_rng(0)
    for t in args.rows:
        index = jnp.asarray([i % n for i in range(t)] if t > 8 else [n - 1] + [-1] * (t - 1),
                            jnp.int32)
        rows = []
        for group, (din, widths) in group_shapes(cfg).items():
            g, dout = len(widths), sum(widths)
            sets = [(jnp.asarray(rng.standard_normal((din, n, g * r)) * 0.02, jnp.bfloat16),
                     jnp.asarray(rng.standard_normal((n, g * r, dout)) * 0.02, jnp.bfloat16))
                    for _ in range(args.sets)]
            x = jnp.asarray(rng.standard_normal((t, din)), jnp.bfloat16)
            y = jnp.asarray(rng.standard_normal((t, dout)), jnp.bfloat16)
            xla = kernel_us(jax.jit(lambda y, x, a, b, i: y + delta(x, (a, b), i)),
                            y, x, sets, index)
            row = {"T": t, "group": group, "din": din, "widths": list(widths),
                   "xla_us": round(sum(xla.values()), 2),
                   "routed": lk.faster(t, r, din, widths, n)}
            if lk.supported(t, r, din, widths):
                pair = jax.jit(lambda y, x, a, b, i: lk.lora_update(
                    y, x, a, b, i, widths=widths, interpret=interpret))
                k = kernel_us(pair, y, x, sets, index)
                # on the GPU, leave out the copy of y that the aliased output makes outside a
                # step; interpreted kernels (CPU) are XLA ops of their own
                us = k["shrink"] + k["expand"] or k["xla"]
                row.update(us=round(us, 2), shrink_us=round(k["shrink"], 2),
                           expand_us=round(k["expand"], 2),
                           speedup=round(row["xla_us"] / us, 3) if us else None,
                           tiles=str(lk.choose_tiles(t, r, din, widths, n)))
            rows.append(row)
        save(result, args.out, rows)
    print_table(result["rows"], KEYS)
    return 0
