"""Hierarchical int8 all-reduce: int8 inside a host first, then int8 only across hosts.

Source: ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training", section 4.3: qgZ's hierarchical all-to-all reduces inside a node,
quantized, before anything crosses the slower inter-node link).

With W = H hosts x L ranks per host, the flat two-step int8 all-reduce
(:func:`~verl_comm.compression.int8_allreduce.int8_allreduce`) sends ``(W-1)/W`` of every
rank's codes through its all-to-all and all-gather, and where the ranks' ring is laid over
the hosts the cross-host hops carry the traffic of several ranks (4 gloo ranks over a shaped
1 Gbit/s veth, 2 per host: 1.77 N x 1.03 bytes per direction for N elements, 0.61x torch's
fp16 ring, see ``benchmarks/slow_link_hooks.sh``). Here (:func:`hier_int8_allreduce`), for
a bucket of N elements padded to L chunks of M:

1. inside the host (``intra``, L ranks): int8 rows with error feedback, an all-to-all, and
   the fp32 sum of chunk ``l`` at local rank ``l``;
2. across hosts (``inter``: the H ranks of local rank ``l``): the two-step int8 scheme on
   the host's average of that chunk, with its own error feedback;
3. inside the host: an all-gather of the packed codes and scales, dequantized by every rank.

Bytes across the link per host and direction: ``L * 2 (H-1)/H * M * (1 + 4/B)``, i.e.
``N (1 + 4/B)`` at H = 2 (about 0.35x the fp16 ring's for 2 x 2 ranks). The result is the
same bit for bit on every rank. Opt-in (``CompressionConfig.hierarchical``): on 2 x 2 ranks
sharing 2 cores it ran 1.04-1.10x the flat scheme's step (``benchmarks/results/
comm_hooks.md``, runs ``421f0825445b`` and ``92feb6e15978``): its extra quantization and
collectives cost more CPU there than the link time they save.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_comm.kernels import (
    dequant_sum_requant,
    dequantize,
    packed_nbytes,
    padded_numel,
    quantize,
    quantize_ef,
    unpack,
)

from .collective import Collective
from .int8_allreduce import ReduceResult, _owner


@dataclass(frozen=True)
class Hierarchy:
    """A process group seen as hosts x local ranks.

    Attributes:
        intra: the collective over this rank's host (L ranks; ``intra.rank`` is the local
            rank ``l``).
        inter: the collective over the ranks of local rank ``l`` on every host (H ranks).
    """

    intra: Collective
    inter: Collective

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent over both collectives (payload, ring formulas)."""
        return self.intra.bytes_sent + self.inter.bytes_sent


def chunk_numel(numel: int, hier: Hierarchy, block: int = 128) -> int:
    """M, elements of one local rank's chunk: ``N`` padded to a multiple of ``L * H * block``,
    divided by L (so the int8 step across hosts pads nothing)."""
    lw, hw = hier.intra.world_size, hier.inter.world_size
    return padded_numel(numel, block, multiple=lw * hw) // lw


