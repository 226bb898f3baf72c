"""One paged-attention decode case run a few times, for Nsight Compute (ncu) on the H200:

    ncu --clock-control none -k regex:paged_decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python3 -m bench.kernel_probe 256 2048 fp8

Arguments: batch, context, kv dtype (bf16 | fp8), optionally the FP8 compute dtype
(float16 | bfloat16; default the tuned one) and the impl (a bench.kernels impl name, default
jaxinfer). Shapes as in bench.kernels (Hq 32, Hkv 8, D 128, page 16); one page table."""
from __future__ import annotations

import dataclasses
import sys

import jax

from bench.kernels import impls, make_case, tuned_blocks


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[2] not in ("bf16", "fp8"):
        sys.exit(__doc__)
    batch, context, fp8 = int(argv[0]), int(argv[1]), argv[2] == "fp8"
    blocks = tuned_blocks(batch, context, fp8)
    if len(argv) > 3:
        blocks = dataclasses.replace(blocks, fp8_compute=argv[3])
    name = argv[4] if len(argv) > 4 else "jaxinfer"
    q, k, v, (ks, vs), tables, lens = make_case(batch, context, fp8, jax.random.PRNGKey(0))
    fn = jax.jit(impls(fp8, blocks, tuned=len(argv) <= 3)[name])
    for _ in range(4):
        out = jax.block_until_ready(fn(q, k, v, ks, vs, tables[0], lens))
    print(f"B={batch} S={context} {argv[2]} {name} {blocks}: out {out.shape} {out.dtype}")


if __name__ == "__main__":
    main()
