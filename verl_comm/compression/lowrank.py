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
from dataclasses import dataclass, field

import torch

from verl_comm.kernels.ef import ef_add_cast, ef_apply

from .cholqr import orthonormalize
from .collective import Collective
from .int8_allreduce import all_finite, int8_allreduce
from .lowrank_plan import FactorWire, LowRankPlan, MatrixGroup, TensorSlot


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
        ms, skips = _host_matrices(c)
    else:
        ms, kept, lows = _error_fed_matrices(c)
    if plan.groups:
        ps, qs, q_prevs = _power_iteration(
            c, ms, wire, warm_start, generator, None if c.work is not None else lows
        )
        lows = None
        for gi in range(len(plan.groups)):
            if c.work is not None:
                _finish_host(c, gi, ms[gi], ps[gi], qs[gi], q_prevs[gi], skips[gi])
            else:
                _finish_group(c, gi, ms[gi], ps[gi], qs[gi], q_prevs[gi], kept[gi])
        del ms
    if plan.rest:
        _reduce_rest(c, rest_in, wire.rest)
    return LowRankResult(c.out, c.wire_total, c.finite, c.error_sq, c.input_sq)


@dataclass
class _Call:
    """One call of :func:`lowrank_int8_allreduce`: what its steps share, running totals."""

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

    def reduce(self, x: torch.Tensor, mode: str, residual: torch.Tensor | None = None) -> None:
        """Average payload ``x`` in place (:func:`reduce_payload`); count bytes and finiteness."""
        _, wb, ok = reduce_payload(x, self.coll, mode, block=self.block, residual=residual)
        self.wire_total += wb
        self.finite = self.finite & ok


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
) -> _Call:
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
    if dev.type == "cpu" and gdt == cdt:  # the host chain (see _host_matrices)
        work = out if out.dtype == cdt else torch.empty(plan.numel, dtype=cdt, device=dev)
    return _Call(
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


def _error_fed_matrices(
    c: _Call,
) -> tuple[list[torch.Tensor], list[list[tuple[int, torch.Tensor]]], list[torch.Tensor | None]]:
    """``M = G + E`` per group, ``(k, n, m)`` in the compute dtype (a view of the bucket when
    in place with k = 1). Slots in ``keep`` get a zero input and their residual rows are
    saved, returned per group as ``(index, residual)`` to be put back after the step. Third:
    per group ``M`` in the product dtype when it came out of the same pass (CUDA, with a
    residual: :func:`verl_comm.kernels.ef.ef_add_cast`), else None."""
    dev = c.flat.device
    ms: list[torch.Tensor] = []
    kept: list[list[tuple[int, torch.Tensor]]] = []
    lows: list[torch.Tensor | None] = []
    for gi, g in enumerate(c.plan.groups):
        res = c.state.residuals[gi] if c.error_feedback else None
        if res is not None and (res.shape != (g.k, g.n, g.m) or res.device != dev):
            res = None
        if c.in_place and g.k == 1:
            s0 = g.slots[0]
            mat = c.flat[s0.offset : s0.offset + s0.numel].view(1, g.n, g.m)
        else:
            mat = torch.empty(g.k, g.n, g.m, dtype=c.cdt, device=dev)
            for i, s in enumerate(g.slots):
                mat[i].copy_(c.flat[s.offset : s.offset + s.numel].view(g.n, g.m))
        saved = []
        for i, s in enumerate(g.slots):
            if s.offset in c.keep_set:
                mat[i].zero_()
                if res is not None:
                    saved.append((i, res[i].clone()))
        low = None
        if res is not None:
            if saved:
                for i, _ in saved:
                    res[i].zero_()
            if c.gdt != c.cdt:  # M and its product-dtype copy in one pass (CUDA: one kernel)
                low = ef_add_cast(mat, res, c.gdt)
            else:
                mat += res
        kept.append(saved)
        ms.append(mat)
        lows.append(low)
        if c.stats:
            c.input_sq = c.input_sq + mat.square().sum()
    return ms, kept, lows


HOST_CHUNK_NUMEL = 1 << 17
"""Host chain: elements of one row chunk of a matrix (512 KiB in fp32), the unit in which a
16-bit residual is widened and added, and ``P Q^T`` is formed, subtracted and written."""


def _rows(g: MatrixGroup) -> int:
    """Rows of one host chunk of the group's (n, m) matrices."""
    return max(1, min(g.n, HOST_CHUNK_NUMEL // g.m))


def _host_matrices(c: _Call) -> tuple[list[list[torch.Tensor]], list[set[int]]]:
    """Host chain: ``M = G + E`` per matrix, in place in the work buffer (the bucket itself
    when ``out`` aliases a compute-dtype ``flat``, else ``out``), returned per group as the
    matrices' ``(n, m)`` views: nothing is stacked, so no copy of the bucket in and out of
    a work buffer, and a 16-bit residual is widened a row chunk at a time (a mixed-dtype
    ``add_`` on the CPU first converts its whole operand). Slots in ``keep``: zero input,
    their indices returned per group (their residual is not read or written)."""
    dev, work = c.flat.device, c.work
    assert work is not None
    ms: list[list[torch.Tensor]] = []
    skips: list[set[int]] = []
    for gi, g in enumerate(c.plan.groups):
        res = c.state.residuals[gi] if c.error_feedback else None
        if res is not None and (res.shape != (g.k, g.n, g.m) or res.device != dev):
            res = None
        rows, mats, skip = _rows(g), [], set()
        for i, s in enumerate(g.slots):
            mat = work[s.offset : s.offset + s.numel].view(g.n, g.m)
            if s.offset in c.keep_set:
                mat.zero_()
                skip.add(i)
            else:
                if work.data_ptr() != c.flat.data_ptr():
                    mat.copy_(c.flat[s.offset : s.offset + s.numel].view(g.n, g.m))
                if res is not None and res.dtype == mat.dtype:
                    mat.add_(res[i])
                elif res is not None:
                    for r0 in range(0, g.n, rows):
                        mat[r0 : r0 + rows].add_(res[i, r0 : r0 + rows])
                if c.stats:
                    c.input_sq = c.input_sq + mat.square().sum()
            mats.append(mat)
        ms.append(mats)
        skips.append(skip)
    return ms, skips


def _power_iteration(
    c: _Call,
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


def _finish_group(
    c: _Call,
    gi: int,
    mat: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    q_prev: torch.Tensor,
    kept: list[tuple[int, torch.Tensor]],
) -> None:
    """Group ``gi`` after both payloads: residual ``E = M - P Q^T`` (kept rows put back),
    the warm-start Q stored, ``P Q^T`` written to the group's slots of ``out``."""
    g, state, cdt, gdt = c.plan.groups[gi], c.state, c.cdt, c.gdt
    if cdt == torch.float32 and gdt == torch.bfloat16 and g.k == 1:
        _apply_fused(c, gi, mat[0], p[0], q[0], kept)
        _store_q(state, gi, q, q_prev)
        return
    approx = None if gdt == cdt else torch.bmm(p.to(gdt), q.mT.to(gdt))
    if c.error_feedback or c.stats:
        # E = M - applied approximation (M is ours: the bucket or the work buffer)
        res = state.residuals[gi] if c.error_feedback else None
        if res is None or res.shape != mat.shape or res.dtype != c.residual_dtype:
            res = None
        if approx is None:
            err = mat.baddbmm_(p, q.mT, beta=1.0, alpha=-1.0)
        elif res is not None and not c.stats:
            err = torch.sub(mat, approx, out=res)  # one pass, straight to storage
        else:
            err = mat.sub_(approx)
        if c.stats:
            c.error_sq = c.error_sq + err.float().square().sum()
        if c.error_feedback:
            if res is None:
                state.residuals[gi] = err.to(c.residual_dtype, copy=True)
            elif err is not res:
                res.copy_(err)
            for i, old in kept:
                state.residuals[gi][i].copy_(old)
        del err
    _store_q(state, gi, q, q_prev)
    out = c.out
    if approx is None and g.k == 1 and (c.in_place or out.dtype == cdt):
        s0 = g.slots[0]
        torch.bmm(p, q.mT, out=out[s0.offset : s0.offset + s0.numel].view(1, g.n, g.m))
    else:
        if approx is None:
            approx = torch.bmm(p, q.mT)
        for i, s in enumerate(g.slots):
            out[s.offset : s.offset + s.numel].view(g.n, g.m).copy_(approx[i])


def _apply_fused(
    c: _Call,
    gi: int,
    mat: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    kept: list[tuple[int, torch.Tensor]],
) -> None:
    """One matrix (k = 1) with products in the lower dtype: ``A = P Q^T``, ``E = M - A``
    and ``A`` written to the group's slot of ``out`` in one pass
    (:func:`verl_comm.kernels.ef.ef_apply`; torch operations on the CPU). With statistics
    the residual goes through an fp32 buffer first, so the output and the stored residual
    are those of a step without statistics."""
    g, state = c.plan.groups[gi], c.state
    s0 = g.slots[0]
    out = c.out[s0.offset : s0.offset + s0.numel]
    res = state.residuals[gi] if c.error_feedback else None
    if c.error_feedback and (
        res is None or res.shape != (1, g.n, g.m) or res.dtype != c.residual_dtype
    ):
        res = state.residuals[gi] = torch.empty(
            1, g.n, g.m, dtype=c.residual_dtype, device=mat.device
        )
    target = torch.empty_like(mat) if c.stats else (None if res is None else res[0])
    ef_apply(mat, p, q, target, out, low_dtype=c.gdt)
    if c.stats:
        c.error_sq = c.error_sq + target.square().sum()
        if res is not None:
            res[0].copy_(target)
    for i, old in kept:
        res[i].copy_(old)


def _store_q(state: LowRankBucketState, gi: int, q: torch.Tensor, q_prev: torch.Tensor) -> None:
    """Keep group ``gi``'s Q for the next warm start. A matrix that is zero on every rank
    (its parameter unused everywhere this step) gets Q = M^T P = 0, and a zero warm start
    would stay zero for ever (P = M 0): keep its previous Q instead (per matrix, on the
    device, no sync)."""
    q_keep = torch.where(q.abs().amax(dim=(-2, -1), keepdim=True) > 0, q, q_prev)
    if state.qs[gi] is not None and state.qs[gi].shape == q.shape:
        state.qs[gi].copy_(q_keep)  # in place: a captured CUDA graph reads this tensor
    else:
        state.qs[gi] = q_keep.clone()


def _finish_host(
    c: _Call,
    gi: int,
    mats: list[torch.Tensor],
    p: torch.Tensor,
    q: torch.Tensor,
    q_prev: torch.Tensor,
    skip: set[int],
) -> None:
    """Host chain, group ``gi`` after both payloads: per row chunk of each matrix, ``A = P
    Q^T`` once (one product, not one for the residual and one for the output), ``E = M - A``
    into the residual (slots in ``skip`` keep theirs), ``A`` over ``M`` in the work buffer;
    the warm-start Q stored; the matrices copied to ``out`` when it is not the work buffer."""
    g, state, cdt, dev = c.plan.groups[gi], c.state, c.cdt, c.flat.device
    res = state.residuals[gi] if c.error_feedback else None
    if c.error_feedback and (
        res is None
        or res.shape != (g.k, g.n, g.m)
        or res.dtype != c.residual_dtype
        or res.device != dev
    ):
        old, res = res, torch.zeros(g.k, g.n, g.m, dtype=c.residual_dtype, device=dev)
        if old is not None and old.shape == res.shape:
            for i in skip:
                res[i].copy_(old[i])
        state.residuals[gi] = res
    rows = _rows(g)
    a_buf = torch.empty(rows * g.m, dtype=cdt, device=dev)
    for i, mat in enumerate(mats):
        store = res is not None and i not in skip
        for r0 in range(0, g.n, rows):
            m = mat[r0 : r0 + rows]
            a = a_buf[: m.numel()].view(m.shape)
            torch.mm(p[i, r0 : r0 + rows], q[i].mT, out=a)
            if c.stats:
                m.sub_(a)
                c.error_sq = c.error_sq + m.square().sum()
                if store:
                    res[i, r0 : r0 + rows].copy_(m)
            elif store:
                torch.sub(m, a, out=res[i, r0 : r0 + rows])
            m.copy_(a)
    _store_q(state, gi, q, q_prev)
    if c.out.data_ptr() != c.work.data_ptr():
        for mat, s in zip(mats, g.slots):
            c.out[s.offset : s.offset + s.numel].view(g.n, g.m).copy_(mat)


def _reduce_rest(c: _Call, rest_in: torch.Tensor, mode: str) -> None:
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
