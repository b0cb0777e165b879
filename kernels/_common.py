"""Shared constants, size helpers and input validation for the int8 block kernels.

Quantization scheme (identical in the Triton kernels and the torch references, so that
codes agree bit for bit):

* The input is flattened and zero-padded to ``N_pad`` elements (a multiple of ``block``);
  element ``i`` belongs to block ``i // block``.
* Per block, all arithmetic is fp32: ``v = float32(x)`` (plus the residual for error
  feedback), ``absmax = max |v|``, ``scale = absmax / 127`` and ``inv = 127 / absmax``
  (both IEEE round-to-nearest divisions), ``q = v * inv``.
* Nearest rounding: ``code = clamp(round_half_even(q), -127, 127)``; stochastic rounding:
  ``code = clamp(floor(q + u), -127, 127)`` with ``u`` uniform in [0, 1) from Triton's
  Philox ``tl.rand(seed, offset + i)`` (reproduced bit for bit by the reference).
* ``dequant = code * scale`` (fp32). Error bound for nearest rounding:
  ``|v - dequant| <= scale / 2`` up to fp32 rounding of ``q`` and of the product (< 1e-4 *
  scale in total); stochastic rounding: ``|v - dequant| < scale``.
* All-zero blocks, and blocks with ``absmax < 2**-113`` (so that ``scale`` and ``inv`` stay
  normal fp32 numbers), get ``scale = 0`` and codes 0.
* NaN/Inf policy: nothing raises inside a kernel. A block that contains a NaN or an Inf
  gets ``scale = NaN`` and codes 0; callers detect it with ``torch.isfinite(scales)``. With
  error feedback the new residual of such a block is NaN as well (``v - 0 * NaN``); the
  caller is expected to skip the step and reset the residual.
"""

from __future__ import annotations

import torch

QMAX = 127
"""Largest code magnitude; codes lie in [-127, 127] (-128 is never produced)."""

