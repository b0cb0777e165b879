"""One-pass casts around a 16-bit all-reduce (issue 28: the bf16/fp16 hooks' bytes per element).

A cast all-reduce of an fp32 bucket was four passes around the collective: ``x.to(bf16)``,
``div_(W)``, the copy back into the bucket, and a finiteness reduction of the result.
:func:`cast_scale` does the first two in one pass (read fp32, write 16 bits) and
:func:`copy_finite` the last two (read 16 bits, write fp32, one flag), each with the bits
of the torch operations it replaces:

* ``x.to(dtype).div_(W)`` on CUDA rounds ``x`` to ``dtype``, then multiplies in fp32 by
  the fp32 reciprocal ``fl(1 / W)`` (torch's ``div_true_kernel_cuda`` with a CPU scalar:
  ``a * (1 / b)`` in opmath), then rounds again; the kernel does exactly that (two roundings,
  the division second). The CPU's ``div_`` divides (``a / b`` in fp32): the same bits when
  W is a power of two; on CPU tensors the launchers run the torch operations themselves.
* the finiteness flag is computed on what the collective returned (a sum of finite values
  may overflow, and another rank's NaN arrives only through the sum), so it stays after the
  collective, fused into the copy back.

``backend``: as :mod:`verl_comm.kernels.ops` (``auto``: Triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES
from .ops import _INT32_LIMIT, _on_device, _use_triton

TILE = 4096
"""Elements per program (8 warps: 16 per thread)."""
WARPS = 8


def _launches(n: int) -> list[tuple[int, int, int]]:
    """``(tile0, tile_end, n_bound)`` per launch: whole tiles with a bound divisible by 16
    first (vector accesses), then the last partial tile (see ``split_launches``)."""
    from .triton_kernels import split_launches

    return split_launches(n, -(-n // TILE), TILE, 1)


def _check(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float32/bfloat16/float16 tensor")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def cast_scale(
    x: torch.Tensor, dtype: torch.dtype, divisor: int = 1, *, backend: str = "auto"
) -> torch.Tensor:
    """``x.to(dtype, copy=True).div_(divisor)`` (no division when ``divisor == 1``) in one pass.

    Args:
        x: contiguous fp32/bf16/fp16 tensor of N elements (read flattened).
        dtype: fp32/bf16/fp16, the result's dtype (e.g. the wire dtype of an all-reduce).
        divisor: positive int, e.g. W to average before summing.
        backend: ``auto`` | ``triton`` | ``torch`` (see :mod:`verl_comm.kernels.ops`).

    Returns:
        a new ``(N,)`` tensor of ``dtype``: ``round(round(x) * fl32(1 / divisor))`` with
        nearest-even roundings to ``dtype``, the bits of torch's CUDA ``to`` + ``div_``
        (module docstring). Non-finite values stay non-finite (NaN payloads may differ).

    Raises:
        TypeError / ValueError: dtypes, a non-contiguous ``x``, ``divisor < 1``, backend.
    """
    _check("x", x)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be a positive int, got {divisor!r}")
    flat = x.reshape(-1)
    if not _use_triton(x, backend):
        y = flat.to(dtype, copy=True)
        return y.div_(divisor) if divisor != 1 else y
    from .triton_kernels import _cast_scale_kernel

    y = torch.empty(flat.numel(), dtype=dtype, device=x.device)
    # fl32(1 / divisor), as torch's opmath (the kernel receives it as an fp32 argument)
    factor = (torch.ones((), dtype=torch.float32) / divisor).item()
    with _on_device(x) as extra:
        for t0, t1, n_bound in _launches(flat.numel()):
            _cast_scale_kernel[(t1 - t0,)](
                flat,
                y,
                n_bound,
                t0,
                factor,
                TILE=TILE,
                APPLY_FACTOR=divisor != 1,
                ON_GPU=x.is_cuda,
                USE_INT64=flat.numel() >= _INT32_LIMIT,
                num_warps=WARPS,
                **extra,
            )
    return y


def copy_finite(src: torch.Tensor, out: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``out.copy_(src)`` and whether every element of ``src`` is finite, in one pass.

    Args:
        src: contiguous fp32/bf16/fp16 tensor of N elements.
        out: contiguous float tensor of N elements on ``src``'s device (any of the three
            dtypes; nearest-even cast as ``copy_``). Must not overlap ``src`` partially.
        backend: ``auto`` | ``triton`` | ``torch``.

    Returns:
        0-dim bool on ``src``'s device: no element of ``src`` is NaN or +-Inf (True if
        empty), the verdict of :func:`all_finite`; ``out`` holds the copy.

    Raises:
        TypeError / ValueError: dtypes, contiguity, sizes or devices, backend.
    """
    _check("src", src)
    _check("out", out)
    if out.numel() != src.numel() or out.device != src.device:
        raise ValueError(
            f"out ({out.numel()} on {out.device}) must match src ({src.numel()} on {src.device})"
        )
    if not _use_triton(src, backend):
        out.view(-1).copy_(src.reshape(-1))
        return all_finite(src)
    from .triton_kernels import _copy_finite_kernel

    flag = torch.zeros(1, dtype=torch.int32, device=src.device)
    s, o = src.reshape(-1), out.view(-1)
    with _on_device(src) as extra:
        for t0, t1, n_bound in _launches(s.numel()):
            _copy_finite_kernel[(t1 - t0,)](
                s,
                o,
                flag,
                n_bound,
                t0,
                TILE=TILE,
                ON_GPU=src.is_cuda,
                USE_INT64=s.numel() >= _INT32_LIMIT,
                num_warps=WARPS,
                **extra,
            )
    return flag[0] == 0


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``t``'s device: no element of ``t`` is NaN or +-Inf (True if empty).

    One reduction pass without temporaries: on CUDA the inf-norm (max of ``|t|``), on the
    CPU ``aminmax`` (5x faster there than the inf-norm); both propagate NaN and are Inf iff
    an element is. ``torch.isfinite(t).all()`` costs four elementwise passes and a
    full-size temporary (``abs``, two compares, ``and``) before its reduction: ~2 ms of a
    19 ms DDP step over 403 M fp32 gradients on an H200 (``benchmarks/gpu/hooks_profile.py``).
    """
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    flat = t.reshape(-1)
    if flat.is_cuda:
        return torch.isfinite(torch.linalg.vector_norm(flat, float("inf")))
    lo, hi = torch.aminmax(flat)
    return torch.isfinite(lo) & torch.isfinite(hi)
