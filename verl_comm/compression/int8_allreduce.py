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

from .collective import Collective, begin


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


HOST_SLICES = 8
"""CPU: the all-reduce runs in about this many slices (2 collectives each), pipelined
(:func:`_reduce_host`), so its buffers hold an eighth of the bucket's codes + scales each.
Each slice is the path of the device (the references write straight into the send and
all-gather buffers) and the references work in chunks of at most a quarter of their input
(``kernels/reference.py``, ``CHUNK_BLOCKS``: two fp32 work buffers, about 2 slices). Peak
transient memory with slices of S bytes of codes + scales: about 7 S = 0.875 x codes +
scales (two slices' send and receive buffers, one all-gather buffer, the quantize's work);
the bound is 1.05 x (tests/verl_comm/test_int8_memory.py)."""
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
    multiple of ``W * block`` elements, pipelined (one slice on the link while the next is
    computed): the transient host memory stays within one copy of the codes and scales
    (issue 28: 8 MiB fp32 bucket at W = 2). Blocks are independent and
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
    res = None if residual is None else residual.view(-1)
    return _reduce_host(x, coll, block, res, average, out, host_slice_numel(n, w, block))


def host_slice_numel(n: int, world_size: int, block: int = 128) -> int:
    """Elements per slice of the host path for ``n`` elements at W = ``world_size`` (a
    multiple of ``W * block``): about :data:`HOST_SLICES` slices, none under
    :data:`HOST_MIN_SLICE_BYTES` of codes + scales; ``ceil(n / result)`` slices."""
    unit = world_size * block
    total = packed_nbytes(padded_numel(n, block, multiple=world_size), block)
    slice_bytes = max(HOST_MIN_SLICE_BYTES, -(-total // HOST_SLICES))
    return max(unit, -(-slice_bytes // packed_nbytes(unit, block)) * unit)


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
    path, with the same bits and bytes sent as the pipelined slices of the host path.

    Each kernel writes where the next step reads, so nothing is copied between them
    (issue 28): ``quantize_ef`` writes the codes and scales of row w straight into row w
    of the packed ``(W, L)`` send buffer; the owner's ``dequant_sum_requant`` writes into
    this rank's row of the all-gather buffer, which the all-gather then uses in place as
    its input (NCCL's in-place form: input at ``output + rank * L``), and in the same pass
    this rank's chunk of ``out`` (dequantized there, not read back: at W = 1 all of it);
    ``dequantize`` reads the other ranks' gathered rows into the rest of ``out``. Memory:
    send + receive (2 x codes + scales) during the all-to-all, then receive + gathered.
    Collectives are blocking calls (on CUDA: captured into the bucket's graph). ``backend``
    is the launchers' (tests run the Triton kernels on CPU tensors with ``"triton"``).
    """
    sent0 = coll.bytes_sent
    scale = 1.0 / coll.world_size if average else 1.0
    send, recv, _ = _quantize_send(x, coll, block, residual, backend, wait=True)
    del send
    gathered, _ = _owner(coll, block, recv, out, scale, backend, wait=True)
    del recv
    finite = _dequantize_gathered(coll, block, gathered, out, scale, backend)
    return ReduceResult(out, coll.bytes_sent - sent0, finite)


def _reduce_host(
    x: torch.Tensor,
    coll: Collective,
    block: int,
    residual: torch.Tensor | None,
    average: bool,
    out: torch.Tensor,
    per: int,
) -> ReduceResult:
    """The host path: slices of ``per`` elements, each the steps of :func:`_reduce_direct`,
    software-pipelined on the calling thread with asynchronous collectives (issue 28).

    Round k quantizes slice k and starts its all-to-all, then finishes the all-to-all of
    slice k - 1 (owner step, start of its all-gather), then the all-gather of slice k - 2
    (dequantize). The link carries one slice while the CPU computes the next, where a
    blocking chain left it idle during every kernel (on the shaped 1 Gbit/s veth,
    ``benchmarks/slow_link_trace.py``: int8's collectives reached about half the link rate
    of torch's fp16 hook). Collectives start in the same order on every rank (A0, A1 G0,
    A2 G1, ...). A :class:`Collective` without ``start_*`` methods runs them blocking, in
    that order. Peak transient memory about 7 slices of codes + scales (two slices' send
    and receive buffers, one all-gather buffer, the quantize's work); see
    :data:`HOST_SLICES`.
    """
    n = x.numel()
    sent0 = coll.bytes_sent
    scale = 1.0 / coll.world_size if average else 1.0
    finite = torch.ones((), dtype=torch.bool)
    spans = [(lo, min(lo + per, n)) for lo in range(0, n, per)]
    a2a = ag = None  # (span, buffers..., work) of the slice whose collective is in flight
    for k in range(len(spans) + 2):
        started = None
        if k < len(spans):
            lo, hi = spans[k]
            res = None if residual is None else residual[lo:hi]
            started = (spans[k], *_quantize_send(x[lo:hi], coll, block, res, "auto", False))
        gathering = None
        if a2a is not None:
            (lo, hi), send, recv, work = a2a
            a2a = None
            work.wait()
            del send
            gathering = ((lo, hi), *_owner(coll, block, recv, out[lo:hi], scale, "auto", False))
            del recv
        if ag is not None:
            (lo, hi), gathered, work = ag
            ag = None
            work.wait()
            finite = finite & _dequantize_gathered(coll, block, gathered, out[lo:hi], scale, "auto")
            del gathered
        a2a, ag = started, gathering
    return ReduceResult(out, coll.bytes_sent - sent0, finite)


def _quantize_send(x, coll, block, residual, backend, wait):
    """Quantize ``x`` (with error feedback into ``residual``) straight into the rows of a
    packed send buffer and start the all-to-all; returns ``(send, recv, work)``."""
    w = coll.world_size
    m = padded_numel(x.numel(), block, multiple=w) // w
    send = torch.empty(w, packed_nbytes(m, block), dtype=torch.uint8, device=x.device)
    rows = unpack(send, block)
    if residual is None:
        quantize(x, block, pad_to=w * m, out=rows, backend=backend)
    else:  # residual in x's dtype, fp32, or bf16 for fp32 x: updated in place
        quantize_ef(x, residual, block, pad_to=w * m, out=rows, backend=backend)
    recv = torch.empty_like(send)
    return send, recv, begin(coll, "all_to_all_single", recv.view(-1), send.view(-1), wait)


def _owner(coll, block, recv, out, scale, backend, wait):
    """The owner step on a received ``(W, L)`` buffer: requantized codes into this rank's
    row of a new all-gather buffer, its dequantized values into this rank's chunk of
    ``out`` (the same pass); start the all-gather. Returns ``(gathered, work)``."""
    gathered = torch.empty_like(recv)
    mine = gathered[coll.rank]
    rc, rs = unpack(recv, block)
    m, n = rc.shape[1], out.numel()
    lo, hi = min(coll.rank * m, n), min((coll.rank + 1) * m, n)
    dequant_sum_requant(rc, rs, block, out=unpack(mine, block), dequant_out=out[lo:hi],
                        dequant_scale=scale, backend=backend)  # fmt: skip
    return gathered, begin(coll, "all_gather_into_tensor", gathered.view(-1), mine, wait)


def _dequantize_gathered(coll, block, gathered, out, scale, backend) -> torch.Tensor:
    """The other ranks' gathered rows into the rest of ``out``; returns the finite flag
    (every gathered scale finite)."""
    g_codes, g_scales = unpack(gathered, block)
    m, n = g_codes.shape[1], out.numel()
    lo, hi = min(coll.rank * m, n), min((coll.rank + 1) * m, n)
    if lo > 0:
        dequantize(g_codes[: coll.rank], g_scales[: coll.rank], block, scale=scale,
                   numel=lo, out=out[:lo], backend=backend)  # fmt: skip
    if hi < n:
        dequantize(g_codes[coll.rank + 1 :], g_scales[coll.rank + 1 :], block, scale=scale,
                   numel=n - hi, out=out[hi:], backend=backend)  # fmt: skip
    return torch.isfinite(g_scales).all()


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
