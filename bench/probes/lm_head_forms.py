"""The int8 LM head's GEMM at 64-512 rows in three operand arrangements against the bf16 head.

    python -m bench.probes.lm_head_forms --out forms.json

Llama-3-8B's head (E 4096, V 128256). `int8_cur` is ops.int8_head (x [M, E] against codes
[V, E] widened to bf16 in the GEMM's operand, the per-row scale on the f32 product),
`int8_lhs` the same product with the codes as the left operand ([V, M], transposed after),
`int8_ev` codes stored [E, V]; `bf16_ve` the bf16 head (bench.probes.lm_head's). `us_device`
as there. Run once as a one-off script with these forms written out (thirty-fifth session;
ops.int8_head's body at M >= 64 is the same ops) and committed with its result
(bench/results/history/lm_head_forms_9e7ccb8.json): all three int8 forms ran ~1.6x the bf16
head's time at 256-512 rows, where XLA gives the bf16 head to cuBLAS and the int8 ones to its
own GEMM fusion.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax

from bench.common import new_result, save
from bench.fp8_matmul import hlo_kernels, time_per_op
from bench.probes.lm_head import bf16_ve, int8_rows
from jaxinfer import ops

_C = (((1,), (1,)), ((), ()))


def int8_lhs(x, codes, scale):
    y = lax.dot_general(codes.astype(jnp.bfloat16), x, _C, preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)[:, None]).T


def int8_ev(x, codes_ev, scale):
    y = jnp.dot(x, codes_ev.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return y * scale.astype(jnp.float32)[None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="64,128,256,512")
    ap.add_argument("--git", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = new_result("lm_head_forms", git=args.git, command="python -m "
                        "bench.probes.lm_head_forms " + " ".join(argv or sys.argv[1:]))
    e, v = 4096, 128256
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (v, e), jnp.float32) * 0.02
    codes, scale = int8_rows(w, None)
    codes_ev = jnp.asarray(codes.T)
    wb = w.astype(jnp.bfloat16)
    del w
    rows = []
    for m in (int(t) for t in args.ms.split(",")):
        x = jax.random.normal(jax.random.fold_in(key, m), (m, e), jnp.bfloat16)
        for name, fn, wt in (("bf16_ve", bf16_ve, (wb,)), ("int8_cur", ops.int8_head, (codes, scale)),
                             ("int8_lhs", int8_lhs, (codes, scale)),
                             ("int8_ev", int8_ev, (codes_ev, scale))):
            _, dev, _ = time_per_op(fn, [x], [wt], 10, device=True)
            rows.append({"impl": name, "M": m,
                         "us_device": None if dev is None else round(dev * 1e6, 1),
                         "kernels": hlo_kernels(fn, x, wt)["by_kind"]})
            print(rows[-1], flush=True)
    save(result, args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
