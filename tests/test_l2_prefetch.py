"""The L2 prefetch kernel (pallas_kernels/l2_prefetch.py): on the CPU its Triton lowering for
CUDA (the private lowering API it uses, and the PTX it emits) and the plan; the gpu-marked
cases run it compiled and check that it changes nothing but timing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import ops
from pallas_kernels import l2_prefetch as lp

ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.parametrize("shape,dtype,chunk", [((4096, 6144), jnp.float8_e4m3fn, 4096),
                                               ((64, 96), jnp.float32, 4096),
                                               ((3, 40), jnp.bfloat16, 16)])
def test_chunk_view(shape, dtype, chunk):
    w = jnp.zeros(shape, dtype)
    view, rows, got = lp.chunk_view(w, 10_000)
    assert got == chunk
    assert view.shape == (w.size * w.dtype.itemsize // chunk, chunk // w.dtype.itemsize)
    assert rows == min(view.shape[0], -(-10_000 // chunk))
    assert lp.chunk_view(w, 0)[1] == 0
    assert lp.chunk_view(w, 1 << 40)[1] == view.shape[0]


def test_chunk_view_rejects_sizes_the_instruction_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        lp.chunk_view(jnp.zeros((3, 5), jnp.bfloat16), 64)


def test_lowers_for_cuda_with_the_prefetch_instruction():
    """Lowered for CUDA on the CPU (what jax does before XLA compiles the Triton IR): each
    weight reaches the kernel as a free reshape, x is aliased, and the PTX is in the IR."""
    x = jnp.zeros((8, 256), jnp.bfloat16)
    w1 = jnp.zeros((256, 512), jnp.float8_e4m3fn)
    w2 = jnp.zeros((256, 1024), jnp.bfloat16)
    f = jax.jit(lambda x, a, b: lp.prefetch(x, [a, b], (1 << 16, 3000)))
    text = f.trace(x, w1, w2).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "cp.async.bulk.prefetch.L2.global [$1], 4096" in text
    assert "output_operand_aliases" in text


def test_nothing_to_prefetch_is_x_itself():
    x = jnp.ones((2, 4))
    assert lp.prefetch(x, [jnp.zeros((64, 64))], (0,)) is x
    assert ops.l2_prefetch(x, [(jnp.zeros((64, 64)), 4)]) is x     # off the GPU: a no-op


def test_env_setting_parses(monkeypatch):
    monkeypatch.setenv("JAXINFER_L2_PREFETCH", "16,32")
    assert ops._env_mb("JAXINFER_L2_PREFETCH", (0, 0)) == (16, 32)
    monkeypatch.setenv("JAXINFER_L2_PREFETCH", "16")
    with pytest.raises(ValueError, match="JAXINFER_L2_PREFETCH"):
        ops._env_mb("JAXINFER_L2_PREFETCH", (0, 0))
    monkeypatch.delenv("JAXINFER_L2_PREFETCH")
    assert ops._env_mb("JAXINFER_L2_PREFETCH", (0, 0)) == (0, 0)


@pytest.mark.gpu
def test_gpu_prefetch_returns_x_unchanged():
    assert ON_GPU
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 4096)), jnp.bfloat16)
    expect = np.asarray(x)
    w1 = jnp.asarray(rng.standard_normal((4096, 4096)), jnp.float8_e4m3fn)
    w2 = jnp.asarray(rng.standard_normal((4096, 3000)), jnp.bfloat16)
    f = jax.jit(lambda x, a, b: lp.prefetch(x, [a, b], (16 << 20, 5 << 20)))
    for _ in range(3):
        y = f(x, w1, w2)
        np.testing.assert_array_equal(np.asarray(y), expect)


@pytest.mark.gpu
def test_gpu_model_with_prefetch_equals_without(monkeypatch):
    """The tiny model, unrolled, a prefill and decode steps: the same logits with the
    attention-side prefetch on (every weight whole) as off."""
    from dense_reference import random_flat
    from jaxinfer.config import EngineConfig, standard_config
    from jaxinfer.kv_cache import single_sequence_metadata as single_sequence_md
    from jaxinfer.params import build_model
    from jaxinfer.runner import ModelRunner
    assert ON_GPU
    cfg = standard_config("tiny")
    flat = random_flat(cfg, seed=3)
    engine = EngineConfig(page_size=4, max_model_len=32, max_num_seqs=2,
                          attention_impl="pallas")
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 9).astype(np.int32)
    ids = [3, 1, 5, 2]

    def run(mb):
        monkeypatch.setattr(ops, "L2_PREFETCH_MB", mb)
        runner = ModelRunner(cfg, engine, *build_model(cfg, flat, jnp.float32,
                                                       unroll_layers=True))
        out = [runner.all_logits(prompt, single_sequence_md(range(9), ids, 4,
                                                             engine.pages_per_seq))]
        tok = int(np.argmax(out[-1][-1]))
        for pos in range(9, 13):
            out.append(runner.all_logits(np.asarray([tok], np.int32), single_sequence_md(
                [pos], ids, 4, engine.pages_per_seq)))
            tok = int(np.argmax(out[-1][-1]))
        return np.concatenate(out)

    np.testing.assert_array_equal(run((64, 64)), run((0, 0)))