def hier_int8_allreduce_wire_bytes(numel: int, hier: Hierarchy, block: int = 128) -> int:
    """Bytes one rank sends in :func:`hier_int8_allreduce` (both levels), 0 for N = 0."""
    if numel == 0:
        return 0
    lw, hw = hier.intra.world_size, hier.inter.world_size
    m = chunk_numel(numel, hier, block)
    sub = packed_nbytes(m // hw, block)
    # inside: all-to-all (L-1)/L x L packed chunks, all-gather (L-1) x H packed sub-chunks;
    # across: all-to-all (H-1)/H x H packed sub-chunks, all-gather (H-1) x one
    return (lw - 1) * packed_nbytes(m, block) + (lw - 1) * hw * sub + 2 * (hw - 1) * sub


def hier_int8_allreduce(
    x: torch.Tensor,
    hier: Hierarchy,
    *,
    block: int = 128,
    residual: torch.Tensor | None = None,
    host_residual: torch.Tensor | None = None,
    average: bool = True,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> ReduceResult:
    """Sum (or average) a flat tensor over the L x H ranks of ``hier``, int8 on every hop.

    Steps, for this rank's local rank ``l`` (chunks of M elements, :func:`chunk_numel`, each
    H sub-chunks of whole blocks):

    1. inside the host: ``quantize_ef`` of ``x`` (error feedback into ``residual``, as the
       flat scheme) into L packed rows, an all-to-all, and the fp32 sum of the L received
       rows (``dequant_sum_requant``'s sum): this host's sum of chunk ``l``;
    2. across hosts, the two-step int8 scheme on that chunk: ``quantize_ef`` of the host's
       average (error feedback into ``host_residual``) into H packed sub-chunks, an
       all-to-all, the owner's ``dequant_sum_requant``, an all-gather of the packed
       requantized sub-chunks;
    3. inside the host: an all-gather of those packed codes and scales; every rank
       dequantizes all L chunks, so the result is the same bit for bit everywhere, and the
       finiteness verdict is read from all scales.

    Three quantizations where the flat scheme has two; the first two are fed back, the
    owner's is not (as in the flat scheme). ``residual`` has the flat scheme's shape and
    meaning, so a flat step and a hierarchical one can follow each other.

    Args:
        x: contiguous ``(N,)`` fp32/bf16/fp16 tensor, this rank's contribution (not
            modified unless ``out`` aliases it).
        hier: the :class:`Hierarchy` (blocking collectives; the same on every rank of a host).
        block: quantization block B in {32, 64, 128, 256}.
        residual: optional ``(N,)`` error-feedback residual (``x``'s dtype, fp32, or bf16
            for fp32 ``x``), updated in place; None disables error feedback.
        host_residual: optional ``(M,)`` residual of this rank's chunk of the host's
            average (fp32 or bf16), updated in place; None: that quantization's error is
            not fed back.
        average: divide the sum by W.
        out: optional contiguous ``(N,)`` float tensor for the result (may alias ``x``).
        backend: the kernel launchers' (``"auto"``; tests pass ``"triton"``).

    Returns:
        :class:`ReduceResult`: ``out`` (fp32 by default), identical bit for bit on every
        rank; ``wire_bytes`` sent by this rank over both levels; ``finite`` False on every
        rank if any rank's input held NaN/Inf.

    Raises:
        ValueError / TypeError: from the kernel launchers on bad dtype, shape or block.
    """
    n = x.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n == 0:
        return ReduceResult(out, 0, torch.ones((), dtype=torch.bool, device=x.device))
    x = x.reshape(-1)
    intra, inter = hier.intra, hier.inter
    lw, hw = intra.world_size, inter.world_size
    sent0 = hier.bytes_sent
    m = chunk_numel(n, hier, block)
    sub = m // hw
    dev = x.device
    # 1. int8 reduce-scatter inside the host
    send = torch.empty(lw, packed_nbytes(m, block), dtype=torch.uint8, device=dev)
    rows = unpack(send, block)
    if residual is None:
        quantize(x, block, pad_to=lw * m, out=rows, backend=backend)
    else:
        quantize_ef(x, residual.view(-1), block, pad_to=lw * m, out=rows, backend=backend)
    recv = torch.empty_like(send)
    intra.all_to_all_single(recv.view(-1), send.view(-1))
    del send, rows
    rc, rs = unpack(recv, block)
    *_, host = dequant_sum_requant(rc, rs, block, return_sum=True, backend=backend)
    del recv, rc, rs
    # 2. int8 across hosts: the host's average, requantized into H packed sub-chunks
    if average and lw > 1:
        host.mul_(1.0 / lw)
    scale = 1.0 / hw if average else 1.0
    send = torch.empty(hw, packed_nbytes(sub, block), dtype=torch.uint8, device=dev)
    if host_residual is None:
        quantize(host, block, pad_to=m, out=unpack(send, block), backend=backend)
    else:
        quantize_ef(host, host_residual.view(-1), block, out=unpack(send, block), backend=backend)
    del host
    recv = torch.empty_like(send)
    inter.all_to_all_single(recv.view(-1), send.view(-1))
    del send
    # out[:0]: the owner's pass dequantizes nothing here (every rank does it after step 3)
    gathered, _ = _owner(inter, block, recv, out[:0], scale, backend, wait=True)
    del recv
    # 3. all-gather of the packed (H, .) rows inside the host, dequantized by every rank
    every = torch.empty(lw, gathered.numel(), dtype=torch.uint8, device=dev)
    intra.all_gather_into_tensor(every.view(-1), gathered.view(-1))
    del gathered
    codes, scales = unpack(every.view(lw * hw, -1), block)
    dequantize(codes, scales, block, scale=scale, numel=n, out=out, backend=backend)
    return ReduceResult(out, hier.bytes_sent - sent0, torch.isfinite(scales).all())
