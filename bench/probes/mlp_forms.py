"""The batch-1 FP8 MLP (8 padded rows) in forms that might let XLA fuse its glue into the GEMMs.

    python -m bench.probes.mlp_forms --out mlp_forms.json [--shapes 8b,qwen]

Every form computes r + down(SiLU(gate) * up) from x [8, E] with FP8 weights ([N, K] codes and
a per-row scale, fp8_matmul.xla_dequant_matmul's route) and is checked against `cur`:
- `cur`: the model's route today: gate|up as one [2F, K] GEMM (scale, bf16), then SiLU(g) * u
  (a loop fusion in the step's HLO), then down (XLA splits its K itself) and the residual add.
- `blk{T}`: gate/up rows interleaved in blocks of T ([F/T, 2, T] row order, the scales
  alike), the product reshaped [8, F/T, 2, T] and SiLU(g) * u taken there: an epilogue XLA's
  GEMM fusion could hold if it tiles the output in blocks of T.
- `bat`: gate and up as a batch of two ([2, F, K]); SiLU(y[0]) * y[1].
- `split{S}`: `cur` with down's K split into S explicit partial products ([S, 8, E] f32,
  summed with the scale and the residual), as decode_qkv.partial_products does for QKV.

`us_device`: device time per MLP (bench.profile.device_seconds over weights rotated so each
call streams from HBM); `kernels`: the compiled program's kernels by kind.

H200, jax 0.11.2 (bench/results/mlp_forms.json, one run): every form compiles to the same two
GEMMs and two loop fusions (XLA fuses SiLU * up into no GEMM), and none is faster: 8B 52.0-54.2
us against `cur`'s 52.0, Qwen2.5-32B 112.5-118.9 against 114.8.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from jax import lax

from bench.common import new_result, save
from bench.fp8_matmul import hlo_kernels, rel_err, time_per_op

FP8 = jnp.float8_e4m3fn
_C = (((1,), (1,)), ((), ()))
SHAPES = {"8b": (4096, 14336), "qwen": (5120, 27648), "tiny": (256, 1024)}


def _dq(x, w, s):
    y = lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), _C,
                        preferred_element_type=jnp.float32)
    return (y * s[None, :]).astype(x.dtype)


def _down(h, wd, sd, r):
    return r + _dq(h, wd, sd)


def cur(x, r, wgu, sgu, wd, sd):
    f = wd.shape[1]
    gu = _dq(x, wgu, sgu)
    return _down(jax.nn.silu(gu[:, :f]) * gu[:, f:], wd, sd, r)


def blocked(t):
    def fn(x, r, wgu, sgu, wd, sd):
        f = wd.shape[1]
        gu = _dq(x, wgu, sgu).reshape(x.shape[0], f // t, 2, t)
        h = (jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]).reshape(x.shape[0], f)
        return _down(h, wd, sd, r)
    return fn


def batched(x, r, wgu, sgu, wd, sd):
    y = jnp.einsum("mk,gfk->gmf", x.astype(jnp.bfloat16), wgu.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    y = (y * sgu[:, None, :]).astype(x.dtype)
    return _down(jax.nn.silu(y[0]) * y[1], wd, sd, r)


def split(parts):
    def fn(x, r, wgu, sgu, wd, sd):
        f = wd.shape[1]
        gu = _dq(x, wgu, sgu)
        h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
        m, n = h.shape[0], wd.shape[0]
        p = jnp.einsum("msk,nsk->smn", h.reshape(m, parts, f // parts).astype(jnp.bfloat16),
                       wd.reshape(n, parts, f // parts).astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        return r + (jnp.sum(p, axis=0) * sd[None, :]).astype(x.dtype)
    return fn


def make_sets(key, e, f, count):
    """count independent (wgu [2F, E], sgu, wd [E, F], sd) FP8 sets, gate rows first."""
    out = []
    for i in range(count):
        k1, k2, k3, k4 = jax.random.split(jax.random.fold_in(key, i), 4)
        wgu = (jax.random.normal(k1, (2 * f, e), jnp.float32) * 2).astype(FP8)
        wd = (jax.random.normal(k2, (e, f), jnp.float32) * 2).astype(FP8)
        sgu = jax.random.uniform(k3, (2 * f,), jnp.float32, 0.5, 1.5) * 0.01
        sd = jax.random.uniform(k4, (e,), jnp.float32, 0.5, 1.5) * 0.01
        out.append(jax.block_until_ready((wgu, sgu, wd, sd)))
    return out


def interleave(ws, t):
    """gate/up rows (and scales) reordered into blocks of t: [F/t, 2, t]."""
    wgu, sgu, wd, sd = ws
    f = wd.shape[1]

    def perm(a):
        return a.reshape(2, f // t, t, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return perm(wgu), perm(sgu), wd, sd


def stack2(ws):
    wgu, sgu, wd, sd = ws
    f = wd.shape[1]
    return wgu.reshape(2, f, -1), sgu.reshape(2, f), wd, sd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b,qwen")
    ap.add_argument("--blocks", default="64,128,256")
    ap.add_argument("--splits", default="4,8,16")
    ap.add_argument("--sets", type=int, default=3, help="weight sets rotated per form")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--git", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = new_result("mlp_forms", git=args.git, command="python -m bench.probes.mlp_forms "
                        + " ".join(argv or sys.argv[1:]))
    for shape in args.shapes.split(","):
        rows = []
        e, f = SHAPES[shape]
        key = jax.random.PRNGKey(e)
        sets = make_sets(key, e, f, args.sets)
        x = jax.random.normal(jax.random.fold_in(key, 1), (8, e), jnp.bfloat16)
        r = jax.random.normal(jax.random.fold_in(key, 2), (8, e), jnp.bfloat16)
        forms = [("cur", cur, sets)]
        forms += [(f"blk{t}", blocked(t), [interleave(s, t) for s in sets])
                  for t in map(int, args.blocks.split(","))]
        forms += [("bat", batched, [stack2(s) for s in sets])]
        forms += [(f"split{p}", split(p), sets) for p in map(int, args.splits.split(","))]
        ref = None
        for name, fn, ws in forms:
            wts = [(r, *w) for w in ws]
            _, dev, out = time_per_op(fn, [x] * len(wts), wts, args.samples, device=True)
            ref = out if ref is None else ref
            rows.append({"shape": shape, "form": name, "E": e, "F": f,
                         "us_device": None if dev is None else round(dev * 1e6, 2),
                         "rel_err_vs_cur": round(rel_err(out, ref), 5),
                         "kernels": hlo_kernels(fn, x, wts[0])["by_kind"]})
            ws = wts = None
        save(result, args.out, rows)       # this shape's rows, appended to the file's
        sets = forms = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
