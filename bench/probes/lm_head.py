"""The LM head's GEMV at batch 1 in the forms a quantized head could take, timed on the GPU.

    python -m bench.probes.lm_head --out lm_head.json [--shapes 4096x128256,5120x152064]

For each head shape (E x V: Llama-3-8B, Qwen2.5-32B) and M in {1, 8} (the decode step pads
its rows to a bucket of 8), one process times: the bf16 head as the model stores it
(`bf16_ev`: [E, V]; `bf16_ve`: the tied embedding's [V, E]), the FP8 per-vocab-row head
through the fused-dequant route (`fp8_row`, pallas_kernels.fp8_matmul.xla_dequant_matmul),
int8 per vocab row (`int8_row`: codes widened to bf16 in the GEMM's operand, the scale in
its epilogue) and int8 per vocab row and group of G input channels (`int8_gG`: codes times
their group's scale widened in the operand, the form that would keep answer quality where
per-row scales do not; bench/lm_head_quality.py). `us_device` is the device-side time per
call (bench.profile.device_seconds), `TBps` the weight bytes (codes + scales) over it,
`kernels` what XLA compiled the call to (a dequant XLA did not fuse shows as an extra
fusion), `rel_err` the error against the f32 product with the bf16 weight.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax

from bench.common import new_result, parse_ints, print_table, save
from bench.fp8_matmul import hlo_kernels, rel_err, time_per_op
from checkpoints.fp8 import quantize_linear
from pallas_kernels import fp8_matmul as fm

_CONTRACT_K = (((1,), (1,)), ((), ()))     # x [M, K] . w [N, K] -> [M, N]


def int8_rows(w_ve, group: int | None):
    """w [V, E] f32 -> int8 codes [V, E] and scales [V] (group None) or [V, E / group]."""
    v, e = w_ve.shape
    g = e if group is None else group
    blocks = w_ve.reshape(v, e // g, g)
    scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(blocks / scale), -127, 127).astype(jnp.int8).reshape(v, e)
    scale = scale[..., 0].astype(jnp.bfloat16)
    return codes, (scale[:, 0] if group is None else scale)


def bf16_ev(x, w_ev):
    return jnp.dot(x, w_ev, preferred_element_type=jnp.float32)


def bf16_ve(x, w_ve):
    return lax.dot_general(x, w_ve, _CONTRACT_K, preferred_element_type=jnp.float32)


def fp8_row(x, w_q, scale):
    xp = jnp.pad(x, ((0, max(0, 8 - x.shape[0])), (0, 0)))
    return fm.xla_dequant_matmul(xp, w_q, scale)[:x.shape[0]].astype(jnp.float32)


def int8_row(x, codes, scale):
    xp = jnp.pad(x, ((0, max(0, 8 - x.shape[0])), (0, 0)))
    y = lax.dot_general(xp, codes.astype(jnp.bfloat16), _CONTRACT_K,
                        preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)[None, :])[:x.shape[0]]


def int8_group(x, codes, scale):
    v, e = codes.shape
    g = e // scale.shape[1]
    w = (codes.reshape(v, e // g, g).astype(jnp.bfloat16) * scale[:, :, None]).reshape(v, e)
    xp = jnp.pad(x, ((0, max(0, 8 - x.shape[0])), (0, 0)))
    y = lax.dot_general(xp, w, _CONTRACT_K, preferred_element_type=jnp.float32)
    return y[:x.shape[0]]


def bench_shape(e: int, v: int, ms, groups, samples: int, rows: list) -> None:
    key = jax.random.PRNGKey(e + v)
    w = jax.random.normal(key, (v, e), jnp.float32) * 0.02
    w_ve = w.astype(jnp.bfloat16)
    w_ev = jnp.asarray(w_ve.T)
    forms = {"bf16_ev": (bf16_ev, (w_ev,), 2 * e * v),
             "bf16_ve": (bf16_ve, (w_ve,), 2 * e * v),
             "fp8_row": (fp8_row, quantize_linear(w.T), e * v + 4 * v),
             "int8_row": (int8_row, int8_rows(w, None), e * v + 2 * v)}
    for g in groups:
        forms[f"int8_g{g}"] = (int8_group, int8_rows(w, g), e * v + 2 * v * (e // g))
    del w
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(key, m), (m, e), jnp.bfloat16)
        ref = jnp.dot(x.astype(jnp.float32), w_ve.astype(jnp.float32).T,
                      precision=lax.Precision.HIGHEST)
        for name, (fn, weight, nbytes) in forms.items():
            weight = tuple(jax.block_until_ready(weight))
            s, dev, out = time_per_op(fn, [x], [weight], samples, device=True)
            us = (dev if dev is not None else s) * 1e6
            rows.append({"impl": name, "M": m, "E": e, "V": v, "us": round(s * 1e6, 2),
                         "us_device": None if dev is None else round(dev * 1e6, 2),
                         "TBps": round(nbytes / us / 1e6, 3),
                         "rel_err": round(rel_err(out, ref), 5),
                         "kernels": hlo_kernels(fn, x, weight)["by_kind"]})
            print({k: rows[-1][k] for k in ("impl", "M", "us", "us_device", "TBps", "rel_err")},
                  flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x128256,5120x152064",
                    help="head shapes E x V, comma-separated")
    ap.add_argument("--ms", default="1,8", help="token rows per call")
    ap.add_argument("--groups", default="64,128", help="int8 group sizes along E")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--git", default=None, help="git sha to record (default: this checkout)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = new_result("lm_head", git=args.git, command="python -m bench.probes.lm_head "
                        + " ".join(argv if argv is not None else sys.argv[1:]))
    rows: list = []
    for shape in args.shapes.split(","):
        e, v = (int(t) for t in shape.lower().split("x"))
        bench_shape(e, v, parse_ints(args.ms), parse_ints(args.groups), args.samples, rows)
    print_table(rows, ["impl", "M", "E", "V", "us", "us_device", "TBps", "rel_err"])
    save(result, args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
