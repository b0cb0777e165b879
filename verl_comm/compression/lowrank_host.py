"""The host chain of the low-rank all-reduce (CPU, products in the compute dtype): every
matrix is worked on in place as a view of the work buffer, one ``mm`` each, and ``P Q^T`` is
formed once per row chunk for both the residual and the output (issue 28: no stacked copy
of the bucket, no bucket-sized temporary)."""

from __future__ import annotations

import torch

from .lowrank_call import LowRankCall, store_q
from .lowrank_plan import MatrixGroup

HOST_CHUNK_NUMEL = 1 << 17
"""Host chain: elements of one row chunk of a matrix (512 KiB in fp32), the unit in which a
16-bit residual is widened and added, and ``P Q^T`` is formed, subtracted and written."""


def _rows(g: MatrixGroup) -> int:
    """Rows of one host chunk of the group's (n, m) matrices."""
    return max(1, min(g.n, HOST_CHUNK_NUMEL // g.m))


def host_matrices(c: LowRankCall) -> tuple[list[list[torch.Tensor]], list[set[int]]]:
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


def finish_host(
    c: LowRankCall,
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
    store_q(state, gi, q, q_prev)
    if c.out.data_ptr() != c.work.data_ptr():
        for mat, s in zip(mats, g.slots):
            c.out[s.offset : s.offset + s.numel].view(g.n, g.m).copy_(mat)
