"""int8 quantized all-reduce: the two-step scheme, collective passed in.

Source: ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training", qgZ: all-to-all based quantized gradient reduction), followed here by
an int8 all-gather of the re-quantized owner blocks.

Why two steps: NCCL's int8 SUM wraps around and each rank's codes have their own scale, so
int8 codes cannot go through an ordinary all-reduce. Instead (as in a ring all-reduce =
reduce-scatter + all-gather):

1. pad the N inputs to ``N_pad``, a multiple of ``W * B``; quantize per block of B elements
   (absmax scale, fp32) with error feedback fused (``quantize_ef``);
2. all-to-all of packed codes + scales: rank ``w`` receives everyone's chunk ``w`` (M =
   N_pad / W elements);
3. the owner dequantizes its W pieces, sums in fp32 and requantizes (``dequant_sum_requant``);
4. all-gather of the packed requantized chunks;
5. every rank, the owner too, dequantizes the gathered codes, so replicas are bit-identical.

Bytes sent per rank: ``2 (W-1)/W * N_pad * (1 + 4/B)``, i.e. ``(1 + 4/B) / 2`` = 0.516x a bf16
ring all-reduce at B = 128 (0.26x fp32), independent of W. Error per element: at most half a
step of this rank's block (error feedback keeps it) plus half a step of the owner's
requantized block, divided by W when averaging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_comm.kernels import (
    all_finite,
    cast_scale,
    copy_finite,
    dequant_sum_requant,
    dequantize,
    packed_nbytes,
    padded_numel,
    quantize,
    quantize_ef,
    unpack,
)

from .collective import Collective


@dataclass
class ReduceResult:
    """Result of one compressed all-reduce.

    Attributes:
        out: ``(N,)`` reduced tensor (fp32 unless an ``out`` of another dtype was given),
            identical bit for bit on every rank.
        wire_bytes: bytes this rank sent (payload, as counted by the collective formulas).
        finite: 0-dim bool tensor on ``out``'s device, False if any rank's input held
            NaN/Inf; identical on every rank (it is read from the gathered scales, so no
            extra collective is needed).
    """

    out: torch.Tensor
    wire_bytes: int
    finite: torch.Tensor


def int8_allreduce_wire_bytes(numel: int, world_size: int, block: int = 128) -> int:
    """Bytes one rank sends in :func:`int8_allreduce` of ``numel`` elements (padding included).

    ``2 (W-1) * packed_nbytes(N_pad / W, B)`` with ``N_pad = padded_numel(N, B, W)``; 0 when
    ``W == 1`` or ``numel == 0``.
    """
    if numel == 0 or world_size == 1:
        return 0
    n_pad = padded_numel(numel, block, multiple=world_size)
    return 2 * (world_size - 1) * packed_nbytes(n_pad // world_size, block)


def ring_allreduce_wire_bytes(numel: int, world_size: int, element_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce: ``2 (W-1)/W * numel * element_size``."""
    return 2 * (world_size - 1) * numel * element_size // world_size


HOST_SLICES = 4
"""CPU: the all-reduce runs in about this many slices (2 collectives each), so its send and
receive buffers hold a quarter of the bucket's codes + scales each. Each slice's kernel
calls cover a quarter of it, which bounds the fp32 work of the torch references (about two
fp32 buffers of a call's size are alive). Peak transient memory, slice S and call of P
elements: about max(2 S, S + 8 P, 1.5 S + 8 P) bytes = 0.875 x codes + scales; the bound is
1.05 x (tests/verl_comm/test_int8_memory.py). The number of calls stays the same whatever
the bucket size. Process time against one pass of each kernel, 8 MiB and 16 MiB fp32
buckets at W = 2 on a shared 2-core machine: 1.0-1.15x (medians of 40 interleaved calls);
calls of a fixed 64 K elements cost 1.6x (the references' per-call dispatch)."""
HOST_MIN_SLICE_BYTES = 1 << 18
"""CPU: smallest slice (bytes of codes + scales); smaller buckets run in fewer slices."""
HOST_MIN_PASS_NUMEL = 1 << 16
"""CPU: smallest kernel call (elements)."""


