"""int8 low-rank gradient compression (PowerSGD family), collective passed in.

Source: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (algorithm 1 with error feedback and warm start);
layout follows epfml/powersgd and torch's ``powerSGD_hook``. Differences from torch's hook:

* the factors P and Q travel through the int8 quantized all-reduce
  (:func:`~verl_comm.compression.int8_allreduce.int8_allreduce`), ~4x fewer bytes than fp32;
* same-shape matrices of a bucket are batched (one ``bmm`` per shape on CUDA, one all-reduce
  for all P factors of the bucket and one for all Q factors); on the CPU (products in the
  compute dtype) each matrix is instead worked on in place as a view of the bucket, one
  ``mm`` each, and ``P Q^T`` is formed once per row chunk for both the residual and the
  output: no stacked copy of the bucket, no bucket-sized temporary (issue 28, the *host
  chain*: 1.9 -> 1.4 s of CPU per reduction of SmolLM2-135M at r = 64, one thread);
* orthonormalisation is a batched shifted CholeskyQR2 with the r x r work in fp64 (two
  ``bmm`` + batched Cholesky + triangular solve, no per-column loop, no data-dependent
  branch, so no host sync); fp64 because real gradients are often numerically
  rank-deficient and an fp32 Gram matrix then fails Cholesky (see
  :func:`~verl_comm.compression.cholqr.orthonormalize`);
* tensors low rank would not shrink (0-dim, 1-dim, ``2r >= min(n, m)``, or
  ``n m < min_compression_rate * r (n + m)``) go together through ONE int8 all-reduce per
  bucket with their own error feedback (torch's hook raises on 0-dim tensors);
* the error-feedback residual may be stored in bf16 (half of torch's fp32 copy).

Per matrix ``M`` (n, m) of this rank, with error feedback ``M <- G + E``::

    P = M Q            (n, r)   -> int8 all-reduce (average) -> orthonormalise
    Q = M^T P          (m, r)   -> int8 all-reduce (average)
    M^ = P Q^T                  (the same on every rank: P, Q are bit-identical)
    E <- M - M^                 (error feedback residual, per rank)

Conv kernels (out, in, kh, kw) are viewed as (out, in * kh * kw).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cholqr import orthonormalize
from .collective import Collective
from .lowrank_apply import error_fed_matrices, finish_group
from .lowrank_call import LowRankBucketState, LowRankCall, reduce_payload
from .lowrank_host import finish_host, host_matrices
from .lowrank_plan import FactorWire, LowRankPlan, TensorSlot

__all__ = ["LowRankBucketState", "LowRankResult", "lowrank_int8_allreduce", "reduce_payload"]


@dataclass
class LowRankResult:
    """Result of :func:`lowrank_int8_allreduce` (see there)."""

    out: torch.Tensor
    wire_bytes: int
    finite: torch.Tensor
    error_sq: torch.Tensor | None
    input_sq: torch.Tensor | None


def _gather_rest(flat: torch.Tensor, rest: Sequence[TensorSlot]) -> torch.Tensor:
    if not rest:
        return flat.new_empty(0)
    return torch.cat([flat[s.offset : s.offset + s.numel] for s in rest])


def lowrank_int8_allreduce(
    flat: torch.Tensor,
    plan: LowRankPlan,
    state: LowRankBucketState,
    coll: Collective,
    *,
    block: int = 128,
    error_feedback: bool = True,
    warm_start: bool = True,
    residual_dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
    wire: FactorWire | None = None,
    keep: Sequence[tuple[int, int]] = (),
    stats: bool = True,
    matmul_dtype: torch.dtype | None = None,
) -> LowRankResult:
    """Average a flat bucket over the ranks with int8 low-rank compression.

    Per group ``M = G + E`` (in place in ``flat`` when ``out`` aliases a float32 ``flat``
    holding one matrix, else in one fp32 work buffer), ``P = M Q`` (one ``bmm`` per group),
    P of all groups in ONE payload, orthonormalise, ``Q = M^T P`` in one payload,
    ``E <- M - P Q^T`` (one ``baddbmm``), ``out = P Q^T``. On the CPU with products in the
    compute dtype (the host chain) every matrix is a view of ``out`` (``flat`` itself when
    they alias, else ``flat`` is copied into ``out`` first and left as it was), the
    products are one ``mm`` per matrix and ``A = P Q^T`` is formed once per row chunk:
    ``E <- M - A``, ``out <- A``. The rest (tensors low rank does not
    shrink) is one more payload with its own error feedback. With ``wire`` choosing one-call
    modes a bucket issues 2 collectives (+1 for a rest) instead of 6.

    Args:
        flat: ``(N,)`` float tensor, the bucket (tensors back to back as in ``plan``); float64
            runs the whole algorithm in float64 (the reference of the same algorithm).
        plan: :class:`LowRankPlan` of the bucket (``plan.numel == N``).
        state: this rank's :class:`LowRankBucketState`; created lazily, updated in place.
        coll: blocking :class:`~verl_comm.compression.collective.Collective`.
        block: int8 block size B for the int8 payloads.
        error_feedback: keep ``E = M - M^`` per rank and add it next step.
        warm_start: start the power iteration from last step's Q.
        residual_dtype: storage dtype of new residuals (fp32 or bf16; fp64 for fp64 ``flat``).
        generator: CPU generator for fresh Q (seeded identically on every rank).
        out: ``(N,)`` destination, may alias ``flat`` (default: new, fp32 or fp64 for fp64).
        wire: :class:`FactorWire` of P, Q and the rest (default: all int8).
        keep: ``(offset, numel)`` ranges that got no gradient this step: input taken as zero,
            residual left exactly as it was (issue 18: DDP does not apply the result to a
            parameter without a gradient, so sending its residual would lose it).
        stats: compute ``error_sq`` and ``input_sq`` (two more passes); None when False.
        matmul_dtype: dtype of the three matrix products; None = bf16 for fp32 on CUDA
            (tensor cores), else the compute dtype. Error feedback stays exact either way:
            the residual is taken against the approximation actually applied.

    Returns:
        :class:`LowRankResult`: ``out`` (the average approximation, bit-identical on all
        ranks), bytes sent, a 0-dim ``finite`` flag identical on all ranks, and this rank's
        ``error_sq = ||M - M^||^2`` and ``input_sq = ||M||^2`` (0-dim tensors or None).

    Raises:
        ValueError: ``flat`` does not have ``plan.numel`` elements.
    """
    wire = wire or FactorWire()
    c = _start(
        flat,
        plan,
        state,
        coll,
        out,
        block,
        error_feedback,
        residual_dtype,
        stats,
        keep,
        matmul_dtype,
    )
    # Rest: read before `out` (which may alias `flat`) is written.
    rest_in = _gather_rest(c.flat, plan.rest).to(c.cdt) if plan.rest else None
    if c.work is not None:  # host: every matrix a view of the work buffer, no stacking
        ms, skips = host_matrices(c)
    else:
        ms, kept, lows = error_fed_matrices(c)
    if plan.groups:
        ps, qs, q_prevs = _power_iteration(
            c, ms, wire, warm_start, generator, None if c.work is not None else lows
        )
        lows = None
        for gi in range(len(plan.groups)):
            if c.work is not None:
                finish_host(c, gi, ms[gi], ps[gi], qs[gi], q_prevs[gi], skips[gi])
            else:
                finish_group(c, gi, ms[gi], ps[gi], qs[gi], q_prevs[gi], kept[gi])
        del ms
    if plan.rest:
        _reduce_rest(c, rest_in, wire.rest)
    return LowRankResult(c.out, c.wire_total, c.finite, c.error_sq, c.input_sq)


def _start(
    flat: torch.Tensor,
    plan: LowRankPlan,
    state: LowRankBucketState,
    coll: Collective,
    out: torch.Tensor | None,
    block: int,
    error_feedback: bool,
    residual_dtype: torch.dtype,
    stats: bool,
    keep: Sequence[tuple[int, int]],
    matmul_dtype: torch.dtype | None,
) -> LowRankCall:
    """Check the bucket against the plan, size the state, pick the dtypes, zero the totals."""
    if flat.numel() != plan.numel:
        raise ValueError(
            f"bucket has {flat.numel()} elements but the plan expects {plan.numel}; rebuild "
            "the plan when the bucket layout changes"
        )
    dev = flat.device
    flat = flat.reshape(-1)
    cdt = torch.float64 if flat.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty(plan.numel, dtype=cdt, device=dev)
    if len(state.qs) != len(plan.groups):
        state.qs = [None] * len(plan.groups)
        state.residuals = [None] * len(plan.groups)
    # Matrix products in bf16 on CUDA (tensor cores; fp32 gemms were ~16 ms of a step
    # of 24 x 4096^2 at r = 128 on an H200): P and Q travel in int8/bf16 anyway, and
    # the applied approximation is exactly the bf16 product, so error feedback
    # (E = M - applied) stays exact. CPU and the float64 reference: compute dtype.
    gdt = matmul_dtype or (torch.bfloat16 if (dev.type == "cuda" and cdt == torch.float32) else cdt)
    work = None
    if dev.type == "cpu" and gdt == cdt:  # the host chain (lowrank_host.py)
        work = out if out.dtype == cdt else torch.empty(plan.numel, dtype=cdt, device=dev)
    return LowRankCall(
        flat=flat,
        out=out,
        plan=plan,
        state=state,
        coll=coll,
        block=block,
        error_feedback=error_feedback,
        residual_dtype=torch.float64 if cdt == torch.float64 else residual_dtype,
        stats=stats,
        cdt=cdt,
        gdt=gdt,
        in_place=out.data_ptr() == flat.data_ptr() and flat.dtype == cdt,
        work=work,
        keep_set={off for off, _ in keep},
        finite=torch.ones((), dtype=torch.bool, device=dev),
        error_sq=torch.zeros((), dtype=cdt, device=dev) if stats else None,
        input_sq=torch.zeros((), dtype=cdt, device=dev) if stats else None,
    )


def _power_iteration(
    c: LowRankCall,
    ms: list,
    wire: FactorWire,
    warm_start: bool,
    generator: torch.Generator | None,
    lows: list | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``P = M Q`` of all groups in one payload, averaged, orthonormalised; then
    ``Q = M^T P`` in one payload, averaged (``lows``: ``M`` in the product dtype where
    already made). Returns per group ``(P, Q, previous Q)``."""
    plan, cdt, gdt, dev = c.plan, c.cdt, c.gdt, c.flat.device
    p_all = torch.empty(plan.p_numel, dtype=cdt, device=dev)
    q_all = torch.empty(plan.q_numel, dtype=cdt, device=dev)
    ps, qs, q_prevs, po, qo = [], [], [], 0, 0
    lows = lows or [None] * len(ms)
    m_low = [
        mat if gdt == cdt or isinstance(mat, list) else (low if low is not None else mat.to(gdt))
        for mat, low in zip(ms, lows)
    ]
    for gi, g in enumerate(plan.groups):
        q_prev = c.state.qs[gi]
        if q_prev is None or not warm_start or q_prev.shape != (g.k, g.m, g.rank):
            q_prev = torch.randn(g.k, g.m, g.rank, generator=generator).to(dev, cdt)
        q_prevs.append(q_prev.to(cdt))
        p = p_all[po : po + g.k * g.n * g.rank].view(g.k, g.n, g.rank)
        if isinstance(ms[gi], list):  # host: one product per matrix view
            for i, mat in enumerate(ms[gi]):
                torch.mm(mat, q_prevs[-1][i], out=p[i])
        elif gdt == cdt:
            torch.bmm(ms[gi], q_prev.to(cdt), out=p)
        else:
            p.copy_(torch.bmm(m_low[gi], q_prev.to(gdt)))
        ps.append(p)
        qs.append(q_all[qo : qo + g.k * g.m * g.rank].view(g.k, g.m, g.rank))
        po, qo = po + p.numel(), qo + qs[-1].numel()
    c.reduce(p_all, wire.p)
    for gi in range(len(plan.groups)):
        ps[gi] = orthonormalize(ps[gi])
        if isinstance(ms[gi], list):
            for i, mat in enumerate(ms[gi]):
                torch.mm(mat.mT, ps[gi][i], out=qs[gi][i])
        elif gdt == cdt:
            torch.bmm(ms[gi].mT, ps[gi], out=qs[gi])
        else:
            qs[gi].copy_(torch.bmm(m_low[gi].mT, ps[gi].to(gdt)))
    del m_low
    c.reduce(q_all, wire.q)
    return ps, qs, q_prevs


