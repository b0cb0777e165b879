"""Triton kernels for int8 absmax block quantization (private; use the launchers in ``ops``),
and the one-pass casts around a 16-bit all-reduce (launchers in ``cast``).

Each program handles ``BLOCKS_PER_PROG`` quantization blocks of ``BLOCK`` elements as one 2-D
tile ``(BLOCKS_PER_PROG, BLOCK)``: many blocks per program keep enough bytes in flight to
reach the memory roofline (one block per program stays at 0.3-1.3 TB/s on an H200).

Exactness: the arithmetic mirrors ``reference.py`` one IEEE fp32 operation at a time.
Divisions use ``tl.div_rn`` (Triton's ``/`` is approximate on the GPU), launches pass
``enable_fp_fusion=False`` on the GPU (a fused multiply-add would round differently).
Round-half-to-even is libdevice ``rint`` on the GPU (fused into the float-to-int conversion)
and ``(q + 1.5 * 2**23) - 1.5 * 2**23`` in the interpreter (``rint`` does not run there);
both are exact for |q| <= 128. ``ON_GPU`` selects the GPU forms (also hardware bf16 casts).

Per-element work is kept small, since at ~4 TB/s a bf16 quantize has a budget of only ~30
instructions per element on an H200: absmax and the NaN/Inf test share one integer max over
the bit patterns of |v| (NaN and Inf patterns are above every finite one), nearest rounding
needs no clamp (``|v * fl(127 / absmax)| <= 127 (1 + 2**-24)**2`` rounds to at most 127), and
indices are 32-bit unless the launcher asks for 64-bit (``USE_INT64``, N_pad >= 2**31).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Globals read inside @triton.jit functions must be constexpr (and compare equal to
# themselves: Triton re-checks them at every launch, so no NaN constant here).
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
_INF_BITS = tl.constexpr(0x7F800000)  # bit pattern of +Inf; larger patterns are NaN
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _quantize_tile(
    v,
    seed,
    counters,
    TINY: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """Quantize fp32 tile ``v (R, BLOCK)`` -> (codes fp32 (R, BLOCK), scales fp32 (R,))."""
    abs_bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    max_bits = tl.max(abs_bits, axis=1)  # == bits of max |v|; >= _INF_BITS iff NaN/Inf
    absmax = max_bits.to(tl.float32, bitcast=True)
    finite = max_bits < _INF_BITS
    ok = (absmax >= TINY) & finite
    safe = tl.where(ok, absmax, 1.0)
    scale = tl.where(ok, tl.div_rn(safe, 127.0), 0.0)
    nan = tl.full(scale.shape, _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(finite, scale, nan)
    inv = tl.where(ok, tl.div_rn(tl.full(safe.shape, 127.0, tl.float32), safe), 0.0)
    q = v * inv[:, None]
    if STOCHASTIC:
        u = tl.rand(seed, counters)
        c = tl.floor(q + u)
        c = tl.minimum(tl.maximum(c, -127.0), 127.0)
    elif ON_GPU:
        c = libdevice.rint(q)
    else:
        c = (q + _RNE_MAGIC) - _RNE_MAGIC
    c = tl.where(ok[:, None], c, 0.0)  # NaN/Inf blocks: q may be NaN
    return c, scale


@triton.jit
def _quantize_kernel(
    x_ptr,
    r_ptr,
    codes_ptr,
    scales_ptr,
    n,
    block0,
    block_end,
    seed,
    offset,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROG: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    TINY: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """x (n,) float [+ residual (n,)] -> codes int8 (N_pad,), scales fp32 (N_pad / BLOCK,).

    This launch covers blocks [block0, block_end); elements at or past ``n`` read as zero.
    With HAS_RESIDUAL the residual is overwritten with ``v - codes * scale`` (first n only).
    """
    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    rows = block0 + pid * BLOCKS_PER_PROG + tl.arange(0, BLOCKS_PER_PROG)
    cols = tl.arange(0, BLOCK)
    idx = rows[:, None] * BLOCK + cols[None, :]
    in_mask = idx < n
    v = tl.load(x_ptr + idx, mask=in_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        v = v + tl.load(r_ptr + idx, mask=in_mask, other=0.0).to(tl.float32)
    c, scale = _quantize_tile(v, seed, offset + idx, TINY, STOCHASTIC, ON_GPU)
    row_ok = rows < block_end
    tl.store(codes_ptr + idx, c.to(tl.int8), mask=row_ok[:, None])
    tl.store(scales_ptr + rows, scale, mask=row_ok)
    if HAS_RESIDUAL:
        r_new = v - c * scale[:, None]
        tl.store(r_ptr + idx, _cast_out(r_new, r_ptr, ON_GPU), mask=in_mask)


@triton.jit
def _dequant_sum_requant_kernel(
    codes_ptr,
    scales_ptr,
    out_codes_ptr,
    out_scales_ptr,
    sum_ptr,
    nblocks,
    stride_cw,
    stride_sw,
    deq_ptr,
    deq_numel,
    factor,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROG: tl.constexpr,
    WRITE_SUM: tl.constexpr,
    WRITE_DEQ: tl.constexpr,
    APPLY_FACTOR: tl.constexpr,
    TINY: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """codes (W, M) int8 + scales (W, M/BLOCK) fp32 -> fp32 sum over W -> requantized (M,).

    WRITE_DEQ: also deq (deq_numel,) = (codes * scale) [* factor] of the requantized chunk,
    the arithmetic of ``_dequantize_kernel`` (the owner's chunk of the all-reduce result)."""
    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    rows = pid * BLOCKS_PER_PROG + tl.arange(0, BLOCKS_PER_PROG)
    cols = tl.arange(0, BLOCK)
    idx = rows[:, None] * BLOCK + cols[None, :]
    row_ok = rows < nblocks
    acc = tl.zeros((BLOCKS_PER_PROG, BLOCK), dtype=tl.float32)
    for _w in tl.static_range(W):
        c_w = tl.load(codes_ptr + idx, mask=row_ok[:, None], other=0)
        s_w = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
        acc = acc + c_w.to(tl.float32) * s_w[:, None]
        codes_ptr += stride_cw  # pointer increments: no 32-bit overflow of w * stride
        scales_ptr += stride_sw
    c, scale = _quantize_tile(acc, 0, idx, TINY, False, ON_GPU)
    tl.store(out_codes_ptr + idx, c.to(tl.int8), mask=row_ok[:, None])
    tl.store(out_scales_ptr + rows, scale, mask=row_ok)
    if WRITE_SUM:
        tl.store(sum_ptr + idx, acc, mask=row_ok[:, None])
    if WRITE_DEQ:
        y = c * scale[:, None]  # c holds the integral codes: the same product as int8 -> fp32
        if APPLY_FACTOR:
            y = y * factor
        tl.store(deq_ptr + idx, _cast_out(y, deq_ptr, ON_GPU), mask=idx < deq_numel)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    numel,
    block0,
    block_end,
    blocks_per_row,
    stride_cr,
    stride_sr,
    factor,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROG: tl.constexpr,
    APPLY_FACTOR: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """codes (R, M) int8 (row stride stride_cr) * scales (R, M/BLOCK) -> out (numel,) float.

    This launch covers output blocks [block0, block_end); outputs at or past numel are skipped.
    """
    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    blk = block0 + pid * BLOCKS_PER_PROG + tl.arange(0, BLOCKS_PER_PROG)
    cols = tl.arange(0, BLOCK)
    r = blk // blocks_per_row
    j = blk - r * blocks_per_row
    blk_ok = blk < block_end
    c = tl.load(
        codes_ptr + (r * stride_cr + j * BLOCK)[:, None] + cols[None, :],
        mask=blk_ok[:, None],
        other=0,
    )
    s = tl.load(scales_ptr + r * stride_sr + j, mask=blk_ok, other=0.0)
    y = c.to(tl.float32) * s[:, None]
    if APPLY_FACTOR:
        y = y * factor
    out_idx = blk[:, None] * BLOCK + cols[None, :]
    tl.store(out_ptr + out_idx, _cast_out(y, out_ptr, ON_GPU), mask=out_idx < numel)


@triton.jit
def _cast_out(y, dst_ptr, ON_GPU: tl.constexpr):
    """Cast fp32 ``y`` to ``dst_ptr``'s element type, rounding to nearest even.

    On the GPU the hardware conversion rounds to nearest even. The interpreter truncates to
    bf16, so there bf16 is rounded by hand (same result as torch's ``.to(torch.bfloat16)``;
    NaN becomes 0x7FC0).
    """
    if ON_GPU or dst_ptr.dtype.element_ty != tl.bfloat16:
        return y.to(dst_ptr.dtype.element_ty)
    else:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        half = tl.where(y != y, 0x7FC0, bits >> 16).to(tl.uint16)
        return half.to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_scale_kernel(
    x_ptr,
    y_ptr,
    n,
    tile0,
    factor,
    TILE: tl.constexpr,
    APPLY_FACTOR: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """x (n,) float -> y (n,) = round(round(x) * factor) in y's dtype; one tile per program."""
    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    idx = (tile0 + pid) * TILE + tl.arange(0, TILE)
    mask = idx < n
    v = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    y = _cast_out(v, y_ptr, ON_GPU)
    if APPLY_FACTOR:
        y = _cast_out(y.to(tl.float32) * factor, y_ptr, ON_GPU)
    tl.store(y_ptr + idx, y, mask=mask)


@triton.jit
def _copy_finite_kernel(
    src_ptr,
    dst_ptr,
    flag_ptr,
    n,
    tile0,
    TILE: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """src (n,) float -> dst (n,) in dst's dtype; flag (1,) int32 |= 1 if any |src| is NaN/Inf."""
    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    idx = (tile0 + pid) * TILE + tl.arange(0, TILE)
    mask = idx < n
    v = tl.load(src_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + idx, _cast_out(v, dst_ptr, ON_GPU), mask=mask)
    max_bits = tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)
    tl.atomic_or(flag_ptr, 1, mask=max_bits >= _INF_BITS)  # only a non-finite tile writes


@triton.jit
def _ef_add_cast_kernel(
    m_ptr,
    r_ptr,
    low_ptr,
    n,
    tile0,
    TILE: tl.constexpr,
    UPDATE: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """m (n,) += r (n,) in fp32, rounded to m's dtype (stored when UPDATE); low (n,) = that
    sum rounded to low's dtype."""
    pid = tl.program_id(0)
    if USE_INT64:
        pid = pid.to(tl.int64)
    idx = (tile0 + pid) * TILE + tl.arange(0, TILE)
    mask = idx < n
    m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = m + tl.load(r_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = _cast_out(m, m_ptr, ON_GPU)
    if UPDATE:
        tl.store(m_ptr + idx, m, mask=mask)
    tl.store(low_ptr + idx, _cast_out(m.to(tl.float32), low_ptr, ON_GPU), mask=mask)


@triton.jit
def _ef_apply_kernel(
    p_ptr,
    q_ptr,
    m_ptr,
    r_ptr,
    out_ptr,
    n,
    m,
    rank,
    HAS_RESIDUAL: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ON_GPU: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    """One (BLOCK_N, BLOCK_M) tile of ``A = P Q^T`` (P (n, rank), Q (m, rank), both bf16
    when BF16 else fp32; fp32 accumulation), then r = M - A (M (n, m) fp32, or m + r when
    ADD_RESIDUAL; rounded to r's dtype) and out = A in out's dtype. out may alias M: a program reads its tile of M
    before it writes that tile, and no other program touches it."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if USE_INT64:
        pid_n = pid_n.to(tl.int64)
        pid_m = pid_m.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < n
    m_ok = rm < m
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_R):
        rk = k0 + tl.arange(0, BLOCK_R)
        k_ok = rk < rank
        a = tl.load(p_ptr + rn[:, None] * rank + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(q_ptr + rm[None, :] * rank + rk[:, None], mask=k_ok[:, None] & m_ok[None, :],
                    other=0.0)  # fmt: skip
        if BF16 and ON_GPU:
            acc = tl.dot(a, b, acc)
        else:  # fp32 operands, or the interpreter (bf16 values held exactly in fp32)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    idx = rn[:, None] * m + rm[None, :]
    mask = n_ok[:, None] & m_ok[None, :]
    if HAS_RESIDUAL:
        mm = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if ADD_RESIDUAL:  # M = G + E (m's dtype is fp32: the sum of _ef_add_cast_kernel)
            mm = mm + tl.load(r_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptr + idx, _cast_out(mm - acc, r_ptr, ON_GPU), mask=mask)
    tl.store(out_ptr + idx, _cast_out(acc, out_ptr, ON_GPU), mask=mask)


def grid_1d(nblocks: int, blocks_per_prog: int) -> tuple[int]:
    """Number of programs for ``nblocks`` blocks at ``blocks_per_prog`` blocks each."""
    return (triton.cdiv(nblocks, blocks_per_prog),)


def split_launches(
    n: int, nblocks: int, block: int, blocks_per_prog: int
) -> list[tuple[int, int, int]]:
    """``(block0, block_end, n_bound)`` per launch, so that masks stay vectorizable.

    Element masks ``i < n`` only compile to 16-byte accesses when Triton sees ``n`` divisible
    by 16. For other ``n`` the whole tiles before the last partial one go in a first launch
    bounded by a multiple of the tile (vector accesses), the rest in a second launch.
    """
    if nblocks == 0:
        return []
    tile = block * blocks_per_prog
    main = min(n // tile * blocks_per_prog, nblocks)
    if n % 16 == 0 or main == 0:
        return [(0, nblocks, n)]
    out = [(0, main, main * block)]
    if main < nblocks:
        out.append((main, nblocks, n))
    return out
