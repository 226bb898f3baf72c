"""Lazy weights (checkpoints/lazy.py): any slice of a safetensors tensor, of layers stacked
from several, and of a shard-major fusion reads what the eager arrays hold, and reads from
the file only the bytes of the slices asked for."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from checkpoints import lazy
from checkpoints.hf_loader import load_hf_dir
from checkpoints.lazy import FileTensor, ShardMajor, Stacked
from checkpoints.model_state import _shard_major, build_model
from checkpoints_util import tiny_hf_config, write_hf_dir


@pytest.fixture
def tensors(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal((12, 8)).astype(np.float32) for i in range(3)}
    path = tmp_path / "w.safetensors"
    save_file(arrays, str(path))
    return path, arrays


def test_a_slice_reads_only_its_bytes_and_a_transposed_tensor_its_transpose(tensors):
    path, arrays = tensors
    t = FileTensor(path, "w1", (12, 8), np.float32, transpose=True)
    assert t.shape == (8, 12)
    before = lazy.bytes_read()
    np.testing.assert_array_equal(t.read((slice(2, 5), slice(6, 12))), arrays["w1"].T[2:5, 6:])
    assert lazy.bytes_read() - before == 3 * 6 * 4
    np.testing.assert_array_equal(np.asarray(t), arrays["w1"].T)
    bf16 = FileTensor(path, "w0", (12, 8), ml_dtypes.bfloat16)
    assert bf16.read((slice(0, 1),)).dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_shard_major_slices_equal_the_eager_fusion(tensors, shards):
    path, arrays = tensors
    layers = [[FileTensor(path, n, (12, 8), np.float32) for _ in range(2)] for n in arrays]
    parts = [Stacked(p) for p in layers]                 # [2, 12, 8] each
    fused = ShardMajor(parts, axis=-1, shards=shards)
    want = _shard_major(np, [np.stack([a, a]) for a in arrays.values()], -1, shards)
    assert fused.shape == want.shape == (2, 12, 24)
    rng = np.random.default_rng(1)
    for _ in range(20):
        index = []
        for n in want.shape:
            lo = int(rng.integers(0, n))
            index.append(slice(lo, int(rng.integers(lo, n + 1))))
        np.testing.assert_array_equal(fused.read(tuple(index)), want[tuple(index)])
    np.testing.assert_array_equal(np.asarray(fused[1]), want[1])      # a layer's view
    np.testing.assert_array_equal(np.asarray(fused), want)


def test_a_lazy_hf_dir_builds_the_model_the_eager_one_does(tmp_path):
    write_hf_dir(tmp_path, tiny_hf_config(), np.random.default_rng(3), shards=2)
    cfg, eager = load_hf_dir(tmp_path)
    _, lazy_params = load_hf_dir(tmp_path, lazy=True)
    assert all(isinstance(v, lazy.Lazy) for v in lazy_params.values())
    for unroll in (False, True):
        a = build_model(cfg, dict(eager), jnp.float32, unroll_layers=unroll)[1]
        b = build_model(cfg, dict(lazy_params), jnp.float32, unroll_layers=unroll)[1]
        for x, y in zip(*(jax.tree.leaves(nnx.to_pure_dict(s)) for s in (a, b))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
