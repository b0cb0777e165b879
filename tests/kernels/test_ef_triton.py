"""The low-rank error-feedback passes (kernels/ef.py): the Triton kernels (Triton's
interpreter on CPU, compiled on a CUDA machine) give the bits of the torch operations they
replace, on sizes with a partial last tile, for every residual dtype, with ``out`` aliasing
``m``, and with NaN and Inf passed through (NaN payloads may differ, as in kernels/cast.py)."""

from __future__ import annotations

import pytest
import torch
from verl_comm.kernels.ef import ef_add_cast, ef_split

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "auto" if DEV == "cuda" else "triton"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that a NaN only has to meet a NaN."""
    nan = a.isnan()
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    ok = torch.equal(nan, b.isnan())
    return ok and torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def _data(n: int, rdt: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = (torch.randn(n, generator=g) * 3).to(DEV)
    r = (torch.randn(n, generator=g) * 1e-2).to(DEV, rdt)
    m[5], m[7], r[9] = float("nan"), float("inf"), float("-inf")
    return m, r


@pytest.mark.parametrize("rdt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [4096 * 2, 4096 + 37])  # whole tiles; a partial last tile
def test_ef_add_cast_has_the_bits_of_add_then_to(rdt, n):
    m, r = _data(n, rdt, n)
    want_m = m.clone()
    want_m += r
    want_low = want_m.to(torch.bfloat16)
    low = ef_add_cast(m, r, torch.bfloat16, backend=BACKEND)
    assert _same_bits(m, want_m) and _same_bits(low, want_low)


@pytest.mark.parametrize("rdt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("alias", [True, False])
def test_ef_split_has_the_bits_of_sub_then_copy(rdt, alias):
    n = 4096 + 37
    m, _ = _data(n, rdt, 1)
    approx = (m + torch.randn(n, device=DEV) * 1e-3).to(torch.bfloat16)
    want_r = torch.empty(n, dtype=rdt, device=DEV)
    torch.sub(m, approx, out=want_r)
    want_out = approx.float()
    r = torch.empty(n, dtype=rdt, device=DEV)
    out = m if alias else torch.empty(n, device=DEV)
    ef_split(m, approx, r, out, backend=BACKEND)
    assert _same_bits(r, want_r) and _same_bits(out, want_out)


def test_bad_input_is_refused():
    m = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="must match"):
        ef_add_cast(m, torch.zeros(7, device=DEV), torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        ef_split(m, torch.zeros(16, device=DEV)[::2], torch.zeros(8, device=DEV), m)
