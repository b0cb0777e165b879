"""One-pass error-feedback steps of CUDA low rank (issue 28: low rank r128 against PowerSGD).

Low rank on CUDA multiplies in bf16 and keeps the bucket, ``M = G + E``, in fp32 with a
16-bit residual ``E``. In torch each step around the two products was two elementwise
passes over the whole matrix, the first of each a mixed-dtype kernel without vector access
(``benchmarks/gpu/hooks_profile.py``: 71 us per 4096 x 4096 matrix on an H100):

* before: ``M += E`` then ``M_low = M.to(bf16)``  ->  :func:`ef_add_cast`, one pass;
* after: ``A = P Q^T`` (``torch.bmm`` in bf16, written out), ``E = M - A``
  (``torch.sub(M, A, out=E)``) then ``out = A`` (``copy_``)  ->  :func:`ef_apply`, the
  product formed per tile inside the pass that writes ``E`` and ``out``.

:func:`ef_add_cast` has the bits of the torch operations it replaces: the sums in fp32
(torch's common dtype of fp32 and bf16), each result rounded once to nearest even into its
destination's dtype. :func:`ef_apply` keeps ``A`` in fp32 (the old path rounded it to bf16
before applying it); its sums run in another order than cuBLAS's. ``backend`` as :mod:`verl_comm.kernels.ops` (``auto``: Triton on
CUDA, the torch operations on CPU).
"""

from __future__ import annotations

import torch

from .cast import TILE, WARPS, _check, _launches
from .ops import _INT32_LIMIT, _on_device, _use_triton