def _reduce_rest(c: LowRankCall, rest_in: torch.Tensor, mode: str) -> None:
    """The tensors low rank does not shrink: one payload with its own error feedback
    (``keep`` slots: zero input, residual left as it was), copied to their slots of ``out``."""
    state, cdt, ef = c.state, c.cdt, c.error_feedback
    rr = state.rest_residual
    if ef and (rr is None or rr.numel() != rest_in.numel() or rr.dtype != c.residual_dtype):
        rr = torch.zeros(rest_in.numel(), dtype=c.residual_dtype, device=c.flat.device)
    saved_rest = []
    o = 0
    for s in c.plan.rest:
        if s.offset in c.keep_set:
            rest_in[o : o + s.numel].zero_()
            if ef:
                saved_rest.append((o, s.numel, rr[o : o + s.numel].clone()))
                rr[o : o + s.numel].zero_()
        o += s.numel
    if c.stats:
        extra = rr.to(cdt) if ef else 0
        c.input_sq = c.input_sq + (rest_in + extra).square().sum()
    c.reduce(rest_in, mode, residual=rr if ef else None)
    if ef:
        for o, n, old in saved_rest:
            rr[o : o + n].copy_(old)
        state.rest_residual = rr
        if c.stats:
            c.error_sq = c.error_sq + rr.to(cdt).square().sum()
    o = 0
    for s in c.plan.rest:
        c.out[s.offset : s.offset + s.numel].copy_(rest_in[o : o + s.numel])
        o += s.numel
