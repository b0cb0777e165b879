"""Per-call state of the low-rank all-reduce (:func:`~verl_comm.compression.lowrank.
lowrank_int8_allreduce`) and its payload reduction, shared by its host chain
(:mod:`.lowrank_host`) and its device chain (:mod:`.lowrank_apply`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .collective import Collective
from .int8_allreduce import all_finite, int8_allreduce
from .lowrank_plan import LowRankPlan


@dataclass
class LowRankBucketState:
    """Per-bucket state of the low-rank compressor (one per rank, not shared).

    Attributes:
        qs: per group, the ``(k, m, r)`` Q of the last step (warm start), or None.
        residuals: per group, the ``(k, n, m)`` error-feedback residual, or None.
        rest_residual: ``(rest_numel,)`` residual of the int8-sent tensors, or None.
    """

    qs: list[torch.Tensor | None] = field(default_factory=list)
    residuals: list[torch.Tensor | None] = field(default_factory=list)
    rest_residual: torch.Tensor | None = None


def reduce_payload(
    x: torch.Tensor,
    coll: Collective,
    mode: str,
    *,
    block: int,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Average flat ``x`` over the ranks in wire ``mode`` (see :data:`~verl_comm.compression.lowrank_plan.WIRE_MODES`).

    ``x`` is overwritten with the average (bit-identical on every rank). ``residual`` (int8
    mode only) carries error feedback; the one-call modes are exact (fp32, ``exact``) or lose
    at most bf16 rounding, which the caller's error feedback captures for the factors.

    Returns:
        ``(x, bytes sent, 0-dim finite flag)``.
    """
    w = coll.world_size
    if mode == "int8":
        r = int8_allreduce(x, coll, block=block, residual=residual, out=x)
        return x, r.wire_bytes, r.finite
    wire = {"bf16": torch.bfloat16, "fp32": torch.float32, "exact": x.dtype}[mode]
    if residual is not None:  # carried error is sent in full by an exact all-reduce
        x.add_(residual.view(-1).to(x.dtype))
        residual.zero_()
    buf = x if wire == x.dtype else x.to(wire)
    if w > 1:
        buf.div_(w)
    sent0 = coll.bytes_sent
    coll.all_reduce(buf)
    if buf is not x:
        x.copy_(buf)
    return x, coll.bytes_sent - sent0, all_finite(buf)


@dataclass
class LowRankCall:
    """One call of :func:`~verl_comm.compression.lowrank.lowrank_int8_allreduce`: what its
    steps share, running totals."""

    flat: torch.Tensor
    out: torch.Tensor
    plan: LowRankPlan
    state: LowRankBucketState
    coll: Collective
    block: int
    error_feedback: bool
    residual_dtype: torch.dtype
    stats: bool
    cdt: torch.dtype
    gdt: torch.dtype
    in_place: bool
    work: torch.Tensor | None
    keep_set: set[int]
    finite: torch.Tensor
    error_sq: torch.Tensor | None
    input_sq: torch.Tensor | None
    wire_total: int = 0
    fed: set[int] = field(default_factory=set)  # groups whose M = G + E is formed when applied

    def reduce(self, x: torch.Tensor, mode: str, residual: torch.Tensor | None = None) -> None:
        """Average payload ``x`` in place (:func:`reduce_payload`); count bytes and finiteness."""
        _, wb, ok = reduce_payload(x, self.coll, mode, block=self.block, residual=residual)
        self.wire_total += wb
        self.finite = self.finite & ok


def store_q(state: LowRankBucketState, gi: int, q: torch.Tensor, q_prev: torch.Tensor) -> None:
    """Keep group ``gi``'s Q for the next warm start. A matrix that is zero on every rank
    (its parameter unused everywhere this step) gets Q = M^T P = 0, and a zero warm start
    would stay zero for ever (P = M 0): keep its previous Q instead (per matrix, on the
    device, no sync)."""
    q_keep = torch.where(q.abs().amax(dim=(-2, -1), keepdim=True) > 0, q, q_prev)
    if state.qs[gi] is not None and state.qs[gi].shape == q.shape:
        state.qs[gi].copy_(q_keep)  # in place: a captured CUDA graph reads this tensor
    else:
        state.qs[gi] = q_keep.clone()