def _same(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    _check(name, t)
    if t.numel() != ref.numel() or t.device != ref.device:
        raise ValueError(
            f"{name} ({t.numel()} on {t.device}) must match m ({ref.numel()} on {ref.device})"
        )


def ef_add_cast(
    m: torch.Tensor,
    residual: torch.Tensor,
    low_dtype: torch.dtype,
    *,
    update: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """``m += residual`` in place and ``m.to(low_dtype)`` in one pass.

    Args:
        m: contiguous float tensor (the error-fed matrix, fp32 for low rank), updated
            unless ``update`` is False (then only the copy of the sum is made, and
            :func:`ef_apply` with ``add_residual`` forms the same sum again).
        residual: contiguous float tensor of ``m``'s size and device (any float dtype).
        low_dtype: the dtype of the returned copy (bf16 / fp16 / fp32).

    Returns:
        a new tensor of ``m``'s shape in ``low_dtype``: the updated ``m``, rounded.

    Raises:
        TypeError / ValueError: dtypes, contiguity, sizes or devices, backend.
    """
    _check("m", m)
    _same("residual", residual, m)
    if not _use_triton(m, backend):
        if not update:
            return (m + residual.view(m.shape)).to(low_dtype)
        m += residual.view(m.shape)
        return m.to(low_dtype)
    from .triton_kernels import _ef_add_cast_kernel

    low = torch.empty(m.shape, dtype=low_dtype, device=m.device)
    flat, r, lo = m.view(-1), residual.reshape(-1), low.view(-1)
    with _on_device(m) as extra:
        for t0, t1, n_bound in _launches(flat.numel()):
            _ef_add_cast_kernel[(t1 - t0,)](
                flat, r, lo, n_bound, t0, TILE=TILE, UPDATE=update, ON_GPU=m.is_cuda,
                USE_INT64=flat.numel() >= _INT32_LIMIT, num_warps=WARPS, **extra,
            )  # fmt: skip
    return low


APPLY_TILE = (128, 128)
"""(rows, columns) of ``A = P Q^T`` per program of :func:`ef_apply`; the rank is taken in
steps of up to 128 with bf16 factors (one step for r <= 128) and of up to 32 with fp32
factors (a 128-wide fp32 step of P and Q over three pipeline stages needs 384 KiB of shared
memory; an H100 or H200 block has 227 KiB), 8 warps."""
APPLY_WARPS = 8


def ef_apply(
    m: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    *,
    add_residual: bool = False,
    backend: str = "auto",
    launch: tuple[int, int, int, int] | None = None,
) -> None:
    """Apply a rank-r approximation with error feedback in one pass over the matrix:
    ``A = P Q^T`` (products of the operands as given, summed in fp32),
    ``residual = M - A`` (fp32, rounded to the residual's dtype) and ``out = A``.

    The product is formed tile by tile and never stored: the matrix's bytes are read once
    (M) and written once per destination, instead of a product written and read back
    (``torch.bmm`` then a subtraction and a copy, ~14 against ~10 bytes per element with
    an fp32 M and a bf16 residual). Every rank forms the same A from the same P and Q (one
    launch configuration, fixed summation order), and the residual is taken against the
    A applied, so error feedback stays exact.

    Args:
        m: ``(n, cols)`` fp32 contiguous, the error-fed matrix (read only when
            ``residual`` is given).
        p: ``(n, r)`` and q: ``(cols, r)``, contiguous, both bf16 (tensor-core products)
            or both fp32.
        residual: ``(n, cols)`` float contiguous (fp32/bf16/fp16), overwritten; or None
            (no error feedback: only ``out`` is written).
        out: ``n * cols`` float elements, contiguous (fp32/bf16/fp16); may be ``m``
            itself (same memory), not a partial overlap.
        add_residual: ``m`` holds the gradient G and ``residual`` the previous E: the
            matrix is ``M = G + E`` (fp32 sum, as :func:`ef_add_cast`), formed per element
            before E is overwritten.
        backend: ``auto`` | ``triton`` | ``torch`` (see :mod:`verl_comm.kernels.ops`).
        launch: ``(rows, columns, rank step, warps)`` per program (benchmark sweeps);
            default :data:`APPLY_TILE`, the rank step of :data:`APPLY_TILE`'s note,
            :data:`APPLY_WARPS`.

    Raises:
        TypeError / ValueError: dtypes, shapes, contiguity, devices, backend.
    """
    if m.dim() != 2 or p.dim() != 2 or q.dim() != 2:
        raise ValueError("ef_apply expects m (n, cols), p (n, r) and q (cols, r)")
    n, cols = m.shape
    if p.shape[0] != n or q.shape[0] != cols or p.shape[1] != q.shape[1]:
        raise ValueError(
            f"shapes do not chain: m {tuple(m.shape)}, p {tuple(p.shape)}, q {tuple(q.shape)}"
        )
    for name, t, dts in (("m", m, (torch.float32,)), ("p", p, (torch.float32, torch.bfloat16)),
                         ("q", q, (p.dtype,))):  # fmt: skip
        _check(name, t)
        if t.dtype not in dts or t.device != m.device:
            raise TypeError(f"{name} must be {' or '.join(map(str, dts))} on {m.device}")
    _same("out", out, m)
    if residual is not None:
        _same("residual", residual, m)
    elif add_residual:
        raise ValueError("add_residual needs the residual")
    if not _use_triton(m, backend):
        if add_residual:
            m = m + residual.view(n, cols)
        a = torch.mm(p.float(), q.float().mT)
        if residual is not None:
            torch.sub(m, a, out=residual.view(n, cols))
        out.view(n, cols).copy_(a)
        return
    from .triton_kernels import _ef_apply_kernel

    rank = p.shape[1]
    if launch is None:
        bn, bm = APPLY_TILE
        step = 128 if p.dtype == torch.bfloat16 else 32
        launch = (bn, bm, min(step, max(16, 1 << (rank - 1).bit_length())), APPLY_WARPS)
    bn, bm, br, warps = launch
    grid = (-(-n // bn), -(-cols // bm))
    res = residual if residual is not None else out  # unread and unwritten without one
    with _on_device(m) as extra:
        _ef_apply_kernel[grid](
            p, q, m, res, out, n, cols, rank,
            HAS_RESIDUAL=residual is not None, ADD_RESIDUAL=add_residual,
            BF16=p.dtype == torch.bfloat16,
            BLOCK_N=bn, BLOCK_M=bm, BLOCK_R=br, ON_GPU=m.is_cuda,
            USE_INT64=m.numel() >= _INT32_LIMIT, num_warps=warps, **extra,
        )  # fmt: skip