def int8_allreduce(
    x: torch.Tensor,
    coll: Collective,
    *,
    block: int = 128,
    residual: torch.Tensor | None = None,
    average: bool = True,
    out: torch.Tensor | None = None,
) -> ReduceResult:
    """Sum (or average) a flat tensor over the ranks of ``coll`` with int8 on the wire.

    On the CPU the tensor is reduced in about :data:`HOST_SLICES` slices, each starting at a
    multiple of ``W * block`` elements, with kernel calls of a quarter of a slice: the
    transient host memory stays within one copy of the codes and scales (issue 28: 8 MiB
    fp32 bucket at W = 2). Blocks are independent and keep their positions, so the result
    and the bytes sent are the same bit for bit as one pass (more collectives: 2 per slice).

    Args:
        x: contiguous ``(N,)`` fp32/bf16/fp16 tensor, this rank's contribution.
        coll: the :class:`~verl_comm.compression.collective.Collective` (blocking calls).
        block: quantization block B in {32, 64, 128, 256}.
        residual: optional ``(N,)`` error-feedback residual (``x``'s dtype, fp32, or bf16
            for fp32 ``x``), updated in place to ``(x + residual) - dequant(codes)``; None disables error feedback.
        average: divide the sum by W (the dequantize step does it for free).
        out: optional contiguous ``(N,)`` float tensor for the result (may alias ``x``).

    Returns:
        :class:`ReduceResult` (``out`` fp32 by default, bit-identical on all ranks).

    Raises:
        ValueError / TypeError: from the kernel launchers on bad dtype, shape or block.
    """
    n = x.numel()
    w = coll.world_size
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return ReduceResult(out, 0, torch.ones((), dtype=torch.bool, device=x.device))
    x = x.reshape(-1)
    if x.is_cuda:  # device memory: one pass, fewest launches (captured as a CUDA graph)
        res = None if residual is None else residual.view(-1)
        return _reduce_direct(x, coll, block, res, average, out)
    unit = w * block
    total = packed_nbytes(padded_numel(n, block, multiple=w), block)
    slice_bytes = max(HOST_MIN_SLICE_BYTES, -(-total // HOST_SLICES))
    per = max(unit, -(-slice_bytes // packed_nbytes(unit, block)) * unit)
    step = max(block, max(HOST_MIN_PASS_NUMEL, per // HOST_SLICES) // block * block)
    sent, finite = 0, torch.ones((), dtype=torch.bool)
    for lo in range(0, n, per):
        hi = min(lo + per, n)
        res = None if residual is None else residual.view(-1)[lo:hi]
        r = _reduce_slice(x[lo:hi], coll, block, res, average, out[lo:hi], step)
        sent += r.wire_bytes
        finite = finite & r.finite
    return ReduceResult(out, sent, finite)


def _reduce_slice(
    x: torch.Tensor,
    coll: Collective,
    block: int,
    residual: torch.Tensor | None,
    average: bool,
    out: torch.Tensor,
    step: int | None = None,
) -> ReduceResult:
    """The two-step int8 all-reduce of ``x`` into ``out``, every kernel call on at most
    ``step`` elements (a multiple of ``block``; None: one call per kernel), the host path;
    each call's codes and scales are copied into the send and all-gather buffers (the device
    path, :func:`_reduce_direct`, has the kernels write there). Blocks keep their positions,
    so the bits do not depend on ``step``.

    Transient memory (issue 18): the quantized codes and scales of a call exist beside the
    send buffer until they are copied into it, and the owner's results are packed after
    the receive buffer is dropped, so at most the send and receive buffers (2 x the codes
    and scales) are alive at once; the references and kernels keep their fp32 work to a
    few chunks.
    """
    n = x.numel()
    w = coll.world_size
    n_pad = padded_numel(n, block, multiple=w)
    m = n_pad // w
    step = n_pad if step is None else step
    sent0 = coll.bytes_sent
    send = torch.empty(w, packed_nbytes(m, block), dtype=torch.uint8, device=x.device)
    codes, scales = unpack(send, block)
    for lo in range(0, n_pad, step):
        hi = min(lo + step, n_pad)
        end = max(min(hi, n), lo)
        if residual is None:
            c, s = quantize(x[lo:end], block, pad_to=hi - lo)
        else:  # residual in x's dtype, fp32, or bf16 for fp32 x: updated in place
            c, s = quantize_ef(x[lo:end], residual[lo:end], block, pad_to=hi - lo)
        _put(codes, scales, lo, c, s, m, block)
        del c, s
    recv = torch.empty_like(send)
    coll.all_to_all_single(recv.view(-1), send.view(-1))
    del send, codes, scales
    rc, rs = unpack(recv, block)
    spans = [(lo, min(lo + step, m)) for lo in range(0, m, step)]
    parts = [
        dequant_sum_requant(rc[:, a:b], rs[:, a // block : b // block], block) for a, b in spans
    ]
    del recv, rc, rs
    mine = torch.empty(packed_nbytes(m, block), dtype=torch.uint8, device=x.device)
    mc, ms = unpack(mine, block)
    for (a, b), (c, s) in zip(spans, parts):
        mc[a:b], ms[a // block : b // block] = c, s
    del parts
    gathered = torch.empty(w, mine.numel(), dtype=torch.uint8, device=x.device)
    coll.all_gather_into_tensor(gathered.view(-1), mine)
    del mine, mc, ms
    g_codes, g_scales = unpack(gathered, block)
    scale = 1.0 / w if average else 1.0
    rows, span = max(1, step // m), min(step, m)  # a call: whole rows, or part of one row
    for r in range(0, w, rows):
        r_end = min(r + rows, w)
        for lo in range(0, m, span):
            hi = min(lo + span, m)
            a, b = r * m + lo, min((r_end - 1) * m + hi, n)
            if b > a:
                dequantize(g_codes[r:r_end, lo:hi], g_scales[r:r_end, lo // block : hi // block],
                           block, scale=scale, numel=b - a, out=out[a:b])  # fmt: skip
    finite = torch.isfinite(g_scales).all()
    return ReduceResult(out, coll.bytes_sent - sent0, finite)


def _reduce_direct(
    x: torch.Tensor,
    coll: Collective,
    block: int,
    residual: torch.Tensor | None,
    average: bool,
    out: torch.Tensor,
    backend: str = "auto",
) -> ReduceResult:
    """The two-step int8 all-reduce of ``x`` (``(N,)``) into ``out`` in one pass: the device
    path, with the same bits and bytes sent as :func:`_reduce_slice` at any W.

    Each kernel writes where the next step reads, so nothing is copied between them
    (issue 28): ``quantize_ef`` writes the codes and scales of row w straight into row w
    of the packed ``(W, L)`` send buffer; the owner's ``dequant_sum_requant`` writes into
    this rank's row of the all-gather buffer, which the all-gather then uses in place as
    its input (NCCL's in-place form: input at ``output + rank * L``), and in the same pass
    this rank's chunk of ``out`` (dequantized there, not read back: at W = 1 all of it);
    ``dequantize`` reads the other ranks' gathered rows into the rest of ``out``. Memory: send + receive (2 x codes + scales) during the
    all-to-all, then receive + gathered, as before. ``backend`` is the launchers' (tests run
    the Triton kernels on CPU tensors with ``"triton"``).
    """
    n = x.numel()
    w = coll.world_size
    n_pad = padded_numel(n, block, multiple=w)
    m = n_pad // w
    sent0 = coll.bytes_sent
    send = torch.empty(w, packed_nbytes(m, block), dtype=torch.uint8, device=x.device)
    rows = unpack(send, block)
    if residual is None:
        quantize(x, block, pad_to=n_pad, out=rows, backend=backend)
    else:  # residual in x's dtype, fp32, or bf16 for fp32 x: updated in place
        quantize_ef(x, residual, block, pad_to=n_pad, out=rows, backend=backend)
    recv = torch.empty_like(send)
    coll.all_to_all_single(recv.view(-1), send.view(-1))
    del send, rows
    gathered = torch.empty_like(recv)
    mine = gathered[coll.rank]
    rc, rs = unpack(recv, block)
    scale = 1.0 / w if average else 1.0
    # the owner's chunk of the result comes out of the same pass (its codes are not read
    # back); the other ranks' chunks are dequantized after the all-gather
    lo, hi = min(coll.rank * m, n), min((coll.rank + 1) * m, n)
    dequant_sum_requant(rc, rs, block, out=unpack(mine, block), dequant_out=out[lo:hi],
                        dequant_scale=scale, backend=backend)  # fmt: skip
    del recv, rc, rs
    coll.all_gather_into_tensor(gathered.view(-1), mine)
    g_codes, g_scales = unpack(gathered, block)
    if lo > 0:
        dequantize(g_codes[: coll.rank], g_scales[: coll.rank], block, scale=scale,
                   numel=lo, out=out[:lo], backend=backend)  # fmt: skip
    if hi < n:
        dequantize(g_codes[coll.rank + 1 :], g_scales[coll.rank + 1 :], block, scale=scale,
                   numel=n - hi, out=out[hi:], backend=backend)  # fmt: skip
    finite = torch.isfinite(g_scales).all()
    return ReduceResult(out, coll.bytes_sent - sent0, finite)


def _put(codes, scales, lo: int, c: torch.Tensor, s: torch.Tensor, m: int, block: int) -> None:
    """Write the codes ``c`` and scales ``s`` of flat elements ``[lo, lo + len(c))`` into
    the per-rank rows (``(W, M)`` codes, ``(W, M / B)`` scales) of a packed send buffer:
    whole rows with one copy of codes and one of scales, parts of a row one at a time."""
    k = 0
    while k < c.numel():
        r, col = divmod(lo + k, m)
        rows = (c.numel() - k) // m if col == 0 else 0
        if rows:
            take = rows * m
            codes[r : r + rows] = c[k : k + take].view(rows, m)
            scales[r : r + rows] = s[k // block : (k + take) // block].view(rows, m // block)
        else:
            take = min(c.numel() - k, m - col)
            codes[r, col : col + take] = c[k : k + take]
            scales[r, col // block : (col + take) // block] = s[k // block : (k + take) // block]
        k += take


def cast_allreduce(
    x: torch.Tensor,
    coll: Collective,
    *,
    wire_dtype: torch.dtype,
    average: bool = True,
    out: torch.Tensor | None = None,
) -> ReduceResult:
    """All-reduce ``x`` in ``wire_dtype`` (fp16/bf16/fp32): divide by W first when averaging
    (keeps fp16 from overflowing, as torch's ``fp16_compress_hook``), sum, cast back.

    Two passes around the collective when a cast is needed (issue 28): ``cast_scale``
    (cast, then divide, as ``x.to(wire_dtype).div_(W)``; one Triton kernel on CUDA) and
    ``copy_finite`` (the copy back and the finiteness of the reduced values; one kernel on
    CUDA); on the CPU the same torch operations as before.

    Args:
        x: contiguous ``(N,)`` fp32/bf16/fp16 tensor. coll: the collective.
        wire_dtype: fp32/bf16/fp16, the dtype on the wire.
        average: divide by W. out: optional contiguous ``(N,)`` float destination (may
            alias ``x``; with ``out`` aliasing ``x`` and ``wire_dtype == x.dtype`` no copy
            is made).

    Returns:
        :class:`ReduceResult` with ``out`` in ``out``'s dtype (default ``x.dtype``) and
        ``finite`` from the reduced wire values (the same verdict on every rank).

    Raises:
        TypeError / ValueError: non-float or non-contiguous tensors, sizes (the launchers).
    """
    w = coll.world_size
    flat = x.reshape(-1)
    divisor = w if average else 1
    in_place = wire_dtype == x.dtype and out is not None and out.data_ptr() == flat.data_ptr()
    if in_place:
        buf = flat
        if divisor > 1:
            buf.div_(divisor)
    else:
        buf = cast_scale(flat, wire_dtype, divisor)
    sent0 = coll.bytes_sent
    if buf.numel():
        coll.all_reduce(buf)
    if out is None:
        out = torch.empty_like(flat)
    finite = all_finite(buf) if in_place else copy_finite(buf, out)
    return ReduceResult(out, coll.bytes_sent - sent0, finite.to(x.device))