TINY = 2.0**-113
"""Blocks whose absmax is below this are treated as all-zero (scale 0, codes 0)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_BLOCKS = (32, 64, 128, 256)


def padded_numel(n: int, block: int = 128, multiple: int = 1) -> int:
    """Smallest ``N_pad >= n`` divisible by ``block * multiple``.

    Args:
        n: number of elements (>= 0).
        block: quantization block size in elements.
        multiple: extra factor, e.g. the world size W for a reduce-scatter of W equal chunks.

    Returns:
        ``ceil(n / (block * multiple)) * block * multiple`` (0 for ``n == 0``).

    Raises:
        ValueError: if ``n < 0`` or ``block``/``multiple`` are not positive.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if block <= 0 or multiple <= 0:
        raise ValueError(
            f"block and multiple must be positive, got block={block}, multiple={multiple}"
        )
    unit = block * multiple
    return -(-n // unit) * unit


def packed_nbytes(m: int, block: int) -> int:
    """Bytes of one packed chunk of ``m`` codes: ``m`` int8 codes then ``m // block`` fp32 scales.

    Raises:
        ValueError: if ``m`` is negative or not a multiple of ``block``.
    """
    check_block(block)
    if m < 0 or m % block:
        raise ValueError(f"m must be a non-negative multiple of block={block}, got {m}")
    return m + 4 * (m // block)


def check_block(block: int) -> None:
    """Raise ValueError unless ``block`` is one of 32, 64, 128, 256."""
    if not isinstance(block, int) or block not in SUPPORTED_BLOCKS:
        raise ValueError(f"block must be one of {SUPPORTED_BLOCKS}, got {block!r}")


def check_float_input(name: str, t: torch.Tensor) -> None:
    """Raise a clear error unless ``t`` is a contiguous fp32/bf16/fp16 tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (non-contiguous inputs are rejected, not copied); "
            f"call {name}.contiguous() first"
        )


def resolve_pad(n: int, block: int, pad_to: int | None) -> int:
    """``N_pad`` for an input of ``n`` elements: ``pad_to`` if given, else ``padded_numel``.

    Raises:
        ValueError: if ``pad_to < n`` or ``pad_to`` is not a multiple of ``block``.
    """
    if pad_to is None:
        return padded_numel(n, block)
    if not isinstance(pad_to, int) or pad_to < n or pad_to % block:
        raise ValueError(
            f"pad_to must be an int >= numel ({n}) and divisible by block ({block}), got {pad_to!r}; "
            f"use padded_numel(n, block, multiple=W)"
        )
    return pad_to


def empty_codes_scales(
    x: torch.Tensor, block: int, pad_to: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised outputs of a quantize of ``x``: codes int8 ``(N_pad,)`` and scales fp32
    ``(N_pad // block,)`` on ``x``'s device, ``N_pad = resolve_pad(x.numel(), block, pad_to)``.

    Raises:
        ValueError: as :func:`resolve_pad`.
    """
    n_pad = resolve_pad(x.numel(), block, pad_to)
    codes = torch.empty(n_pad, dtype=torch.int8, device=x.device)
    scales = torch.empty(n_pad // block, dtype=torch.float32, device=x.device)
    return codes, scales


def check_codes_scales(
    codes: torch.Tensor, scales: torch.Tensor, block: int, *, batched: bool | None
) -> tuple[int, int]:
    """Validate a (codes, scales) pair and return ``(rows, m)``.

    Accepted layouts: codes ``(M,)`` int8 with scales ``(M // block,)`` fp32, or codes ``(R, M)``
    with scales ``(R, M // block)``; the last dimension must have stride 1 (rows may be
    strided, e.g. views from :func:`unpack`). ``batched=True`` requires 2-D, ``False`` 1-D,
    ``None`` accepts both.

    Raises:
        TypeError: wrong dtype. ValueError: wrong shape, stride or device.
    """
    check_block(block)
    for name, t, dt in (("codes", codes, torch.int8), ("scales", scales, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dt:
            raise TypeError(f"{name} must be {dt}, got {t.dtype}")
    if (
        codes.dim() not in (1, 2)
        or (batched is True and codes.dim() != 2)
        or (batched is False and codes.dim() != 1)
    ):
        want = {True: "(W, M)", False: "(M,)", None: "(M,) or (R, M)"}[batched]
        raise ValueError(f"codes must have shape {want}, got {tuple(codes.shape)}")
    m = codes.shape[-1]
    if m % block:
        raise ValueError(f"codes.shape[-1]={m} must be a multiple of block={block}")
    want_scales = (*codes.shape[:-1], m // block)
    if tuple(scales.shape) != want_scales:
        raise ValueError(
            f"scales must have shape {want_scales} for codes {tuple(codes.shape)} and "
            f"block={block}, got {tuple(scales.shape)}"
        )
    if codes.device != scales.device:
        raise ValueError(f"codes ({codes.device}) and scales ({scales.device}) must share a device")
    for name, t in (("codes", codes), ("scales", scales)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must have stride 1 in its last dimension; call .contiguous()")
    rows = codes.shape[0] if codes.dim() == 2 else 1
    return rows, m


def check_out_codes_scales(
    out: tuple[torch.Tensor, torch.Tensor], n_pad: int, block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate an ``out=(codes, scales)`` destination for ``n_pad`` codes; return it.

    Accepted: codes int8 ``(N_pad,)`` with scales fp32 ``(N_pad // block,)``, or codes
    ``(R, N_pad // R)`` with scales ``(R, N_pad // R // block)`` whose rows may be strided
    (views of a packed buffer from :func:`~verl_comm.kernels.unpack`); the last dimension
    has stride 1 and the tensors live on ``device``. Row ``r`` holds the codes of flat
    elements ``[r M, (r + 1) M)``.

    Raises:
        TypeError: ``out`` is not a pair of tensors, or wrong dtypes.
        ValueError: wrong shapes, strides, device, or not ``n_pad`` codes in all.
    """
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError("out must be a (codes, scales) tuple of tensors")
    codes, scales = out
    rows, m = check_codes_scales(codes, scales, block, batched=None)
    if rows * m != n_pad:
        raise ValueError(f"out codes hold {rows * m} elements, the padded input needs {n_pad}")
    if codes.device != torch.device(device):
        raise ValueError(f"out is on {codes.device}, the input on {device}")
    return codes, scales
