"""LoRA's shrink and expand kernels (pallas_kernels/lora.py) against their jnp reference, in
interpret mode on the CPU (the real kernels on the GPU), and the form the model takes
(lora_layers.add_update) against XLA's."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora as lk

ON_GPU = jax.default_backend() == "gpu"


def _group(rng, din, n, rank, widths, dtype=jnp.bfloat16):
    """A [in, N, G*R] and B [N, G*R, out] in the grouped layout: module g's B on rows g*R..
    and its own columns, zeros elsewhere."""
    g = len(widths)
    a = rng.standard_normal((din, n, g * rank)) * 0.05
    b = np.zeros((n, g * rank, sum(widths)))
    col = 0
    for i, w in enumerate(widths):
        b[:, i * rank:(i + 1) * rank, col:col + w] = rng.standard_normal((n, rank, w)) * 0.05
        col += w
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


@pytest.mark.parametrize("rows,din,slots,rank,widths,used", [
    (1, 128, 4, 16, (64, 32, 32), [2]),               # one row, CUDA-core products
    (8, 256, 4, 16, (128, 64, 64), [-1, 2]),           # q, k, v; rows without an adapter
    (16, 512, 8, 16, (256,), [-1, 0, 3, 7]),           # tensor-core dots, split K
    (32, 256, 4, 32, (128, 128), [0, 1, 2, 3]),        # gate, up at rank 32, every slot
    (64, 1024, 8, 16, (256,), [5]),                    # one adapter for the whole batch
])
@pytest.mark.parametrize("skip", [True, False])
def test_each_row_gets_its_own_slot_s_update_added(rows, din, slots, rank, widths, used, skip):
    rng = np.random.default_rng(rows * 7 + din)
    a, b = _group(rng, din, slots, rank, widths)
    x = jnp.asarray(rng.standard_normal((rows, din)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((rows, sum(widths))), jnp.bfloat16)
    index = jnp.asarray(rng.choice(used, size=rows), jnp.int32)
    tiles = dataclasses.replace(lk.choose_tiles(rows, rank, din, widths, slots), skip=skip)
    got = lk.lora_update(y, x, a, b, index, widths=widths, tiles=tiles, interpret=not ON_GPU)
    want = lk.lora_update_reference(y, x, a, b, index)
    got, want = (np.asarray(v.astype(jnp.float32)) for v in (got, want))
    # bf16 output: one rounding of |y + delta| apart at most
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7)
    none = np.asarray(index) < 0
    np.testing.assert_array_equal(got[none], np.asarray(y.astype(jnp.float32))[none])
    assert np.abs(got - np.asarray(y.astype(jnp.float32)))[~none].max() > 0.01


def test_split_k_partials_take_the_update_in_their_first_part():
    """y [P, T, out] f32 (the fused decode front's partial products): part 0 gains each row's
    update and the other parts keep their values, so the parts' sum is the projection plus
    its update."""
    rng = np.random.default_rng(11)
    widths, rows, din = (64, 32, 32), 8, 256
    a, b = _group(rng, din, 4, 16, widths)
    x = jnp.asarray(rng.standard_normal((rows, din)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((4, rows, sum(widths))), jnp.float32)
    index = jnp.asarray([-1, 2, 2, 0, -1, 3, 1, 2], jnp.int32)
    got = np.asarray(lk.lora_update(y, x, a, b, index, widths=widths, interpret=not ON_GPU))
    want = np.asarray(lk.lora_update_reference(y, x, a, b, index))
    np.testing.assert_array_equal(got[1:], np.asarray(y)[1:])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    moved = np.abs(got[0] - np.asarray(y)[0]).max(axis=1)
    assert (moved[np.asarray(index) >= 0] > 0.01).all() and (moved[[0, 4]] == 0).all()


def test_slots_no_row_names_are_never_read():
    """A slot no row uses may hold anything (here NaN) where the tiles skip such slots (a step
    of fewer rows than slots)."""
    rng = np.random.default_rng(3)
    a, b = _group(rng, 256, 4, 16, (64, 32, 32))
    a, b = a.at[:, 1].set(jnp.nan), b.at[1].set(jnp.nan)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    y = jnp.zeros((8, 128), jnp.bfloat16)
    index = jnp.asarray([0, 2, -1, 3, 0, 0, 2, -1], jnp.int32)
    assert lk.choose_tiles(8, 16, 256, (64, 32, 32), 8).skip
    tiles = dataclasses.replace(lk.choose_tiles(8, 16, 256, (64, 32, 32), 4), skip=True)
    got = lk.lora_update(y, x, a, b, index, widths=(64, 32, 32), tiles=tiles,
                         interpret=not ON_GPU)
    assert np.isfinite(np.asarray(got.astype(jnp.float32))).all()
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)),
                               np.asarray(lk.lora_update_reference(
                                   y, x, a.at[:, 1].set(0), b.at[1].set(0), index
                               ).astype(jnp.float32)), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("skip", [True, False])
def test_y_comes_back_as_it_is_when_no_row_names_an_adapter(skip):
    """A step of base-model rows only (a LoRA engine's common case): the kernels write
    nothing and y (aliased to the output) comes back bit for bit, also where every slot
    holds NaN."""
    rng = np.random.default_rng(4)
    widths, din = (64, 32, 32), 256
    a, b = (jnp.full_like(v, jnp.nan) for v in _group(rng, din, 4, 16, widths))
    x = jnp.asarray(rng.standard_normal((8, din)), jnp.bfloat16)
    tiles = dataclasses.replace(lk.choose_tiles(8, 16, din, widths, 4), skip=skip)
    for y in (jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16),
              jnp.asarray(rng.standard_normal((3, 8, 128)), jnp.float32)):
        got = lk.lora_update(y, x, a, b, jnp.full((8,), -1, jnp.int32), widths=widths,
                             tiles=tiles, interpret=not ON_GPU)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(y))


@pytest.mark.parametrize("rows", [1, 8])
def test_the_kernels_lower_to_triton_for_the_gpu(rows):
    """The GPU's kernels (not interpreted) lower to Triton for CUDA from any machine: Pallas'
    Triton lowering refuses some indexing (checked here without a GPU); the GPU compiles the
    rest. Llama-3-8B's q/k/v, into y and into the fused front's split-K partial products."""
    from jax import export

    widths, din, n, r = (4096, 1024, 1024), 4096, 8, 16
    bf16 = jnp.bfloat16
    args = [jax.ShapeDtypeStruct((rows, din), bf16), jax.ShapeDtypeStruct((din, n, 3 * r), bf16),
            jax.ShapeDtypeStruct((n, 3 * r, sum(widths)), bf16),
            jax.ShapeDtypeStruct((rows,), jnp.int32)]
    for y in (jax.ShapeDtypeStruct((rows, sum(widths)), bf16),
              jax.ShapeDtypeStruct((4, rows, sum(widths)), jnp.float32)):
        exported = export.export(
            jax.jit(functools.partial(lk.lora_update, widths=widths, interpret=False)),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(y, *args)
        assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2   # shrink, expand


@pytest.mark.parametrize("rows,rank,din,widths,ok", [
    (8, 16, 4096, (4096, 1024, 1024), True),
    (12, 16, 4096, (4096,), False),       # rows not a power of two
    (8, 8, 4096, (4096,), False),         # rank under 16: no tensor-core dot
    (8, 24, 4096, (4096,), False),        # rank not a power of two
    (8, 16, 4104, (4096,), False),        # input not a multiple of 16 (bk 8)
    (8, 16, 4096, (4096, 8), False),      # a module narrower than a block
])
def test_shapes_the_kernels_take(rows, rank, din, widths, ok):
    assert lk.supported(rows, rank, din, widths) is ok


def test_a_shape_the_kernels_do_not_take_is_refused_naming_it():
    a, b = _group(np.random.default_rng(0), 64, 2, 8, (32,), jnp.float32)
    with pytest.raises(ValueError, match="rank 8"):
        lk.lora_update(jnp.zeros((4, 32)), jnp.zeros((4, 64)), a, b, jnp.zeros(4, jnp.int32),
                       widths=(32,), interpret=True)


def test_the_model_s_update_takes_the_kernels_where_routed_and_matches_xla_s_form():
    from jaxinfer import lora_layers
    from jaxinfer.routes import Routes

    rng = np.random.default_rng(5)
    a, b = _group(rng, 128, 4, 16, (64, 32, 32), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    lora = lora_layers.StepLoRA({"qkv": (a, b)}, jnp.asarray([0, 1, -1, 3, 3, 2, 0, -1],
                                                             jnp.int32))
    routes = Routes(attention="pallas", interpret=not ON_GPU, lora_kernel=True)

    def run(r):
        return jax.jit(lambda y, x: lora_layers.add_update(y, x, lora, "qkv", (64, 32, 32), r))

    kernel, xla = run(routes), run(routes.replace(lora_kernel=False))
    assert "jaxinfer_lora_expand" in str(jax.make_jaxpr(kernel)(y, x))
    assert "pallas_call" not in str(jax.make_jaxpr(xla)(y, x))
    tol = 2e-3 if ON_GPU else 1e-5     # f32 products in TF32 on the GPU
    np.testing.assert_allclose(np.asarray(kernel(y, x)), np.asarray(xla(y, x)), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("rows,din,widths,routed", [
    (8, 4096, (4096, 1024, 1024), True),      # Llama-3-8B's q, k, v at batch 1-8
    (8, 4096, (14336, 14336), True),          # gate, up
    (8, 14336, (4096,), False),               # down: XLA's split-K GEMM is faster
    (64, 4096, (4096,), False),               # batch 64: XLA's GEMMs are faster
])
def test_the_kernels_are_routed_only_where_they_measured_faster(rows, din, widths, routed):
    assert lk.faster(rows, 16, din, widths, 8) is routed
