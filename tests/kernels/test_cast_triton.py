"""The one-pass casts of the bf16/fp16 all-reduce (issue 28) against the torch operations
they replace, bit for bit.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
on a CUDA machine the compiled kernels run against torch's CUDA operations, which divide
by a Python scalar as a multiplication by its fp32 reciprocal, for every divisor. On the
CPU torch divides, so there the kernel is compared with that multiplication written out,
and with torch's own operations for power-of-two divisors (where both agree).

Run: .venv/bin/python -m pytest -q tests/kernels/test_cast_triton.py
"""

from __future__ import annotations

import os

import pytest
import torch
from verl_comm.kernels import all_finite, cast_scale, copy_finite

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip(
        "needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
T = {"backend": "triton"}
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of finite values, NaN where the other is NaN (payloads may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())


def _data(n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    if specials and n > 5000:
        x[17] = float("nan")
        x[4100] = float("inf")
        x[-1] = -float("inf")
        x[100] = 1e38  # finite in fp32, Inf in fp16 (and near the top of bf16)
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("divisor", (1, 2, 3, 8))
def test_cast_scale_bit_exact(src: torch.dtype, dst: torch.dtype, divisor: int) -> None:
    x = _data(12_365, src, seed=divisor)  # odd length: a partial last tile, two launches
    got = cast_scale(x, dst, divisor, **T)
    inv = torch.ones((), dtype=torch.float32) / divisor  # round, multiply in fp32, round
    emulated = (x.to(dst).float() * inv.to(DEV)).to(dst)
    assert _same(got, emulated)
    if DEV == "cuda" or divisor & (divisor - 1) == 0:  # torch's own ops: same bits
        want = x.to(dst, copy=True)
        if divisor != 1:
            want.div_(divisor)
        assert _same(got, want)
    assert _same(got, cast_scale(x, dst, divisor, backend="torch")) or (
        DEV == "cpu" and divisor & (divisor - 1)
    )


@pytest.mark.parametrize("src", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("dst", (torch.float32, torch.bfloat16))
def test_copy_finite_copies_and_flags_like_all_finite(src: torch.dtype, dst: torch.dtype) -> None:
    s = (torch.randn(9_001, generator=torch.Generator().manual_seed(3)) * 100).to(src).to(DEV)
    out = torch.full((9_001,), 5.0, dtype=dst, device=DEV)
    ok = copy_finite(s, out, **T)
    assert ok.dtype == torch.bool and ok.shape == () and bool(ok)
    assert _same(out, s.to(dst))
    for pos in (0, 4095, 4096, 9_000):  # first tile, tile edges, the last partial tile
        for bad in (float("nan"), float("inf"), -float("inf")):
            u = s.clone()
            u[pos] = bad
            verdict = copy_finite(u, out, **T)
            assert not bool(verdict) and bool(verdict) == bool(all_finite(u)), (pos, bad)
            assert _same(out, u.to(dst))
    big = torch.full((100,), torch.finfo(src).max, dtype=src, device=DEV)  # finite
    assert bool(copy_finite(big, torch.empty(100, dtype=torch.float32, device=DEV), **T))


def test_empty_and_rejected_inputs() -> None:
    e = torch.empty(0, device=DEV)
    assert cast_scale(e, torch.bfloat16, 4, **T).shape == (0,)
    assert bool(copy_finite(e.bfloat16(), e, **T))
    x = torch.zeros(64, 2, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        cast_scale(x.t(), torch.bfloat16, **T)
    with pytest.raises(ValueError, match="divisor"):
        cast_scale(x, torch.bfloat16, 0, **T)
    with pytest.raises(TypeError, match="dtype"):
        cast_scale(x, torch.int8, **T)
    with pytest.raises(ValueError, match="must match"):
        copy_finite(x, torch.empty(3, device=DEV), **T)
