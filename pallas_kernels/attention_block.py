"""The block step the paged-attention kernels share (decode: pallas_kernels/paged_attention.py,
ragged: pallas_kernels/ragged_paged_attention.py): one online-softmax step over `block_tokens`
KV rows gathered through the page table, the q preparation, the cache views and the checks.

Cache layout (pallas_kernels/kv_pages.py): k, v [L, K, P, S, D]; FP8 e4m3 KV carries f32
scales, k_scale/v_scale, either one per page slot and kv head, [L, K, P, S] (a token's K row is
q8 * scale, so a token is quantized alone when written), or static, one per layer and kv head,
[L, K]. The kernels view the cache as rows [L*K*P*S, D] (cache_views) and read the layer's
pages in place.

FP8 KV: only the FP8 bytes (and per-token scales) are read; K/V are widened in registers to
the dtype `blocks.fp8_compute` names (pallas_kernels/tuning.py). Per-token scales are applied
in f32 inside the block step (K's per logit column after the dot, V's per p column before
it); static ones once per program (static_factors: K's joins the logit scale, V's multiplies
the accumulator at the end), so the block step is the bf16 one plus the widening.
- "bfloat16": q and p * v_scale in bf16; per-token work (widening, softmax bookkeeping), not
  bytes, bounds it.
- "float16" (the decode choice at head dim 64): every e4m3 value (3 mantissa bits, 2^-9..448)
  is an f16 normal (10 bits, 2^-14..65504): widening is exact, and a cheap convert. Two
  normalizations keep f16's narrow range safe. q is divided by its row's max |q| before the
  cast (|q| <= 1, any magnitude works, nothing clipped); that max joins K's scale and the
  softmax scale on the f32 logits (K needs none: |q8| <= 448, f32 accumulate). p * v_scale is
  divided by the block's largest V scale and lifted by P_RANGE = 2^15 (<= 2^15 < 65504: no
  overflow); the block's p v is multiplied back by max_scale / 2^15 in f32. A term stays an
  f16 normal while p * v_scale / max_scale >= 2^-29: V magnitudes 1e6 apart in one block lose
  nothing (bare p * v_scale would go subnormal below 6e-5). q and p round to 2^-11..2^-12
  relative (bf16: 2^-8..2^-9), so this path is the more accurate, and faster than bf16
  widening (docs/performance.md).
- "f16pairs" (decode default for head dim 128; the same programs with q, the outputs and the
  accumulator in (even, odd) halves, see attend_block): the f16 numerics above, but K/V are
  read as u16 rows [L*K*P*S, D/2] (a bitcast of the pages), each element two e4m3 bytes (even
  and odd head dim). An e4m3 tile cannot be read from shared memory with ldmatrix (16-bit
  only), and where the dot wants it transposed (V's reduction dim is the token) Triton reads
  it byte by byte; as u16 the tiles load like bf16 ones, with fewer registers. One byte
  permute plus one cvt.rn.f16x2.e4m3x2 (inline PTX, two packed elements) splits a pair of u16
  into the even (odd) dims' f16. q is split the same way (qe = q[:, 0::2], qo = q[:, 1::2],
  read inside the kernel with stride-2 loads: load_q), logits = qe ke^T + qo ko^T, and the two
  output halves are interleaved back by stride-2 stores (store_rows). Faster than the f16
  widening at every measured shape (docs/performance.md). Interpret mode (no PTX) splits the
  pairs with a bitcast to bytes; the gpu-marked tests run the PTX.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import FP8_DTYPE
from pallas_kernels import tuning

M_INIT = -1e30  # finite, so an empty split combines to 0 instead of NaN
MIN_ROWS = 16   # tensor-core tiles need 16 rows
MIN_BLOCK_TOKENS = 16  # and 16 columns: Triton's dot with N = 8 returned doubled sums (H200)
P_RANGE = 2.0 ** 15   # f16 path: p * v_scale / max scale is lifted to <= 2^15 < f16's 65504


def compute_dtype(kv_dtype, fp8_compute: str = "bfloat16") -> jnp.dtype:
    """The dtype K/V are widened to for the two dots (e4m3 -> bf16 or f16 is exact)."""
    if kv_dtype == FP8_DTYPE:
        if fp8_compute not in tuning.FP8_COMPUTE:
            raise ValueError(f"fp8_compute {fp8_compute!r} is not one of {tuning.FP8_COMPUTE}")
        return jnp.dtype(jnp.float16 if fp8_compute == "f16pairs" else fp8_compute)
    return jnp.dtype(jnp.float32 if kv_dtype == jnp.float32 else jnp.bfloat16)


def uses_pairs(kv_dtype, fp8_compute: str, head_dim: int) -> bool:
    """Whether FP8 K/V are read as u16 byte pairs (fp8_compute f16pairs; module docstring)."""
    if kv_dtype != FP8_DTYPE or fp8_compute != "f16pairs":
        return False
    if head_dim % 2:
        raise ValueError(f"fp8_compute f16pairs needs an even head dim, got {head_dim}")
    return True


def prepare_q(q, cdt, qk_scale: float):
    """q [M, D] in the compute dtype, and the factor the f32 logits take: qk_scale, or for
    f16 each row's max |q| times qk_scale ([M, 1]), q being divided by that max first so
    any magnitude fits f16's range. For f16pairs q is a tuple (even dims, odd dims) [M, D/2]
    and so is the result."""
    parts = q if isinstance(q, tuple) else (q,)
    if cdt != jnp.float16:
        return (tuple(x.astype(cdt) for x in q) if isinstance(q, tuple)
                else q.astype(cdt)), qk_scale
    qf = [x.astype(jnp.float32) for x in parts]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.maximum(x, -x), axis=1) for x in qf])
    norm = jnp.where(amax > 0, amax, 1.0)
    out = tuple((x / norm[:, None]).astype(cdt) for x in qf)
    return (out if isinstance(q, tuple) else out[0]), (norm * qk_scale)[:, None]


def static_factors(ks_ref, vs_ref, static: bool, layer, kv_head, num_kv_heads: int):
    """-> (ks_ref, vs_ref, k factor, v factor) for a program of one kv head. Per-token scales
    (static False): the refs as they are, no factors. Static scales ([L*K] refs): the head's
    two scales read once, the refs None (attend_block then does no scale work); the caller
    multiplies its logit scale by the K factor and its accumulator by the V factor (scale_acc;
    p v is linear in V, and the split combine in the accumulators)."""
    if not static:
        return ks_ref, vs_ref, None, None
    i = layer * num_kv_heads + kv_head
    return None, None, ks_ref[i], vs_ref[i]


def scale_acc(acc, factor):
    """acc [M, D] (or the (even, odd) tuple of f16pairs) times factor (None: as it is)."""
    if factor is None:
        return acc
    return tuple(a * factor for a in acc) if isinstance(acc, tuple) else acc * factor


def kv_rows(layer, kv_head, pages, slots, num_kv_heads: int, num_pages: int, page_size: int):
    """Row indices into the cache viewed as [L*K*P*S, D] (an int32 suffices: 2**31 rows of
    D >= 64 would exceed any GPU's memory)."""
    return ((layer * num_kv_heads + kv_head) * num_pages + pages) * page_size + slots


def kernel_refs(refs, fp8: bool):
    """A kernel's refs after its metadata -> (q, k, v, k scale, v scale, the rest): FP8 KV
    brings two scale refs (else None)."""
    q_ref, k_ref, v_ref, rest = refs[0], refs[1], refs[2], refs[3:]
    ks_ref, vs_ref, rest = (rest[0], rest[1], rest[2:]) if fp8 else (None, None, rest)
    return q_ref, k_ref, v_ref, ks_ref, vs_ref, rest


def load_q(q_ref, idx, pairs: bool, head_dim: int):
    """q rows `idx` of q_ref [N, D]: [M, D], or with pairs the (even dims, odd dims) [M, D/2]
    each, read with stride-2 loads (split inside the kernel: split outside, XLA runs a
    fusion to write the halves and another to join the outputs back)."""
    if not pairs:
        return q_ref[idx]
    half = head_dim // 2
    return q_ref[idx, pl.ds(0, half, 2)], q_ref[idx, pl.ds(1, half, 2)]


def store_rows(o_ref, idx, acc, head_dim: int):
    """Write [M, D] (or the (even, odd) halves of pairs, interleaved back by stride-2
    stores) into rows `idx` of o_ref [N, D], cast to its dtype."""
    if not isinstance(acc, tuple):
        o_ref[idx] = acc.astype(o_ref.dtype)
        return
    half = head_dim // 2
    o_ref[idx, pl.ds(0, half, 2)] = acc[0].astype(o_ref.dtype)
    o_ref[idx, pl.ds(1, half, 2)] = acc[1].astype(o_ref.dtype)


def block_pages(table_ref, seq, first_token, page_off, pages_per_seq: int, page_size: int):
    """The page id of each token of the block starting at `first_token` of row `seq`
    (page_off [block_tokens] = arange // page_size); past the row's table: its last page."""
    idx = jnp.minimum(first_token // page_size + page_off, pages_per_seq - 1)
    return table_ref[seq * pages_per_seq + idx]


def paged_loop(read_pages, body, state, n_full, n_all, prefetch: bool, start=0):
    """Run body(i, pages, state, masked) -> state for blocks i in [start, n_full) unmasked,
    then [n_full, n_all) masked (start <= n_full <= n_all); read_pages(i) -> block i's page
    ids [block_tokens] (clamped by the caller). With `prefetch` block i + 1's ids are read
    before block i's math and carried, so the K/V copies' addresses never wait on a
    page-table load: Triton's pipeliner then double-buffers K/V at num_stages >= 3 (ttgir:
    2x tiles), where with the read inside the step it keeps one K/V buffer whatever
    num_stages is (tuning.py)."""
    if not prefetch:
        def step(i, st, masked):
            return body(i, read_pages(i), st, masked)
        st = lax.fori_loop(start, n_full, functools.partial(step, masked=False), state)
        return lax.fori_loop(n_full, n_all, functools.partial(step, masked=True), st)

    def step_ahead(i, carry, masked):
        st, pages = carry
        nxt = read_pages(i + 1)
        return body(i, pages, st, masked), nxt

    carry = lax.fori_loop(start, n_full, functools.partial(step_ahead, masked=False),
                          (state, read_pages(start)))
    return lax.fori_loop(n_full, n_all, functools.partial(step_ahead, masked=True), carry)[0]


def empty_carry(rows_q: int, d: int, pairs: bool = False):
    """The online-softmax state before the first block: (running max, sum, accumulator);
    with pairs the accumulator is (even dims, odd dims) [rows_q, d/2] each."""
    acc = ((jnp.zeros((rows_q, d // 2), jnp.float32),) * 2 if pairs
           else jnp.zeros((rows_q, d), jnp.float32))
    return (jnp.full((rows_q,), M_INIT, jnp.float32), jnp.zeros((rows_q,), jnp.float32), acc)


# Two u16 elements (four e4m3 bytes: even0, odd0, even1, odd1) per 32-bit register: one byte
# permute gathers the even (selector 0x0020) or odd (0x0031) bytes, one hardware convert
# widens them to f16x2. One asm per output: Pallas' lowering of a multi-result asm fails.
_PAIRS_ASM = """{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $1, 0, %s;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
}"""


def fp8_pairs_to_f16(x, interpret: bool):
    """u16 [..] holding two e4m3 bytes (the lower byte is the even head dim) -> f16 arrays
    (even, odd), exact. On the GPU, inline PTX (byte permute + cvt.f16x2.e4m3x2); in
    interpret mode, a bitcast to bytes."""
    if interpret:
        b = lax.bitcast_convert_type(x, FP8_DTYPE)
        return b[..., 0].astype(jnp.float16), b[..., 1].astype(jnp.float16)
    half = [jax.ShapeDtypeStruct(x.shape, jnp.float16)]
    return tuple(plgpu.elementwise_inline_asm(_PAIRS_ASM % sel, args=[x], constraints="=r,r",
                                              pack=2, result_shape_dtypes=half)[0]
                 for sel in ("0x0020", "0x0031"))


def _logits(q, k):
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def read_rows(ref, rows, valid=None, interpret: bool = False, cols=None):
    """ref's rows `rows` [N] ([N, D], or [N] of a 1-D ref; with `cols`, a slice of a 2-D
    ref's columns, those only). With `valid` [N], rows where it is False are not read (a
    masked load; interpret mode reads and zeroes them, its masked load taking no gathered
    rows) and come back as zeros."""
    idx = rows if cols is None else (rows, cols)
    if valid is None:
        return ref[idx]
    mask = valid if len(ref.shape) == 1 else valid[:, None]
    zero = jnp.zeros((), ref.dtype)
    if interpret:
        return jnp.where(mask, ref[idx], zero)
    return plgpu.load(ref.at[idx], mask=mask, other=zero)


def attend_block(q, k_ref, v_ref, ks_ref, vs_ref, rows, carry, *, logit_scale,
                 logit_mask=None, kv_valid=None, masked_loads: bool = False,
                 interpret: bool = False, q_halves: bool = False):
    """One online-softmax step over the KV rows `rows` [N]; q [M, D] in the compute dtype
    and logit_scale (scalar or [M, 1]) from prepare_q; carry (m, l, acc) with m, l [M] f32 in
    the base-2 domain and acc [M, D] f32. logit_mask [M|1, N] hides logits, kv_valid [N]
    zeroes V rows (and their scales) that may hold stale data; with masked_loads the rows
    it leaves out are not read at all (K's and V's, read_rows). With f16pairs, q and acc are
    (even, odd) tuples and k_ref/v_ref hold u16 byte pairs (cache_views). With q_halves, q
    is the (low, high) halves of the head dim [M, D/2] each (pallas_kernels/decode_qkv.py's
    rotated q) and K is read as two half-rows; acc stays [M, D]."""
    m, l, acc = carry
    pairs = isinstance(q, tuple) and not q_halves
    skip = kv_valid if masked_loads else None      # rows the loads themselves leave out

    def load(ref, cols=None):
        return read_rows(ref, rows, skip, interpret, cols)

    if pairs:   # V is read and split after the softmax: its f16 parts stay live less long
        k = fp8_pairs_to_f16(load(k_ref), interpret)
        logits = _logits(q[0], k[0]) + _logits(q[1], k[1])
    elif q_halves:
        half = q[0].shape[1]
        logits = (_logits(q[0], load(k_ref, pl.ds(0, half)).astype(q[0].dtype))
                  + _logits(q[1], load(k_ref, pl.ds(half, half)).astype(q[1].dtype)))
        v = load(v_ref).astype(q[0].dtype)
    else:
        k = load(k_ref).astype(q.dtype)
        v = load(v_ref).astype(q.dtype)
        logits = _logits(q, k)
    if ks_ref is not None:
        logits = logits * load(ks_ref)[None, :]
    logits = logits * logit_scale
    if logit_mask is not None:
        logits = jnp.where(logit_mask, logits, -jnp.inf)
    if pairs:
        v = load(v_ref)
    if kv_valid is not None and skip is None:
        v = jnp.where(kv_valid[:, None], v, jnp.zeros_like(v))
    if pairs:
        v = fp8_pairs_to_f16(v, interpret)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(logits - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    vs = None
    if vs_ref is not None:
        vs = load(vs_ref)
        if kv_valid is not None and skip is None:
            vs = jnp.where(kv_valid, vs, jnp.zeros_like(vs))
    pv = _weighted_values(p, v, vs)
    if isinstance(acc, tuple):
        return m_new, l, tuple(a * alpha[:, None] + x for a, x in zip(acc, pv))
    return m_new, l, acc * alpha[:, None] + pv


def _weighted_values(p, v, vs):
    """p [M, N] f32 times V [N, D] (compute dtype; a tuple of parts with f16pairs, giving a
    tuple) with V's per-token scales vs [N] (or None) -> [M, D] f32. In f16, p * vs is taken
    relative to the block's largest scale (see the module docstring) so it neither overflows
    nor underflows."""
    parts = v if isinstance(v, tuple) else (v,)
    cdt = parts[0].dtype
    back = None
    if vs is None:
        w = p.astype(cdt)
    elif cdt != jnp.float16:
        w = (p * vs[None, :]).astype(cdt)
    else:
        vmax = jnp.maximum(jnp.max(vs), 1e-30)  # a block of only masked rows has vs == 0
        w = (p * (vs * (P_RANGE / vmax))[None, :]).astype(cdt)
        back = vmax / P_RANGE
    out = tuple(jnp.dot(w, x, preferred_element_type=jnp.float32) for x in parts)
    if back is not None:
        out = tuple(x * back for x in out)
    return out if isinstance(v, tuple) else out[0]


def validate(q, k_pages, v_pages, k_scale, v_scale, interpret: bool, block_tokens: int):
    """Shape, dtype and block checks shared with the ragged kernel; returns (K, P, S, D)."""
    if q.ndim != 3 or k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"paged attention wants q [*, H, D] and k/v pages [L, K, P, S, D] "
                          f"of one shape; got {q.shape}, {k_pages.shape}, {v_pages.shape}")
    _, kv_heads, num_pages, page_size, head_dim = k_pages.shape
    if q.shape[1] % kv_heads or q.shape[2] != head_dim:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {kv_heads} "
                          f"and head dims must match ({q.shape[2]} vs {head_dim})")
    fp8 = k_pages.dtype == FP8_DTYPE
    if fp8 and (k_scale is None or v_scale is None or v_scale.shape != k_scale.shape
                or k_scale.shape not in (k_pages.shape[:-1], k_pages.shape[:2])):
        raise ValueError("FP8 KV pages need k_scale and v_scale of one shape: [L, K, P, S] "
                          "(per token) or [L, K] (static)")
    pow2 = all(x & (x - 1) == 0 for x in (page_size, head_dim))
    if not interpret and not pow2:
        raise ValueError(f"page size {page_size} and head dim {head_dim} must be powers of "
                          "two for the GPU kernel")
    if block_tokens % page_size or (block_tokens < MIN_BLOCK_TOKENS and not interpret):
        raise ValueError(f"block_tokens {block_tokens} must be a multiple of the page size "
                          f"{page_size} and >= {MIN_BLOCK_TOKENS} on the GPU")
    return kv_heads, num_pages, page_size, head_dim


def cache_views(k_pages, v_pages, k_scale, v_scale, pairs: bool = False):
    """Flatten the cache to rows ([L*K*P*S, D]; scales [L*K*P*S], static ones [L*K]): free
    reshapes in XLA.
    With pairs, FP8 K/V as u16 rows [L*K*P*S, D/2] of byte pairs (a bitcast)."""
    d = k_pages.shape[-1]
    if pairs:
        views = [lax.bitcast_convert_type(x.reshape(-1, d // 2, 2), jnp.uint16)
                 for x in (k_pages, v_pages)]
    else:
        views = [k_pages.reshape(-1, d), v_pages.reshape(-1, d)]
    if k_pages.dtype == FP8_DTYPE:
        views += [k_scale.reshape(-1).astype(jnp.float32),
                  v_scale.reshape(-1).astype(jnp.float32)]
    return views
