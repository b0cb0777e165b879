"""Public launchers: validate, allocate outputs, dispatch CUDA -> Triton, CPU -> torch reference.

Every launcher takes ``backend="auto" | "triton" | "torch"``: ``auto`` runs Triton on CUDA
tensors and the reference on CPU tensors; ``triton`` forces the Triton kernel (on CPU tensors
this needs ``TRITON_INTERPRET=1`` set before this package is imported: that is how the tests
run the kernels on CPU); ``torch`` forces the reference (the eager-torch baseline on GPU).
``launch=(tile_elements, num_warps)`` overrides the launch configuration (benchmark sweeps).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from . import reference as ref
from ._common import (
    TINY,
    check_block,
    check_codes_scales,
    check_float_input,
    check_out_codes_scales,
    empty_codes_scales,
    resolve_pad,
)

# (elements per program, warps) per kernel; 32 blocks of 128 per program reach ~4.2 TB/s
# on an H200 (benchmarks/results/quant_kernels.md: quantize 8192/8 at 4176 GB/s).
DEFAULT_LAUNCH: dict[str, tuple[int, int]] = {
    "quantize": (8192, 8),  # 32 elements per thread amortize the per-block divisions
    "quantize_ef": (4096, 8),
    "dequant_sum_requant": (4096, 8),
    "dequantize": (4096, 8),
}
_BACKENDS = ("auto", "triton", "torch")
_INT32_LIMIT = 2**31 - 2**20  # element offsets at or above this need 64-bit indexing
_FORCE_INT64 = False  # tests flip this to run the 64-bit indexing path on small tensors


def _use_triton(t: torch.Tensor, backend: str) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if t.is_cuda:
        return True
    if backend == "auto":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
            "verl_comm.kernels is imported (or pass CUDA tensors)"
        )
    return True


def _launch(kernel: str, block: int, launch: tuple[int, int] | None) -> tuple[int, int]:
    tile, warps = launch if launch is not None else DEFAULT_LAUNCH[kernel]
    if tile % block or tile < block or (tile // block) & (tile // block - 1):
        raise ValueError(f"launch tile={tile} must be block ({block}) times a power of two")
    return tile // block, warps


@contextlib.contextmanager
def _on_device(t: torch.Tensor) -> Iterator[dict]:
    """Make ``t``'s GPU current; yield extra launch kwargs (exact fp32: no FMA contraction)."""
    if t.is_cuda:
        with torch.cuda.device(t.device):
            yield {"enable_fp_fusion": False}
    else:
        yield {}


