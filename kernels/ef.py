"""One-pass error-feedback steps of CUDA low rank (issue 28: low rank r128 against PowerSGD).

Low rank on CUDA multiplies in bf16 and keeps the bucket, ``M = G + E``, in fp32 with a
16-bit residual ``E``. In torch each step around the two products was two elementwise
passes over the whole matrix, the first of each a mixed-dtype kernel without vector access
(``benchmarks/gpu/hooks_profile.py``: 71 us per 4096 x 4096 matrix on an H100):

* before: ``M += E`` then ``M_low = M.to(bf16)``  ->  :func:`ef_add_cast`, one pass;
* after: ``E = M - A`` (``torch.sub(M, A, out=E)``) then ``out = A`` (``copy_``), ``A`` the
  bf16 product ``P Q^T``  ->  :func:`ef_split`, one pass.

Same bits as the torch operations they replace: the sums and differences in fp32 (torch's
common dtype of fp32 and bf16), each result rounded once to nearest even into its
destination's dtype. ``backend`` as :mod:`verl_comm.kernels.ops` (``auto``: Triton on
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
    m: torch.Tensor, residual: torch.Tensor, low_dtype: torch.dtype, *, backend: str = "auto"
) -> torch.Tensor:
    """``m += residual`` in place and ``m.to(low_dtype)`` in one pass.

    Args:
        m: contiguous float tensor (the error-fed matrix, fp32 for low rank), updated.
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
        m += residual.view(m.shape)
        return m.to(low_dtype)
    from .triton_kernels import _ef_add_cast_kernel

    low = torch.empty(m.shape, dtype=low_dtype, device=m.device)
    flat, r, lo = m.view(-1), residual.reshape(-1), low.view(-1)
    with _on_device(m) as extra:
        for t0, t1, n_bound in _launches(flat.numel()):
            _ef_add_cast_kernel[(t1 - t0,)](
                flat, r, lo, n_bound, t0, TILE=TILE, ON_GPU=m.is_cuda,
                USE_INT64=flat.numel() >= _INT32_LIMIT, num_warps=WARPS, **extra,
            )  # fmt: skip
    return low


def ef_split(
    m: torch.Tensor,
    approx: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """``residual = m - approx`` (fp32, rounded to the residual's dtype) and ``out = approx``
    in one pass; ``out`` may be ``m`` itself (same memory), not a partial overlap.

    Args:
        m: contiguous float tensor. approx, residual, out: contiguous float tensors of
            ``m``'s size and device.

    Raises:
        TypeError / ValueError: dtypes, contiguity, sizes or devices, backend.
    """
    _check("m", m)
    for name, t in (("approx", approx), ("residual", residual), ("out", out)):
        _same(name, t, m)
    if not _use_triton(m, backend):
        torch.sub(m.view(-1), approx.reshape(-1), out=residual.view(-1))
        out.view(-1).copy_(approx.reshape(-1))
        return
    from .triton_kernels import _ef_split_kernel

    flat = m.view(-1)
    args = (approx.reshape(-1), residual.view(-1), out.view(-1))
    with _on_device(m) as extra:
        for t0, t1, n_bound in _launches(flat.numel()):
            _ef_split_kernel[(t1 - t0,)](
                flat, *args, n_bound, t0, TILE=TILE, ON_GPU=m.is_cuda,
                USE_INT64=flat.numel() >= _INT32_LIMIT, num_warps=WARPS, **extra,
            )  # fmt: skip
