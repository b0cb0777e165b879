"""Pack int8 codes and fp32 scales of a chunk into one byte buffer (one collective moves both).

Layout of one packed chunk of M codes with block B (``packed_nbytes(M, B)`` bytes)::

    bytes [0, M)              codes, int8, element order
    bytes [M, M + 4 * M / B)  scales, fp32, native (little-endian) byte order

Batched: ``(W, M)`` codes and ``(W, M / B)`` scales pack into a ``(W, M + 4 M / B)`` uint8
tensor, one packed chunk per row (row w is what rank w receives in an all-to-all). M is a
multiple of B >= 32, so the scales start at a 4-byte aligned offset and :func:`unpack` can
return views without copying.
"""

from __future__ import annotations

import torch

from ._common import check_block, check_codes_scales, packed_nbytes


def pack(
    codes: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack codes ``(M,)``/``(W, M)`` int8 and scales ``(M//B,)``/``(W, M//B)`` fp32 into uint8.

    The block size is inferred as ``M // scales.shape[-1]``.

    Args:
        codes: int8 codes; last dimension with stride 1.
        scales: fp32 scales.
        out: optional contiguous uint8 ``(M + 4 M/B,)`` or ``(W, M + 4 M/B)`` destination.

    Returns:
        uint8 tensor ``(M + 4 M/B,)`` or ``(W, M + 4 M/B)`` on the codes' device.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes or ``out``.
    """
    if scales.dim() == 0 or scales.shape[-1] == 0 or codes.shape[-1] % scales.shape[-1]:
        raise ValueError(
            f"cannot infer block from codes {tuple(codes.shape)} and scales {tuple(scales.shape)}"
        )
    block = codes.shape[-1] // scales.shape[-1]
    check_codes_scales(codes, scales, block, batched=None)
    m = codes.shape[-1]
    shape = (*codes.shape[:-1], packed_nbytes(m, block))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=codes.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous uint8 tensor of shape {shape}")
    out[..., :m].copy_(codes.view(torch.uint8))
    out[..., m:].view(torch.float32).copy_(scales)
    return out


def unpack(buf: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(codes, scales)`` into a packed uint8 buffer (inverse of :func:`pack`).

    Args:
        buf: uint8 ``(L,)`` or ``(W, L)`` with ``L = M + 4 M / B``; last dim stride 1, and for
            2-D a row stride divisible by 4 (true for a contiguous buffer).
        block: block size B.

    Returns:
        codes int8 ``(M,)``/``(W, M)`` and scales fp32 ``(M//B,)``/``(W, M//B)``, both views
        of ``buf`` (rows strided by L), accepted by ``dequantize`` and ``dequant_sum_requant``.

    Raises:
        ValueError: ``L`` is not of the form ``M (1 + 4 / B)`` or the buffer is not uint8.
    """
    check_block(block)
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() not in (1, 2):
        raise ValueError("buf must be a uint8 tensor of shape (L,) or (W, L)")
    length = buf.shape[-1]
    if length % (block + 4):
        raise ValueError(
            f"buf.shape[-1]={length} is not M + 4*M/{block} for any M (not a multiple of {block + 4})"
        )
    m = length // (block + 4) * block
    if buf.numel() and buf.stride(-1) != 1:
        raise ValueError("buf must have stride 1 in its last dimension")
    codes = buf[..., :m].view(torch.int8)
    scales = buf[..., m:].view(torch.float32)
    return codes, scales
