"""Weights read from disk only where a device needs them.

A tensor-parallel model spread over several processes (jax.distributed) must not read the
whole model in every process: each reads the slices its own devices hold. The loaders give
`Lazy` tensors instead of arrays (checkpoints.hf_loader with lazy=True); fusing q/k/v and
gate/up (model_state.fused_tree) and splitting layers (model_state.per_layer) stay lazy;
model_state.build_model hands each to jax.make_array_from_callback, which asks for the slice
of each of this process's devices, and only those slices are read.

What needs a whole weight reads it whole: quantizing float weights to FP8 at load, and the
int8 LM head computed from the embedding.

`bytes_read()` counts the bytes read from files in this process (tests check that each
process of a job reads its share).
"""
from __future__ import annotations

import threading

import numpy as np

_lock = threading.Lock()
_bytes = [0]


def bytes_read() -> int:
    """Bytes this process has read from weight files through Lazy tensors."""
    return _bytes[0]


def _count(n: int) -> None:
    with _lock:
        _bytes[0] += int(n)


def _norm(index, shape) -> tuple[slice, ...]:
    """`index` (None, or a tuple of slices, shorter than `shape` or not) as one slice of
    step 1 per axis."""
    index = tuple(index or ())
    index += (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"lazy weights are read by contiguous slices, got step {step}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


class Lazy:
    """A weight not read yet: its shape and dtype, and `read(index)` of any slice."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def read(self, index=None) -> np.ndarray:
        """The slice `index` (a tuple of slices) as a numpy array of `dtype`."""
        return self._read(_norm(index, self.shape))

    def _read(self, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError

    def layer(self, i: int) -> "Lazy":
        """The view of index i along the first axis (a stacked weight's layer i)."""
        return _Layer(self, i)

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return self.layer(int(i))
        return self.read(i if isinstance(i, tuple) else (i,))

    def __len__(self) -> int:
        return self.shape[0]

    def __iter__(self):
        return (self.layer(i) for i in range(self.shape[0]))

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={np.dtype(self.dtype).name})"


class FileTensor(Lazy):
    """One tensor of a safetensors file, converted to `dtype`; transpose: the file holds
    it [out, in] and it is wanted [in, out] (a 2-D linear)."""

    def __init__(self, path, name: str, file_shape, dtype, transpose: bool = False):
        self.path, self.name, self.transpose = str(path), name, transpose
        self.file_shape = tuple(file_shape)
        self.shape = self.file_shape[::-1] if transpose else self.file_shape
        self.dtype = np.dtype(dtype)

    def _read(self, index):
        from safetensors import safe_open

        with safe_open(self.path, framework="numpy") as f:
            part = f.get_slice(self.name)[index[::-1] if self.transpose else index]
        _count(part.nbytes)
        if self.transpose:
            part = part.T
        return np.ascontiguousarray(part, self.dtype)


class Stacked(Lazy):
    """Equal-shaped tensors stacked along a new first axis (per-layer weights)."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)
        self.dtype = self.parts[0].dtype

    def layer(self, i: int) -> Lazy:
        return self.parts[i]

    def _read(self, index):
        rows = range(index[0].start, index[0].stop)
        if not rows:
            return np.zeros((0, *(s.stop - s.start for s in index[1:])), self.dtype)
        return np.stack([self.parts[i].read(index[1:]) for i in rows])


class ShardMajor(Lazy):
    """model_state._shard_major of `parts` along `axis` over `shards`: shard s of the
    result holds slice s of every part, in order."""

    def __init__(self, parts, axis: int, shards: int):
        self.parts, self.shards = list(parts), shards
        first = self.parts[0]
        self.axis = axis % first.ndim
        self.shape = list(first.shape)
        self.shape[self.axis] = sum(p.shape[self.axis] for p in self.parts)
        self.shape = tuple(self.shape)
        self.dtype = first.dtype
        # (part, start in it, length) in the order they are laid along the axis
        self.pieces = []
        for s in range(shards):
            for j, p in enumerate(self.parts):
                n = p.shape[self.axis] // shards
                self.pieces.append((j, s * n, n))

    def layer(self, i: int) -> Lazy:
        if self.axis == 0:
            return super().layer(i)
        return ShardMajor([p.layer(i) for p in self.parts], self.axis - 1, self.shards)

    def _read(self, index):
        lo, hi = index[self.axis].start, index[self.axis].stop
        out, at = [], 0
        for j, start, n in self.pieces:
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                sub = list(index)
                sub[self.axis] = slice(start + a - at, start + b - at)
                out.append(self.parts[j].read(tuple(sub)))
            at += n
        if not out:
            shape = [s.stop - s.start for s in index]
            return np.zeros(shape, self.dtype)
        return np.concatenate(out, axis=self.axis)


class _Layer(Lazy):
    """Index i along the first axis of `base`."""

    def __init__(self, base: Lazy, i: int):
        self.base, self.i = base, i
        self.shape, self.dtype = base.shape[1:], base.dtype

    def _read(self, index):
        return self.base.read((slice(self.i, self.i + 1), *index))[0]


def device_array(value: Lazy, shape, dtype, sharding):
    """A jax.Array of `sharding` whose addressable shards are read from `value` (each
    distinct slice once)."""
    import jax

    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"shape {tuple(value.shape)} is not {tuple(shape)}")
    done: dict = {}

    def shard(index):
        key = tuple((s.start, s.stop, s.step) for s in _norm(index, value.shape))
        if key not in done:
            done[key] = np.asarray(value.read(index), dtype)
        return done[key]
    return jax.make_array_from_callback(tuple(shape), sharding, shard)
