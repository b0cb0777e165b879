"""The device chain of the low-rank all-reduce (stacked ``(k, n, m)`` matrices, ``bmm``; on
CUDA the products in bf16): the error-fed matrices before the power iteration, and the
residual, warm-start Q and output after it (one fused pass for a single matrix:
:func:`verl_comm.kernels.ef.ef_apply`)."""

from __future__ import annotations

import torch

from verl_comm.kernels.ef import ef_add_cast, ef_apply

from .lowrank_call import LowRankCall, store_q
from .lowrank_plan import MatrixGroup


def error_fed_matrices(
    c: LowRankCall,
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
            if _fused(c, g) and not c.stats:  # only M's bf16 copy; M is formed when applied
                low = ef_add_cast(mat, res, c.gdt, update=False)
                c.fed.add(gi)
            elif c.gdt != c.cdt:  # M and its product-dtype copy in one pass (CUDA: one kernel)
                low = ef_add_cast(mat, res, c.gdt)
            else:
                mat += res
        kept.append(saved)
        ms.append(mat)
        lows.append(low)
        if c.stats:
            c.input_sq = c.input_sq + mat.square().sum()
    return ms, kept, lows


def finish_group(
    c: LowRankCall,
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
    if _fused(c, g) or gi in c.fed:
        _apply_fused(c, gi, mat[0], p[0], q[0], kept)
        store_q(state, gi, q, q_prev)
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
    store_q(state, gi, q, q_prev)
    out = c.out
    if approx is None and g.k == 1 and (c.in_place or out.dtype == cdt):
        s0 = g.slots[0]
        torch.bmm(p, q.mT, out=out[s0.offset : s0.offset + s0.numel].view(1, g.n, g.m))
    else:
        if approx is None:
            approx = torch.bmm(p, q.mT)
        for i, s in enumerate(g.slots):
            out[s.offset : s.offset + s.numel].view(g.n, g.m).copy_(approx[i])


def _fused(c: LowRankCall, g: MatrixGroup) -> bool:
    """Whether group ``g`` is applied by :func:`_apply_fused`: one matrix with products in
    bf16 on fp32 (CUDA). Without statistics its ``M = G + E`` is then never stored: the
    error-feedback pass writes only M's bf16 copy, and the apply pass forms ``G + E`` again
    (the same fp32 sum) before it overwrites E (20 instead of 22 bytes per element)."""
    return c.cdt == torch.float32 and c.gdt == torch.bfloat16 and g.k == 1


def _apply_fused(
    c: LowRankCall,
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
    fed = gi in c.fed  # mat holds G, the residual E: M = G + E is formed in the pass
    ef_apply(mat, p.to(c.gdt), q.to(c.gdt), target, out, add_residual=fed)
    if c.stats:
        c.error_sq = c.error_sq + target.square().sum()
        if res is not None:
            res[0].copy_(target)
    for i, old in kept:
        res[i].copy_(old)
