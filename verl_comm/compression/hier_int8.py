"""Hierarchical int8 all-reduce: full precision inside a host, int8 only across hosts.

Source: ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for
Giant Model Training", section 4.3: qgZ's hierarchical all-to-all reduces inside a node
before anything crosses the slower inter-node link).

With W = H hosts x L ranks per host, the flat two-step int8 all-reduce
(:func:`~verl_comm.compression.int8_allreduce.int8_allreduce`) sends ``(W-1)/W`` of every
rank's codes across the ranks' ring and all-to-all, and on a ring laid over the hosts the
cross-host hops carry the traffic of several ranks (4 gloo ranks over a shaped 1 Gbit/s veth,
2 per host: 1.77 N x 1.03 bytes per direction for N elements, 0.61x torch's fp16 ring, see
``benchmarks/slow_link_hooks.sh``). Here, for a bucket of N elements padded to ``L * M``:

1. inside the host (``intra``, L ranks, fp32): an all-to-all of the ``(L, M)`` rows and a
   local sum give local rank ``l`` the host's sum of chunk ``l`` (a reduce-scatter; gloo has
   no ``reduce_scatter_tensor``), divided by L;
2. across hosts (``inter``: the H ranks of local rank ``l``): the int8 all-reduce of that
   chunk, averaged over H, with error feedback on the chunk's host sum;
3. inside the host: an all-gather of the L reduced chunks (fp32), in place.

Bytes across the link per host and direction: ``L * 2 (H-1)/H * M * (1 + 4/B)``, i.e.
``N (1 + 4/B)`` at H = 2 (0.35x the fp16 ring's for 2 x 2 ranks). The result is the same
bit for bit on every rank: each chunk is reduced by the H ranks of one local index (which
agree bit for bit, :func:`int8_allreduce`) and copied by the all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_comm.kernels import padded_numel

from .collective import Collective
from .int8_allreduce import ReduceResult, int8_allreduce


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
    def world_size(self) -> int:
        """W = L x H."""
        return self.intra.world_size * self.inter.world_size

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent over both collectives (payload, ring formulas)."""
        return self.intra.bytes_sent + self.inter.bytes_sent


def chunk_numel(numel: int, hier: Hierarchy, block: int = 128) -> int:
    """M, elements of one local rank's chunk: ``N`` padded to a multiple of ``L * H * block``,
    divided by L (so the int8 step across hosts pads nothing)."""
    lw, hw = hier.intra.world_size, hier.inter.world_size
    return padded_numel(numel, block, multiple=lw * hw) // lw


def owned_span(numel: int, hier: Hierarchy, block: int = 128) -> tuple[int, int]:
    """``[lo, hi)``: the elements of ``(N,)`` whose error-feedback residual this rank keeps
    (its chunk, clipped to N)."""
    m = chunk_numel(numel, hier, block)
    lo = min(hier.intra.rank * m, numel)
    return lo, min(lo + m, numel)


def hier_int8_allreduce_wire_bytes(numel: int, hier: Hierarchy, block: int = 128) -> int:
    """Bytes one rank sends in :func:`hier_int8_allreduce` (both levels), 0 for N = 0."""
    from .int8_allreduce import int8_allreduce_wire_bytes

    if numel == 0:
        return 0
    lw, hw = hier.intra.world_size, hier.inter.world_size
    m = chunk_numel(numel, hier, block)
    # all-to-all (L-1)/L x L*M fp32; all-gather (L-1) x (M + 1) fp32 (the verdict element)
    intra = (lw - 1) * m * 4 + (lw - 1) * (m + 1) * 4
    return intra + int8_allreduce_wire_bytes(m, hw, block)


def hier_int8_allreduce(
    x: torch.Tensor,
    hier: Hierarchy,
    *,
    block: int = 128,
    residual: torch.Tensor | None = None,
    fold_residual: bool = True,
    average: bool = True,
    out: torch.Tensor | None = None,
) -> ReduceResult:
    """Sum (or average) a flat tensor over the L x H ranks of ``hier``, int8 across hosts.

    Args:
        x: contiguous ``(N,)`` fp32/bf16/fp16 tensor, this rank's contribution (not
            modified unless ``out`` aliases it).
        hier: the :class:`Hierarchy` (blocking collectives; the same on every rank of a host).
        block: quantization block B in {32, 64, 128, 256}.
        residual: optional ``(N,)`` error-feedback residual (fp32, bf16, or ``x``'s dtype).
            Its span :func:`owned_span` holds the error of this host's reduction of the
            chunk, in units of one rank's gradient (as the flat scheme's residual: it can be
            added to this rank's input), updated in place; None disables error feedback.
        fold_residual: whether the residual outside the owned span may be non-zero (error
            left by a flat int8 step): it is then added to this rank's contribution and
            zeroed, so no error is dropped. False skips that pass (the caller knows it is
            zero).
        average: divide the sum by W.
        out: optional contiguous ``(N,)`` float tensor for the result (may alias ``x``).

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
    lw, lr = intra.world_size, intra.rank
    sent0 = hier.bytes_sent
    m = chunk_numel(n, hier, block)
    lo, hi = owned_span(n, hier, block)
    # 1. reduce-scatter inside the host: rows of an (L, M) fp32 buffer, padded with zeros
    send = torch.zeros(lw, m, dtype=torch.float32, device=x.device)
    flat = send.view(-1)
    flat[:n].copy_(x)
    if residual is not None and fold_residual:  # a flat step's error outside the span
        for a, b in ((0, lo), (hi, n)):
            if b > a:
                flat[a:b].add_(residual[a:b].float())
                residual[a:b].zero_()
    recv = torch.empty_like(send)
    intra.all_to_all_single(recv.view(-1), flat)
    del send, flat
    chunk = recv.sum(0)
    del recv
    if average and lw > 1:
        chunk.mul_(1.0 / lw)
    # 2. int8 across hosts, into this rank's row of the all-gather buffer; one extra element
    # per row carries the row's verdict (0 or NaN), so every rank reads the same verdict
    gathered = torch.empty(lw, m + 1, dtype=torch.float32, device=x.device)
    row = gathered[lr]
    # the residual is kept in this rank's units (an error e of the host's average is L e of
    # one rank's gradient), so a flat step and a hierarchical one can follow each other
    unit = float(lw) if average else 1.0
    res = None
    if residual is not None:
        res = torch.zeros(m, dtype=torch.float32, device=x.device)
        res[: hi - lo].copy_(residual[lo:hi]).mul_(1.0 / unit)
    r = int8_allreduce(chunk, inter, block=block, residual=res, average=average, out=row[:m])
    if res is not None:
        residual[lo:hi].copy_(res[: hi - lo].mul_(unit))
    row[m:].copy_(torch.where(r.finite, 0.0, float("nan")))
    # 3. all-gather inside the host (in place: the input is this rank's row)
    intra.all_gather_into_tensor(gathered.view(-1), row)
    for j in range(lw):
        a = min(j * m, n)
        b = min(a + m, n)
        if b > a:
            out[a:b].copy_(gathered[j, : b - a])
    finite = torch.isfinite(gathered[:, m]).all()
    return ReduceResult(out, hier.bytes_sent - sent0, finite)
