"""The SiLU-mul + split-K down-projection kernel (kernels/silu_down.py) against the eager
``F.linear(silu(g) * u, w)`` with the activation rounded to the input dtype, in fp16
(Triton's interpreter on CPU mishandles bf16 ``tl.dot``; CUDA runs the compiled kernel; bf16
on CUDA is in tests/verl_ppo/test_decode_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from verl_comm.kernels.silu_down import silu_mul_linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(gu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, -1)
    act = (F.silu(g) * u).to(gu.dtype).float()  # rounded once, as the kernel stores it
    return act @ w.float().T


@pytest.mark.parametrize(
    "rows, n, k, splits",
    [(5, 48, 96, None), (16, 64, 128, 3), (33, 40, 80, 2), (2, 24, 40, 1)],
)
def test_matches_eager_silu_mul_linear(rows: int, n: int, k: int, splits: int | None) -> None:
    """Rows, N and K that are not multiples of the tiles, one to several K splits (the last
    one partial); a leading batch dimension is kept."""
    g = torch.Generator().manual_seed(rows)
    gu = torch.randn(1, rows, 2 * k, generator=g).half().to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.1).half().to(DEV)
    out = silu_mul_linear(gu, w, splits=splits, block_n=16, block_k=16)
    assert out.shape == (1, rows, n) and out.dtype == torch.float16
    want = _reference(gu[0], w)
    # fp32 sums of fp16 products (only the summation order differs), one fp16 rounding of
    # outputs below 4 in magnitude: 2^-11 relative, plus fp32 reordering (far smaller)
    torch.testing.assert_close(out[0].float(), want, atol=4 * 2**-11, rtol=2**-10)


def test_rejects_mismatched_shapes_and_dtypes() -> None:
    gu = torch.zeros(4, 32, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="need"):
        silu_mul_linear(gu, torch.zeros(8, 15, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="need"):
        silu_mul_linear(gu.float(), torch.zeros(8, 16, device=DEV))
