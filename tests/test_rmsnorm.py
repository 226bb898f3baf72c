"""The residual add + RMSNorm kernel (pallas_kernels/rmsnorm.py) against its reference (the
decoder's jnp route): interpret mode on the CPU, compiled on the GPU (gpu-marked)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import ops
from jaxinfer.model import RMSNorm
from pallas_kernels import rmsnorm

ON_GPU = jax.default_backend() == "gpu"


def _inputs(rng, m, e, dtype):
    x = jnp.asarray(rng.standard_normal((m, e)) * rng.uniform(0.01, 50, (m, 1)), dtype)
    d = jnp.asarray(rng.standard_normal((m, e)), dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, e), dtype)
    return x, d, w


def _check(got, want, dtype):
    tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5     # one bf16 rounding of n
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=tol, atol=1e-6)


@pytest.mark.parametrize("m,e,dtype", [(1, 576, jnp.bfloat16), (8, 4096, jnp.bfloat16),
                                       (5, 256, jnp.float32), (3, 5120, jnp.bfloat16)])
@pytest.mark.parametrize("add", [True, False])
def test_kernel_matches_reference(m, e, dtype, add):
    rng = np.random.default_rng(m * 10000 + e + add)
    x, d, w = _inputs(rng, m, e, dtype)
    delta = d if add else None
    want = rmsnorm.add_rmsnorm_reference(x, w, delta, eps=1e-5)
    got = rmsnorm.add_rmsnorm(x, w, delta, eps=1e-5, interpret=not ON_GPU)
    _check(got, want, dtype)
    if add:   # the sum is x + delta rounded once, exactly as XLA's add
        np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                      np.asarray(x + d, np.float32))
    else:     # x comes back as it went in
        np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(x, np.float32))


def test_reference_is_the_models_norm():
    rng = np.random.default_rng(2)
    x, d, w = _inputs(rng, 4, 64, jnp.float32)
    norm = RMSNorm(64, 1e-6)
    norm.weight[...] = w
    got_x, got_n = norm.add_norm(x, d)       # the ops route (reference off the GPU)
    np.testing.assert_array_equal(np.asarray(got_x), np.asarray(x + d))
    np.testing.assert_allclose(np.asarray(got_n), np.asarray(norm(x + d)), rtol=1e-6)


def test_unsupported_width_and_errors():
    rng = np.random.default_rng(3)
    x, d, w = _inputs(rng, 2, 40, jnp.float32)           # no power-of-two chunk >= 16
    assert not rmsnorm.supported(40)
    _check(rmsnorm.add_rmsnorm(x, w, d, eps=1e-6, interpret=True),
           rmsnorm.add_rmsnorm_reference(x, w, d, eps=1e-6), jnp.float32)
    with pytest.raises(ValueError, match="add_rmsnorm"):
        rmsnorm.add_rmsnorm(x, w[:8], d, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="add_rmsnorm"):
        rmsnorm.add_rmsnorm(x, w, d.astype(jnp.bfloat16), eps=1e-6, interpret=True)


def test_ops_switch_off_is_the_reference(monkeypatch):
    rng = np.random.default_rng(4)
    x, d, w = _inputs(rng, 2, 128, jnp.bfloat16)
    monkeypatch.setattr(ops, "FUSED_GLUE", False)
    got = ops.add_rmsnorm(x, d, w, eps=1e-5)
    want = rmsnorm.add_rmsnorm_reference(x, w, d, eps=1e-5)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_ops_uses_the_kernel_only_when_switched_on(monkeypatch):
    """On the GPU ops.add_rmsnorm is XLA's fusion of the reference by default (measured
    faster, ops.PALLAS_ADD_NORM) and the kernel with the switch on."""
    rng = np.random.default_rng(6)
    x, d, w = _inputs(rng, 2, 128, jnp.bfloat16)
    calls = []

    def kernel(*args, **kw):
        calls.append(1)
        return rmsnorm.add_rmsnorm_reference(*args, **kw)
    monkeypatch.setattr(ops, "_on_gpu", lambda: True)
    monkeypatch.setattr(rmsnorm, "add_rmsnorm", kernel)
    ops.add_rmsnorm(x, d, w, eps=1e-5)
    assert calls == []
    monkeypatch.setattr(ops, "PALLAS_ADD_NORM", True)
    ops.add_rmsnorm(x, d, w, eps=1e-5)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 256])
def test_gpu_8b_shape(m):
    """Compiled on the H200 at Llama-3-8B's width: the kernel (not the fallback) runs and
    matches the reference."""
    rng = np.random.default_rng(m)
    x, d, w = _inputs(rng, m, 4096, jnp.bfloat16)
    fn = jax.jit(lambda x, d: rmsnorm.add_rmsnorm(x, w, d, eps=1e-5))
    assert "add_rmsnorm" in fn.lower(x, d).as_text()
    _check(fn(x, d), rmsnorm.add_rmsnorm_reference(x, w, d, eps=1e-5), jnp.bfloat16)
