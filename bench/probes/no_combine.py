"""A bound, not a kernel: the split decode's combine replaced by zeros (wrong outputs), to
time what removing the combine kernel could give the batch-1 step.

    python bench/probes/no_combine.py decode --model llama-3-8b --weights fp8 ...

takes bench.cli's arguments. H200, thirty-third session (bench/results/last_combines.json,
`bound` rows; run from an uncommitted copy of this file): 8B FP8 B=1 C=512 device step
2.631 / 2.650 ms against 2.675 / 2.770 with the combine, interleaved in one call: up to
~-0.05 to -0.1 ms, the ~2.5 us per layer the profiles gave the combine kernel."""
import sys

import jax.numpy as jnp

from pallas_kernels import paged_attention as pa


def no_combine(acc, m, l, *, splits, rows, batch, num_heads, head_dim, dtype, interpret,
               live=None, token_rows=None, out=None, name=None):
    del acc, m, l
    return jnp.zeros((batch * num_heads, head_dim), dtype)


pa.combine_call = no_combine
from bench.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
