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
receive buffers hold a quarter of the bucket's codes + scales each; each slice is the path
of the device (:func:`_reduce_direct`: the references write straight into the send and
all-gather buffers), whose references work in chunks of at most a quarter of their input
(``kernels/reference.py``, ``CHUNK_BLOCKS``: two fp32 work buffers). Peak transient memory
with slices of S bytes of codes + scales: about 3 S = 0.75 x codes + scales (the send
buffer and the quantize's work; then the receive and all-gather buffers and the owner's
work); the bound is 1.05 x (tests/verl_comm/test_int8_memory.py)."""
HOST_MIN_SLICE_BYTES = 1 << 18
"""CPU: smallest slice (bytes of codes + scales); smaller buckets run in fewer slices."""


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
    multiple of ``W * block`` elements: the transient host memory stays within one copy of
    the codes and scales (issue 28: 8 MiB fp32 bucket at W = 2). Blocks are independent and
    keep their positions, so the result and the bytes sent are the same bit for bit as one
    pass (more collectives: 2 per slice).

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
    sent, finite = 0, torch.ones((), dtype=torch.bool)
    for lo in range(0, n, per):
        hi = min(lo + per, n)
        res = None if residual is None else residual.view(-1)[lo:hi]
        r = _reduce_direct(x[lo:hi], coll, block, res, average, out[lo:hi])
        sent += r.wire_bytes
        finite = finite & r.finite
    return ReduceResult(out, sent, finite)


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
    path, and each slice of the host path (the same bits and bytes sent at any W).

    Each kernel writes where the next step reads, so nothing is copied between them
    (issue 28): ``quantize_ef`` writes the codes and scales of row w straight into row w
    of the packed ``(W, L)`` send buffer; the owner's ``dequant_sum_requant`` writes into
    this rank's row of the all-gather buffer, which the all-gather then uses in place as
    its input (NCCL's in-place form: input at ``output + rank * L``), and in the same pass
    this rank's chunk of ``out`` (dequantized there, not read back: at W = 1 all of it);
    ``dequantize`` reads the other ranks' gathered rows into the rest of ``out``. Memory:
    send + receive (2 x codes + scales) during the all-to-all, then receive + gathered.
    ``backend`` is the launchers' (tests run
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
