"""What a grid-wide barrier costs inside one Pallas (Triton) kernel: the price of a persistent
decode step, which would replace each kernel boundary of a layer with such a barrier.

At batch 1 a decoder layer runs ~13 kernels (bench/results/profile_b1_fp8.json), each
paying a launch, a ramp and a tail of ~1.5-2.5 us; bench/README.md's notes of the
twenty-first session say the batch-1 goals need that glue roughly halved, and a persistent
kernel is the route they name. This probe measures its first cost: G programs (all resident:
one or two per SM) pass K barriers, each an atomic add on a counter in global memory and a
spin until the counter reaches the next multiple of G. The device time per barrier is
(t(K) - t(0)) / K.

    python -m bench.probes.grid_barrier [--programs 132,264] [--barriers 0,10,100]
        [--spin atomic,volatile] [--spin-limit N] [--chain 200] [--out FILE]

For comparison, --chain K times one jitted program of K dependent one-step kernels (each of
the G programs adds 1 to the counter), by the host clock over back-to-back calls: what a
kernel boundary costs today (launch from XLA's command buffer, ramp, drain), per kernel.

--spin picks how a waiting program reads the counter: an atomic add of 0 (`atomic`) or a
volatile load (`volatile`). A spin is bounded (SPIN_LIMIT reads); a barrier left that way
is counted in `missed` (non-zero means some arrival was not seen, and the timing is void).
Its first run on the H200 (7c3ba78, SPIN_LIMIT then 2^22, barriers 0,100,1000) timed G = 132
at K = 0 (1.62 us) and then did not finish K = 100 within the call's 170 s: its int32
counter never counted (COUNTER says why). With the f32 counter (df63cce,
bench/results/grid_barrier.json; no arrival missed): 0.78-0.79 us per barrier with 132
programs and 0.95 with 264 spinning on a volatile load, 1.24-1.30 spinning on an atomic;
a chained kernel of those programs cost 1.13 / 1.40 us by the host clock.
On the CPU (interpret mode: programs run one after another) it runs one program, whose
barriers pass at once.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bench.common import emit_row, new_result, save
from bench.profile import device_seconds
from pallas_kernels import triton_params

GPU = jax.default_backend() == "gpu"
SPIN_LIMIT = 1 << 16      # counter reads before a spin gives up (interpret mode: 64)
# The counter is f32 (exact to 2^24 arrivals): with jax 0.10-0.11 Pallas lowers an atomic add
# of an int32 *tile* to Triton's `fadd` (its lowering tests the tile's type, not the element
# type, for IntegerType), which adds 1's bit pattern as a float, a subnormal that the GPU's
# f32 atomic add flushes to zero: the first H200 run's arrivals were lost that way (the TTIR
# of the int32 version, lowered for CUDA on the CPU, reads `tt.atomic_rmw fadd ...
# tensor<1xi32>`). Interpret mode adds integers correctly.
COUNTER = jnp.float32


def _barrier_kernel(cnt_in, cnt_ref, miss_ref, *, barriers: int, programs: int, spin: str,
                    spin_limit: int):
    del cnt_in   # aliased to cnt_ref
    from jax.experimental.pallas import triton as plt

    at = (pl.ds(0, 1),)   # the counter as a [1] tile (no scalar indexing of values)

    def read():
        if spin == "atomic":
            return plt.atomic_add(cnt_ref, at, jnp.zeros((1,), jnp.float32))
        return plt.load(cnt_ref.at[at], volatile=True)

    def one(i, missed):
        plt.atomic_add(cnt_ref, at, jnp.ones((1,), jnp.float32))
        target = ((i + 1) * programs).astype(jnp.float32)

        def waiting(c):
            return (jnp.min(c[0]) < target) & (c[1] < spin_limit)

        v, _ = lax.while_loop(waiting, lambda c: (read(), c[1] + 1), (read(), 0))
        return missed + jnp.sum((v < target).astype(jnp.int32))

    miss_ref[pl.program_id(0)] = lax.fori_loop(0, barriers, one, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("programs", "barriers", "spin", "interpret",
                                             "spin_limit"))
def barrier_run(programs: int, barriers: int, spin: str = "atomic", interpret: bool = False,
                spin_limit: int | None = None):
    """One kernel of `programs` programs passing `barriers` grid barriers -> (the counter's
    final value [1] f32, barriers missed per program [programs])."""
    return pl.pallas_call(
        functools.partial(_barrier_kernel, barriers=barriers, programs=programs, spin=spin,
                          spin_limit=spin_limit or (64 if interpret else SPIN_LIMIT)),
        out_shape=(jax.ShapeDtypeStruct((1,), COUNTER),
                   jax.ShapeDtypeStruct((programs,), jnp.int32)),
        grid=(programs,),
        input_output_aliases={0: 0},
        interpret=interpret,
        name="grid_barrier",
        **triton_params(interpret, 1, 1),
    )(jnp.zeros((1,), COUNTER))


def _add_kernel(cnt_in, cnt_ref):
    del cnt_in
    from jax.experimental.pallas import triton as plt
    plt.atomic_add(cnt_ref, (pl.ds(0, 1),), jnp.ones((1,), COUNTER))


@functools.partial(jax.jit, static_argnames=("programs", "kernels", "interpret"))
def chain_run(programs: int, kernels: int, interpret: bool = False):
    """`kernels` dependent kernels of `programs` programs, each adding 1 per program."""
    cnt = jnp.zeros((1,), COUNTER)
    for _ in range(kernels):
        cnt = pl.pallas_call(_add_kernel, out_shape=jax.ShapeDtypeStruct((1,), COUNTER),
                             grid=(programs,), input_output_aliases={0: 0},
                             interpret=interpret, name="grid_chain",
                             **triton_params(interpret, 1, 1))(cnt)
    return cnt


def _host_us(fn, calls: int = 10, repeats: int = 5) -> float:
    """Median over repeats of the host clock per call, `calls` calls back to back."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(calls)])
        times.append((time.perf_counter() - t) / calls)
    return statistics.median(times) * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="132,264" if GPU else "1")
    p.add_argument("--barriers", default="0,10,100" if GPU else "0,3")
    p.add_argument("--spin-limit", type=int, default=None,
                   help=f"counter reads before a spin gives up (default {SPIN_LIMIT})")
    p.add_argument("--spin", default="atomic,volatile")
    p.add_argument("--calls", type=int, default=5, help="kernel calls per timing")
    p.add_argument("--chain", type=int, default=200 if GPU else 3,
                   help="kernels in the chained program (0: none)")
    p.add_argument("--git", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = new_result("grid_barrier", args.git,
                        command=" ".join(["python -m bench.probes.grid_barrier"] + sys.argv[1:]))
    for spin in args.spin.split(","):
        for g in (int(v) for v in args.programs.split(",")):
            base = None
            for k in (int(v) for v in args.barriers.split(",")):
                cnt, missed = barrier_run(g, k, spin, interpret=not GPU,
                                          spin_limit=args.spin_limit)
                jax.block_until_ready(cnt)
                row = {"spin": spin, "programs": g, "barriers": k,
                       "counter": int(cnt[0]), "missed": int(missed.sum())}
                sec = device_seconds(lambda: [barrier_run(g, k, spin, spin_limit=args.spin_limit)
                                              for _ in range(args.calls)], args.calls)
                if sec is not None:
                    row["us"] = round(sec * 1e6, 2)
                    if k == 0:
                        base = row["us"]
                    elif base is not None:
                        row["us_per_barrier"] = round((row["us"] - base) / k, 3)
                emit_row(result, row)
    for g in (int(v) for v in args.programs.split(",")) if args.chain else ():
        cnt = chain_run(g, args.chain, interpret=not GPU)
        row = {"spin": "chain", "programs": g, "kernels": args.chain, "counter": int(cnt[0])}
        if GPU:
            one, many = (_host_us(lambda k=k: chain_run(g, k)) for k in (1, args.chain))
            row.update(us_1=round(one, 2), us=round(many, 2),
                       us_per_kernel=round((many - one) / (args.chain - 1), 3))
        emit_row(result, row)
    if args.out:
        save(result, args.out)
    return result


if __name__ == "__main__":
    main()
