"""What the FP8 decode kernel's per-token K/V scales cost: a timing bound, and the static form.

FP8 KV carries one f32 scale per (layer, kv head, page slot) for K and for V (3% of the bytes
at head dim 128) and the kernel loads them, multiplies the logits by K's and weighs p by V's
(with the f16 path's range lift) every block. A cache with one static scale per (layer, kv
head) would fold both into constants (K's into the logit scale, V's into the output). This
probe times the tuned FP8 decode kernel as it is against the same kernel traced with its scale
refs dropped (`pallas_kernels.paged_attention.kernel_refs` patched to hand the kernel None for
them: no scale loads, no scale math; the results are then wrong by design, so no error is
reported for that variant), the kernel on a cache with static scales (`fp8_static`, one per
kv head: the engine's default since it was built, which should time as the bound), and bf16
KV for the ratio issue 3 asks about. Device time
(bench.profile.device_seconds) over R disjoint page tables (bench.kernels.make_case), the
variants interleaved over rounds, the median kept.

    OUT=dir python -m bench.probes.kv_scales [--shapes 64x2048,32x4096] [--rounds 5]
        [--git SHA]
"""
from __future__ import annotations

import argparse
import os
import statistics

import jax

from bench.kernels import bytes_moved, decode_with, make_case, tuned_blocks
from bench.probes import interleaved_us, write_probe
from pallas_kernels import attention_block, paged_attention

GPU = jax.default_backend() == "gpu"


def _no_scales(refs, fp8: bool):
    q_ref, k_ref, v_ref, _, _, rest = attention_block.kernel_refs(refs, fp8)
    return q_ref, k_ref, v_ref, None, None, rest


def compiled(batch: int, context: int, fp8: bool, case, drop_scales: bool):
    """The tuned decode kernel for the case, compiled; with drop_scales traced without its
    scale refs. Caches are cleared around it so the other variant is traced afresh."""
    jax.clear_caches()
    paged_attention.kernel_refs = _no_scales if drop_scales else attention_block.kernel_refs
    try:
        q, k, v, (ks, vs), tables, lens = case
        fn = decode_with(tuned_blocks(batch, context, fp8), interpret=not GPU)
        return jax.jit(fn).lower(q, k, v, ks, vs, tables[0], lens).compile()
    finally:
        paged_attention.kernel_refs = attention_block.kernel_refs
        jax.clear_caches()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="64x2048,32x4096,256x2048,1x32768",
                    help="BxS,... (Hq 32, Hkv 8, D 128, page 16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON file (default $OUT/kv_scales.json)")
    ap.add_argument("--git", default=None, help="git sha to record (default: HEAD)")
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        cases = {kind: make_case(batch, context, kind != "bf16", jax.random.PRNGKey(0),
                                 static=kind == "static")
                 for kind in ("token", "static", "bf16")}
        variants = {"fp8": ("token", False), "fp8_no_scales": ("token", True),
                    "fp8_static": ("static", False), "bf16": ("bf16", False)}
        fns = {name: compiled(batch, context, kind != "bf16", cases[kind], drop)
               for name, (kind, drop) in variants.items()}
        if not GPU:   # a smoke run: every variant compiles and runs once
            for name, fn in fns.items():
                q, k, v, (ks, vs), tables, lens = cases[variants[name][0]]
                jax.block_until_ready(fn(q, k, v, ks, vs, tables[0], lens))
                print(f"{shape} {name}: ran", flush=True)
            continue
        def run(name):
            q, k, v, (ks, vs), tables, lens = cases[variants[name][0]]
            fn, calls = fns[name], tables.shape[0]
            return (lambda: [fn(q, k, v, ks, vs, tables[r], lens) for r in range(calls)],
                    calls)

        samples = interleaved_us({name: run(name) for name in fns}, args.rounds)
        med = {name: statistics.median(s) for name, s in samples.items()}
        for name, us in med.items():
            kind = variants[name][0]
            nbytes = bytes_moved(batch, context, kind != "bf16", kind == "static")
            rows.append(dict(batch=batch, context=context, variant=name,
                             us_device=round(us, 1),
                             us_rounds=[round(x, 1) for x in samples[name]],
                             TBps=round(nbytes / us / 1e6, 3),
                             bf16_over_this=round(med["bf16"] / us, 3)))
            print(rows[-1], flush=True)
    if GPU:
        write_probe(args.out or os.path.join(os.environ.get("OUT", "."), "kv_scales.json"),
                    "kv_scales", args.git, argv, rows,
                    note="fp8_no_scales is a timing bound (scales ignored: wrong results by "
                         "design); TBps counts the FP8 bytes with per-token scales for fp8 "
                         "and fp8_no_scales, without for fp8_static")


if __name__ == "__main__":
    main()