def quantize(
    x: torch.Tensor,
    block: int = 128,
    *,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax int8 block quantization of a flat tensor.

    Args:
        x: contiguous fp32/bf16/fp16 tensor, N elements (any shape; read flattened).
            Non-contiguous inputs are rejected (ValueError), never silently copied.
        block: B in {32, 64, 128, 256}.
        stochastic: ``code = floor(q + u)`` with ``u = tl.rand(seed, offset + i)`` (unbiased;
            CPU reference reproduces the GPU draws bit for bit) instead of round-half-even.
        seed, offset: Philox seed in [0, 2**63) and counter offset (advance it by N_pad per call).
        pad_to: N_pad (>= N, multiple of B), e.g. ``padded_numel(N, B, multiple=W)``.
        out: optional destination ``(codes, scales)``: int8 ``(N_pad,)`` and fp32
            ``(N_pad // B,)``, or ``(R, N_pad / R)`` and ``(R, N_pad / R / B)`` with strided
            rows (e.g. ``unpack`` of a ``(W, L)`` packed send buffer: row r gets elements
            ``[r M, (r + 1) M)``), written in place with the same bits as the returned
            tensors of a call without ``out`` (Triton: one launch per row; reference: chunk
            by chunk), no copy.
        backend, launch: see the module docstring.

    Returns:
        codes int8 ``(N_pad,)`` and scales fp32 ``(N_pad // B,)`` with ``scale = absmax / 127``
        (``out`` itself when given).
        Per-element error ``|x - code * scale| <= scale / 2`` (nearest; up to fp32 rounding),
        ``< scale`` (stochastic). All-zero block: scale 0, codes 0. Block with NaN/Inf:
        scale NaN, codes 0 (detect with ``torch.isfinite(scales)``); no error is raised.

    Raises:
        TypeError / ValueError: dtype, contiguity, block, pad_to, seed/offset, backend, out
            (see :func:`~verl_comm.kernels._common.check_out_codes_scales`).
    """
    check_float_input("x", x)
    check_block(block)
    out = _check_out(x, block, pad_to, out)
    if not _use_triton(x, backend):
        return ref.quantize_ref(
            x, block, stochastic=stochastic, seed=seed, offset=offset, pad_to=pad_to, out=out
        )
    ref._check_seed(seed, offset)
    codes, scales = empty_codes_scales(x, block, pad_to) if out is None else out
    _quantize_rows(x, None, codes, scales, block, stochastic, seed, offset, launch)
    return codes, scales


def quantize_ef(
    x: torch.Tensor,
    residual: torch.Tensor,
    block: int = 128,
    *,
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str = "auto",
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x + residual`` with fused error feedback, in one pass over memory.

    Args:
        x: contiguous fp32/bf16/fp16 tensor of N elements.
        residual: contiguous N elements, dtype ``x.dtype`` or fp32; UPDATED IN PLACE to
            ``(x + residual) - code * scale`` (fp32 arithmetic, then cast to its dtype).
        block, pad_to, out, backend, launch: as :func:`quantize` (nearest rounding).

    Returns:
        codes int8 ``(N_pad,)``, scales fp32 ``(N_pad // B,)`` of ``v = x + residual``
        (``out`` itself when given);
        ``v == dequantize(codes, scales)[:N] + residual_new`` up to fp32 rounding. A block with
        NaN/Inf gets scale NaN and a NaN residual (reset it before the next step).

    Raises:
        TypeError / ValueError: as :func:`quantize`, or a residual of wrong dtype/size/device.
    """
    check_float_input("x", x)
    ref.check_residual(x, residual)
    check_block(block)
    out = _check_out(x, block, pad_to, out)
    if not _use_triton(x, backend):
        return ref.quantize_ef_ref(x, residual, block, pad_to=pad_to, out=out)
    codes, scales = empty_codes_scales(x, block, pad_to) if out is None else out
    _quantize_rows(x, residual, codes, scales, block, False, 0, 0, launch)
    return codes, scales


def _check_out(x, block, pad_to, out):
    if out is None:
        return None
    return check_out_codes_scales(out, resolve_pad(x.numel(), block, pad_to), block, x.device)


def _quantize_rows(x, residual, codes, scales, block, stochastic, seed, offset, launch) -> None:
    """Quantize into 1-D ``codes``/``scales``, or row by row into ``(R, M)`` views (one
    launch per row, each writing its row in place; row r covers elements ``[r M, (r+1) M)``
    of the padded input, its Philox counters start at ``offset + r M``)."""
    if codes.dim() == 1:
        _quantize_launch(x, residual, codes, scales, block, stochastic, seed, offset, launch)
        return
    flat = x.view(-1)
    res = None if residual is None else residual.view(-1)
    n, m = flat.numel(), codes.shape[1]
    for r in range(codes.shape[0]):
        lo = r * m
        end = max(min(lo + m, n), lo)
        if end == lo:  # all padding: any valid pointer, no element is read
            xr, rr = flat[:0], None if res is None else res[:0]
        else:
            xr, rr = flat[lo:end], None if res is None else res[lo:end]
        _quantize_launch(xr, rr, codes[r], scales[r], block, stochastic, seed, offset + lo, launch)


def _quantize_launch(x, residual, codes, scales, block, stochastic, seed, offset, launch) -> None:
    from .triton_kernels import _quantize_kernel, grid_1d, split_launches

    nblocks = scales.numel()
    if nblocks == 0:
        return
    bpp, warps = _launch("quantize" if residual is None else "quantize_ef", block, launch)
    with _on_device(x) as extra:
        for block0, block_end, n_bound in split_launches(x.numel(), nblocks, block, bpp):
            _quantize_kernel[grid_1d(block_end - block0, bpp)](
                x,
                residual if residual is not None else x,
                codes,
                scales,
                n_bound,
                block0,
                block_end,
                seed,
                offset,
                BLOCK=block,
                BLOCKS_PER_PROG=bpp,
                HAS_RESIDUAL=residual is not None,
                STOCHASTIC=stochastic,
                TINY=TINY,
                ON_GPU=x.is_cuda,
                USE_INT64=_FORCE_INT64 or codes.numel() >= _INT32_LIMIT,
                num_warps=warps,
                **extra,
            )


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 128,
    *,
    out_dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``(codes * scales) * scale`` in fp32, written in the output dtype.

    Args:
        codes: int8 ``(M,)`` or ``(R, M)`` (rows may be strided views from ``unpack``; the last
            dimension must have stride 1), M a multiple of B.
        scales: fp32 ``(M // B,)`` or ``(R, M // B)``.
        block: B.
        out_dtype: fp32/bf16/fp16 (round-to-nearest-even cast); ignored when ``out`` is given.
        scale: factor applied after dequantization, e.g. ``1 / W`` to average.
        numel: number of leading values to keep (drops padding); default ``R * M``.
        out: optional contiguous ``(numel,)`` float tensor written in place (e.g. a bucket).
        backend, launch: see the module docstring.

    Returns:
        ``(numel,)`` tensor, row-major over ``(R, M)`` (``out`` when given).

    Raises:
        TypeError / ValueError: dtypes, shapes, strides, devices, numel, out.
    """
    rows, m = check_codes_scales(codes, scales, block, batched=None)
    numel, out = ref.resolve_dequant_out(codes, rows, m, out_dtype, numel, out)
    if not _use_triton(codes, backend):
        return ref.dequantize_ref(codes, scales, block, scale=scale, numel=numel, out=out)
    if numel == 0:
        return out
    from .triton_kernels import _dequantize_kernel, grid_1d, split_launches

    bpp, warps = _launch("dequantize", block, launch)
    nblocks = -(-numel // block)
    c2 = codes.view(rows, m)
    s2 = scales.view(rows, m // block)
    with _on_device(codes) as extra:
        for block0, block_end, n_bound in split_launches(numel, nblocks, block, bpp):
            _dequantize_kernel[grid_1d(block_end - block0, bpp)](
                c2,
                s2,
                out,
                n_bound,
                block0,
                block_end,
                m // block,
                c2.stride(0),
                s2.stride(0),
                float(scale),
                BLOCK=block,
                BLOCKS_PER_PROG=bpp,
                APPLY_FACTOR=float(scale) != 1.0,
                ON_GPU=codes.is_cuda,
                USE_INT64=_FORCE_INT64 or max(numel, rows * c2.stride(0)) >= _INT32_LIMIT,
                num_warps=warps,
                **extra,
            )
    return out


def dequant_sum_requant(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 128,
    *,
    return_sum: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    dequant_out: torch.Tensor | None = None,
    dequant_scale: float = 1.0,
    backend: str = "auto",
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Owner step of a quantized reduce-scatter: dequantize W chunks, sum in fp32, requantize.

    With ``dequant_out`` the same pass also writes what :func:`dequantize` of the
    requantized codes and scales with ``scale=dequant_scale`` gives, the same bits, for the
    first ``dequant_out.numel()`` elements of the chunk: the owner's part of an all-reduce
    result without reading its codes back (issue 28: at W = 1 the whole result).

    Args:
        codes: int8 ``(W, M)`` (rows may be strided views from ``unpack``; last dim stride 1).
        scales: fp32 ``(W, M // B)``.
        block: B.
        return_sum: also return the fp32 sum ``(M,)`` (written by the same pass).
        out: optional destination ``(codes, scales)``: int8 ``(M,)`` and fp32 ``(M // B,)``,
            each with stride 1 (e.g. ``unpack`` of this rank's row of an all-gather buffer),
            written in place with the bits of a call without ``out`` (by the kernel or the
            reference's chunks, no copy). Must not overlap the inputs.
        backend, launch: see the module docstring.

    Returns:
        codes int8 ``(M,)`` and scales fp32 ``(M // B,)`` of ``sum_w codes[w] * scales[w]``
        (summed in order w = 0..W-1, nearest rounding, same rules as :func:`quantize`), plus
        the fp32 sum when ``return_sum``. A NaN/Inf input scale gives a NaN output scale.
        The codes and scales are ``out``'s tensors when given.

    Raises:
        TypeError / ValueError: dtypes, shapes, strides, devices; ``out`` not 1-D ``(M,)``
            and ``(M // B,)`` int8/fp32 with stride 1 on the inputs' device.
    """
    w_count, m = check_codes_scales(codes, scales, block, batched=True)
    if out is not None:
        out = check_out_codes_scales(out, m, block, codes.device)
        if out[0].dim() != 1:
            raise ValueError(f"out codes must be 1-D (M,) = ({m},), got {tuple(out[0].shape)}")
    if dequant_out is not None:
        if dequant_out.numel() > m:
            raise ValueError(f"dequant_out has {dequant_out.numel()} elements, the chunk {m}")
        check_float_input("dequant_out", dequant_out)
        if dequant_out.device != codes.device:
            raise ValueError("dequant_out must be on the codes' device")
    if not _use_triton(codes, backend):
        res = ref.dequant_sum_requant_ref(codes, scales, block, return_sum=return_sum, out=out)
        if dequant_out is not None and dequant_out.numel():
            ref.dequantize_ref(res[0], res[1], block, scale=dequant_scale,
                               numel=dequant_out.numel(), out=dequant_out.view(-1))  # fmt: skip
        return res
    dev = codes.device
    if out is None:
        out_codes = torch.empty(m, dtype=torch.int8, device=dev)
        out_scales = torch.empty(m // block, dtype=torch.float32, device=dev)
    else:
        out_codes, out_scales = out
    total = torch.empty(m if return_sum else 0, dtype=torch.float32, device=dev)
    nblocks = m // block
    if nblocks and w_count:
        from .triton_kernels import _dequant_sum_requant_kernel, grid_1d

        bpp, warps = _launch("dequant_sum_requant", block, launch)
        with _on_device(codes) as extra:
            _dequant_sum_requant_kernel[grid_1d(nblocks, bpp)](
                codes,
                scales,
                out_codes,
                out_scales,
                total if return_sum else out_scales,
                nblocks,
                codes.stride(0),
                scales.stride(0),
                out_scales if dequant_out is None else dequant_out,
                0 if dequant_out is None else dequant_out.numel(),
                float(dequant_scale),
                W=w_count,
                BLOCK=block,
                BLOCKS_PER_PROG=bpp,
                WRITE_SUM=return_sum,
                WRITE_DEQ=dequant_out is not None,
                APPLY_FACTOR=float(dequant_scale) != 1.0,
                TINY=TINY,
                ON_GPU=codes.is_cuda,
                USE_INT64=_FORCE_INT64 or w_count * codes.stride(0) >= _INT32_LIMIT,
                num_warps=warps,
                **extra,
            )
    elif nblocks:  # W == 0: the sum is empty, i.e. zero
        out_codes.zero_()
        out_scales.zero_()
        total.zero_()
        if dequant_out is not None:
            dequant_out.zero_()
    return (out_codes, out_scales, total) if return_sum else (out_codes, out_scales)
