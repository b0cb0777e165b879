"""Torch references of the int8 block kernels (public; used on CPU and by the tests).

They follow the scheme in :mod:`verl_comm.kernels._common` operation for operation, so the
Triton kernels must match them bit for bit (codes and scales; residuals and dequantized
values too, since every step is one IEEE fp32 operation in the same order). They run on any
device: on CUDA they are the "eager torch" baseline of the benchmark.
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    QMAX,
    TINY,
    check_block,
    check_codes_scales,
    check_float_input,
    empty_codes_scales,
)

_MASK32 = 0xFFFFFFFF
# Philox-4x32-10 constants, as in triton/language/random.py.
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _umulhi32(a: int, b: torch.Tensor) -> torch.Tensor:
    """High 32 bits of ``a * b`` for a 32-bit constant ``a`` and uint32 values in int64 ``b``."""
    ah, al = a >> 16, a & 0xFFFF
    t = ah * b + ((al * b) >> 16)  # == (a * b) >> 16, below 2**49
    return t >> 16


def philox_uniform_ref(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.rand(seed, counters)`` reproduced in torch (bit for bit).

    Philox-4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
    SC'11), key = (seed low 32 bits, seed high 32 bits), counter = (counter low 32 bits,
    counter high 32 bits, 0, 0); the first output word, read as int32 ``x``, maps to
    ``float32(x if x >= 0 else -x - 1) * 4.6566127342e-10`` in [0, 1).

    Args:
        seed: integer in [0, 2**63).
        counters: int64 tensor of non-negative counters, any shape.

    Returns:
        float32 tensor of the same shape and device.
    """
    if counters.dtype != torch.int64:
        raise TypeError(f"counters must be int64, got {counters.dtype}")
    c0 = counters & _MASK32
    c1 = (counters >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        _c0, _c2 = c0, c2
        c0 = _umulhi32(_ROUND_B, _c2) ^ c1 ^ k0
        c2 = _umulhi32(_ROUND_A, _c0) ^ c3 ^ k1
        c1 = (_ROUND_B * _c2) & _MASK32
        c3 = (_ROUND_A * _c0) & _MASK32
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # as int32
    x = torch.where(x < 0, -x - 1, x).to(torch.int32)
    return x.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


_FP32_MAX = torch.finfo(torch.float32).max


def _quantize_blocks(
    v: torch.Tensor,
    *,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    work: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize fp32 ``v`` of shape ``(nblocks, block)``.

    Returns ``(codes_f, scales, ok)``: fp32 integer-valued codes ``(nblocks, block)`` (in
    ``work``, an fp32 buffer of ``v.numel()`` elements, when given), fp32 scales
    ``(nblocks,)`` and the mask of blocks that were quantized normally.
    """
    # max |v| per block; amax propagates NaN, so the block maximum is NaN or Inf exactly when
    # some element is (a separate all(|v| <= max) reduction cost 9x the amax on the CPU)
    c = torch.empty_like(v) if work is None else work.view(v.shape)
    absmax = torch.abs(v, out=c).amax(dim=1)
    ok = (absmax >= TINY) & (absmax <= _FP32_MAX)  # False for NaN/Inf and all-zero blocks
    # Tensor / tensor divisions: torch turns `127 / t` into `t.reciprocal() * 127` and, on
    # CUDA, `t / 127` into `t * (1 / 127)`; both round differently from one IEEE division.
    qmax = torch.full_like(absmax, float(QMAX))
    all_ok = not v.is_cuda and bool(ok.all())  # the common case on the CPU: fewer calls
    if all_ok:
        scale, inv = absmax / qmax, qmax / absmax
    else:
        bad = ~(absmax <= _FP32_MAX)  # NaN or Inf anywhere in the block
        safe = torch.where(ok, absmax, torch.ones_like(absmax))
        scale = torch.where(ok, safe / qmax, torch.zeros_like(absmax))
        scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
        inv = torch.where(ok, qmax / safe, torch.zeros_like(absmax))
    # the same IEEE operations as the kernels, in place on one work tensor (a CPU pass over
    # memory is what this reference costs: it runs the CPU hooks)
    torch.mul(v, inv[:, None], out=c)
    if stochastic:
        counters = offset + torch.arange(v.numel(), device=v.device, dtype=torch.int64)
        c.add_(philox_uniform_ref(seed, counters).view_as(v)).floor_()
        c.clamp_(-QMAX, QMAX)
    else:
        # round half to even. The kernels' clamp to [-127, 127] is a no-op here: |v| <=
        # absmax and inv = fl(127 / absmax), so |v * inv| <= 127 (1 + 2^-24)^2 < 127.5
        c.round_()
    if not all_ok:  # zero the codes of NaN/Inf and all-zero blocks
        c.masked_fill_(~ok[:, None], 0.0)
    return c, scale, ok


def _check_seed(seed: int, offset: int) -> None:
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    if not isinstance(offset, int) or not 0 <= offset < 2**62:
        raise ValueError(f"offset must be an int in [0, 2**62), got {offset!r}")


CHUNK_BLOCKS = 4096
"""Blocks processed per pass by the references: transient fp32 memory stays at two work
buffers of at most ``CHUNK_BLOCKS * B * 4`` bytes, and of a quarter of the input for small
inputs (the blocks are independent, so the result is the same bit for bit as one pass over
everything)."""


def _chunks(n_pad: int, block: int) -> list[tuple[int, int]]:
    nblocks = n_pad // block
    step = max(1, min(CHUNK_BLOCKS, -(-nblocks // 4))) * block
    return [(lo, min(lo + step, n_pad)) for lo in range(0, n_pad, step)]


def _work(chunks: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Two fp32 work buffers ``(2, chunk)`` reused by every chunk of a reference's loop
    (a fresh tensor per operation and chunk cost page faults and cache misses on the CPU)."""
    size = max((hi - lo for lo, hi in chunks), default=0)
    return torch.empty(2, size, dtype=torch.float32, device=device)


def _store(out: tuple[torch.Tensor, torch.Tensor], lo: int, c: torch.Tensor, s: torch.Tensor,
           block: int) -> None:  # fmt: skip
    """Write fp32 codes ``c`` (cast to int8) and scales ``s`` of flat elements ``[lo, lo +
    c.numel())`` into ``out``: 1-D ``(N,)`` / ``(N / B,)``, or rows ``(R, M)`` /
    ``(R, M / B)`` of a packed buffer (row ``r`` holds ``[r M, (r + 1) M)``), a part of a
    row at a time."""
    codes, scales = out
    c, s = c.reshape(-1), s.reshape(-1)
    if codes.dim() == 1:
        codes[lo : lo + c.numel()].copy_(c)
        scales[lo // block : lo // block + s.numel()].copy_(s)
        return
    m = codes.shape[1]
    k = 0
    while k < c.numel():
        r, col = divmod(lo + k, m)
        take = min(c.numel() - k, m - col)
        codes[r, col : col + take].copy_(c[k : k + take])
        scales[r, col // block : (col + take) // block].copy_(s[k // block : (k + take) // block])
        k += take


def _load(v: torch.Tensor, x: torch.Tensor, lo: int, add: torch.Tensor | None = None) -> None:
    """``v`` (fp32, a chunk of the zero-padded input from flat element ``lo``) =
    ``float32(x) + float32(add)`` over the part of ``[lo, lo + v.numel())`` inside ``x``,
    zeros after it. The 16-bit operand is converted by a copy first: the same fp32 sum as
    torch's mixed-dtype addition, which runs a slower path in its CPU kernels."""
    end = max(min(lo + v.numel(), x.numel()), lo)
    k = end - lo
    v[k:].zero_()
    if add is None:
        v[:k].copy_(x[lo:end])
    elif x.dtype == add.dtype == torch.float32:
        torch.add(x[lo:end], add[lo:end], out=v[:k])
    else:  # fp32 addition commutes: copy the 16-bit operand, add the other
        a, b = (add, x) if x.dtype == torch.float32 else (x, add)
        v[:k].copy_(a[lo:end])
        v[:k].add_(b[lo:end])


def quantize_ref(
    x: torch.Tensor,
    block: int = 128,
    *,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax int8 block quantization (torch reference of :func:`verl_comm.kernels.quantize`).

    Args:
        x: contiguous fp32/bf16/fp16 tensor of N elements (flattened).
        block: block size B in {32, 64, 128, 256}.
        stochastic: round ``floor(q + u)``, ``u = tl.rand(seed, offset + i)`` (unbiased),
            instead of round-half-to-even.
        seed, offset: Philox seed in [0, 2**63) and counter offset; element ``i`` of the padded
            input uses counter ``offset + i``. Advance ``offset`` by ``N_pad`` between calls.
        pad_to: ``N_pad`` (>= N, multiple of B); default ``padded_numel(N, B)``.
        out: optional destination ``(codes, scales)``, validated by the caller
            (:func:`~verl_comm.kernels._common.check_out_codes_scales`): 1-D, or rows of a
            packed buffer; written in place.

    Returns:
        ``codes`` int8 ``(N_pad,)`` in [-127, 127] and ``scales`` fp32 ``(N_pad // B,)``
        (``out``'s tensors when given),
        ``scale = absmax / 127``. Padding elements are zeros (their codes are 0).
        Error bound per element: ``scale / 2`` (nearest), ``< scale`` (stochastic).
        A block with NaN/Inf gets scale NaN and codes 0; an all-zero block scale 0, codes 0.

    Raises:
        TypeError / ValueError: wrong dtype, non-contiguous input, bad block, pad_to, seed.
    """
    check_float_input("x", x)
    check_block(block)
    _check_seed(seed, offset)
    codes, scales = empty_codes_scales(x, block, pad_to) if out is None else out
    n_pad = codes.numel()
    chunks = _chunks(n_pad, block)
    work = _work(chunks, x.device)
    flat = x.reshape(-1)
    for lo, hi in chunks:
        v = work[0, : hi - lo]
        _load(v, flat, lo)
        c, scale, _ = _quantize_blocks(v.view(-1, block), stochastic=stochastic, seed=seed,
                                       offset=offset + lo, work=work[1, : hi - lo])  # fmt: skip
        _store((codes, scales), lo, c, scale, block)
    return codes, scales


def quantize_ef_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    block: int = 128,
    *,
    pad_to: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x + residual`` with error feedback (reference of ``quantize_ef``).

    Args:
        x: contiguous fp32/bf16/fp16 tensor of N elements.
        residual: contiguous tensor of N elements, dtype ``x.dtype`` or fp32. Updated IN PLACE
            to ``(x + residual) - dequant(codes)`` (computed in fp32, then cast to its dtype).
        block, pad_to, out: as in :func:`quantize_ref` (nearest rounding only).

    Returns:
        ``(codes int8 (N_pad,), scales fp32 (N_pad // B,))`` of ``v = float32(x) +
        float32(residual)``. Identity: ``v == dequant(codes) + residual_new`` up to one fp32
        rounding (exact before the cast of the residual to a 16-bit dtype).

    Raises:
        TypeError / ValueError: as :func:`quantize_ref`, or residual of wrong dtype/size/device.
    """
    check_float_input("x", x)
    check_residual(x, residual)
    check_block(block)
    n = x.numel()
    codes, scales = empty_codes_scales(x, block, pad_to) if out is None else out
    n_pad = codes.numel()
    res = residual.view(-1)
    flat = x.reshape(-1)
    chunks = _chunks(n_pad, block)
    work = _work(chunks, x.device)
    for lo, hi in chunks:
        end = max(min(hi, n), lo)
        v = work[0, : hi - lo]
        _load(v, flat, lo, res)
        c, scale, _ = _quantize_blocks(v.view(-1, block), work=work[1, : hi - lo])
        _store((codes, scales), lo, c, scale, block)
        if end > lo:  # residual = v - codes * scale, in place (c is no longer needed)
            v.view(-1, block).sub_(c.mul_(scale[:, None]))
            res[lo:end].copy_(v[: end - lo])
    return codes, scales


def check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    """Raise a clear error unless ``residual`` can carry the error feedback of ``x``."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    allowed = (x.dtype, torch.float32) + ((torch.bfloat16,) if x.dtype == torch.float32 else ())
    if residual.dtype not in allowed:
        raise TypeError(
            f"residual must be {x.dtype} (like x) or float32 (bfloat16 too for float32 x), "
            f"got {residual.dtype}"
        )
    if residual.numel() != x.numel():
        raise ValueError(f"residual must have {x.numel()} elements like x, got {residual.numel()}")
    if residual.device != x.device:
        raise ValueError(f"residual ({residual.device}) must be on x's device ({x.device})")
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous (it is updated in place)")


def resolve_dequant_out(
    codes: torch.Tensor,
    rows: int,
    m: int,
    out_dtype: torch.dtype,
    numel: int | None,
    out: torch.Tensor | None,
) -> tuple[int, torch.Tensor]:
    """Validate ``numel``/``out`` of a dequantize call; return ``(numel, out tensor)``."""
    total = rows * m
    if numel is None:
        numel = total
    if not isinstance(numel, int) or not 0 <= numel <= total:
        raise ValueError(
            f"numel must be an int in [0, {total}] (codes hold {total}), got {numel!r}"
        )
    if out is None:
        if out_dtype not in FLOAT_DTYPES:
            raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
        return numel, torch.empty(numel, dtype=out_dtype, device=codes.device)
    if not isinstance(out, torch.Tensor) or out.dtype not in FLOAT_DTYPES:
        raise TypeError("out must be a float32/bfloat16/float16 tensor")
    if out.numel() != numel or not out.is_contiguous() or out.device != codes.device:
        raise ValueError(
            f"out must be contiguous with {numel} elements on {codes.device}, got "
            f"{out.numel()} elements, contiguous={out.is_contiguous()}, device={out.device}"
        )
    return numel, out


def dequantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 128,
    *,
    out_dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    numel: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(codes * scales) * scale`` in fp32, cast to the output dtype (reference of ``dequantize``).

    Args:
        codes: int8 ``(M,)`` or ``(R, M)`` (rows may be strided, last dim stride 1).
        scales: fp32 ``(M // B,)`` or ``(R, M // B)``.
        block: block size B.
        out_dtype: fp32/bf16/fp16 (ignored when ``out`` is given: ``out.dtype`` is used).
        scale: extra factor, e.g. ``1 / W`` to average.
        numel: keep only the first ``numel`` of the ``R * M`` values (drop padding).
        out: optional contiguous ``(numel,)`` float tensor written in place.

    Returns:
        ``(numel,)`` tensor (``out`` if given); row-major over ``(R, M)``.
    """
    rows, m = check_codes_scales(codes, scales, block, batched=None)
    numel, out = resolve_dequant_out(codes, rows, m, out_dtype, numel, out)
    factor = torch.tensor(scale, dtype=torch.float32) if scale != 1.0 else None
    c2, s2 = codes.reshape(rows, m), scales.reshape(rows, m // block)
    step = CHUNK_BLOCKS * block
    for r in range(rows):
        base = r * m
        for lo in range(0, m, step):
            if base + lo >= numel:
                return out
            hi = min(lo + step, m)
            k = min(hi - lo, numel - base - lo)
            c, s = c2[r, lo:hi].view(-1, block), s2[r, lo // block : hi // block, None]
            if out.dtype == torch.float32 and k == hi - lo:  # straight into out: fp32(c) * s
                y = out[base + lo : base + hi].view(-1, block)
                torch.mul(c, s, out=y)
                if factor is not None:
                    y.mul_(factor)
                continue
            y = c.to(torch.float32).mul_(s)
            if factor is not None:
                y.mul_(factor)
            out[base + lo : base + lo + k] = y.view(-1)[:k]
    return out


def dequant_sum_requant_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: int = 128,
    *,
    return_sum: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Owner step of a quantized reduce-scatter (reference of ``dequant_sum_requant``).

    ``sum = sum_w codes[w] * scales[w]`` accumulated in fp32 in the order w = 0..W-1, then
    requantized with nearest rounding like :func:`quantize_ref`.

    Args:
        codes: int8 ``(W, M)`` (rows may be strided, last dim stride 1), M a multiple of B.
        scales: fp32 ``(W, M // B)``.
        block: block size B.
        return_sum: also return the fp32 sum ``(M,)``.
        out: optional 1-D destination ``(codes (M,), scales (M // B,))``, written in place
            (validated by the caller); must not overlap the inputs.

    Returns:
        ``(codes int8 (M,), scales fp32 (M // B,))`` (``out``'s when given) or ``(codes,
        scales, sum)``. A non-finite input scale makes the output scale of that block NaN.
    """
    w_count, m = check_codes_scales(codes, scales, block, batched=True)
    dev = codes.device
    if out is None:
        out = (torch.empty(m, dtype=torch.int8, device=dev),
               torch.empty(m // block, dtype=torch.float32, device=dev))  # fmt: skip
    total = torch.empty(m if return_sum else 0, dtype=torch.float32, device=dev)
    chunks = _chunks(m, block)
    work = _work(chunks, dev)
    for lo, hi in chunks:
        nb, b0 = (hi - lo) // block, lo // block
        acc, term = work[0, : hi - lo].view(nb, block), work[1, : hi - lo].view(nb, block)
        if w_count == 0:
            acc.zero_()
        for w in range(w_count):  # fp32(code) * scale, then the running fp32 sum
            s_w = scales[w, b0 : b0 + nb].reshape(nb, 1)
            term.copy_(codes[w, lo:hi].reshape(nb, block)).mul_(s_w)
            if w == 0:  # 0 + t == t (codes are integers: a zero code gives +0, not -0)
                acc.copy_(term)
            else:
                acc.add_(term)
        if return_sum:
            total[lo:hi] = acc.view(-1)
        c, scale, _ = _quantize_blocks(acc, work=term)
        _store(out, lo, c, scale, block)
    return (*out, total) if return_sum else out
