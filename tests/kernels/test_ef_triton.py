"""The low-rank error-feedback passes (kernels/ef.py), Triton's interpreter on CPU and
compiled on a CUDA machine: ``ef_add_cast`` gives the bits of the torch operations it
replaces (partial last tile, every residual dtype, NaN and Inf passed through; NaN payloads
may differ, as in kernels/cast.py); ``ef_apply`` forms the product within its summation
bound and splits M exactly into output and residual, with ``out`` aliasing ``m``."""

from __future__ import annotations

import pytest
import torch
from verl_comm.kernels.ef import ef_add_cast, ef_apply

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


@pytest.mark.parametrize("rdt", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("alias", [True, False])
@pytest.mark.parametrize(
    ("rank", "odt"), [(5, torch.bfloat16), (80, torch.float32), (200, torch.bfloat16)]
)  # rank in one partial step; two steps
def test_ef_apply_forms_p_qt_and_splits_exactly(rdt, alias, rank, odt):
    """out = A = P Q^T of bf16 or fp32 factors (fp32 sums: within the summation-order
    bound 2 r u sum_k |p_ik q_jk|, u = 2**-24, of torch's product), and the residual is
    exactly M - A rounded once to its dtype: what is applied plus what is kept is M."""
    n, cols = 100, 150  # partial tiles in both directions
    g = torch.Generator().manual_seed(rank)
    m = (torch.randn(n, cols, generator=g) * 3).to(DEV)
    p = torch.randn(n, rank, generator=g).to(DEV)
    q = torch.randn(cols, rank, generator=g).to(DEV)
    p, q = p.to(odt), q.to(odt)
    pb, qb = p.float(), q.float()
    want_a = pb @ qb.mT
    bound = 2 * rank * 2.0**-24 * (pb.abs() @ qb.abs().mT)
    m0 = m.clone()
    r = None if rdt is None else torch.empty(n, cols, dtype=rdt, device=DEV)
    out = m if alias else torch.empty(n * cols, device=DEV)
    ef_apply(m0 if not alias else m, p, q, r, out, backend=BACKEND)
    a = out.view(n, cols)
    assert ((a - want_a).abs() <= bound).all()
    if r is not None:
        assert _same_bits(r, (m0 - a).to(rdt))


def test_bad_input_is_refused():
    m = torch.zeros(8, device=DEV)
    with pytest.raises(ValueError, match="must match"):
        ef_add_cast(m, torch.zeros(7, device=DEV), torch.bfloat16)
    m2, p = torch.zeros(4, 2, device=DEV), torch.zeros(4, 1, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        ef_apply(m2, p, torch.zeros(2, 1, device=DEV), torch.zeros(16, device=DEV)[::2], m2)
    with pytest.raises(ValueError, match="do not chain"):
        ef_apply(m2, p, torch.zeros(3, 1, device=DEV), None, m2)


@pytest.mark.parametrize("rdt", [torch.bfloat16, torch.float32])
def test_sum_formed_twice_has_the_bits_of_sum_stored(rdt):
    """``ef_add_cast(update=False)`` leaves M = G and gives the bf16 copy of G + E;
    ``ef_apply(add_residual=True)`` then forms G + E again: the same residual and output
    bits as the path that stores M = G + E first."""
    n, cols, rank = 100, 150, 8
    g = torch.Generator().manual_seed(3)
    grad = (torch.randn(n, cols, generator=g) * 3).to(DEV)
    e_old = (torch.randn(n, cols, generator=g) * 1e-2).to(DEV, rdt)
    p = torch.randn(n, rank, generator=g).to(DEV, torch.bfloat16)
    q = torch.randn(cols, rank, generator=g).to(DEV, torch.bfloat16)
    stored, e1, out1 = grad.clone(), e_old.clone(), torch.empty(n * cols, device=DEV)
    low1 = ef_add_cast(stored, e1, torch.bfloat16, backend=BACKEND)
    ef_apply(stored, p, q, e1, out1, backend=BACKEND)
    kept, e2 = grad.clone(), e_old.clone()
    low2 = ef_add_cast(kept, e2, torch.bfloat16, update=False, backend=BACKEND)
    assert torch.equal(kept, grad) and _same_bits(low2, low1)
    ef_apply(kept, p, q, e2, kept, add_residual=True, backend=BACKEND)  # out aliases G
    assert _same_bits(e2, e1) and _same_bits(kept.view(-1), out1)
