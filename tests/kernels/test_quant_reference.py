"""Properties of the torch references and the CPU launchers (no Triton involved).

Run: .venv/bin/python -m pytest -q tests/kernels/test_quant_reference.py
"""

from __future__ import annotations

import pytest
import torch
from verl_comm.kernels import (
    dequant_sum_requant,
    dequant_sum_requant_ref,
    dequantize,
    dequantize_ref,
    pack,
    packed_nbytes,
    padded_numel,
    quantize,
    quantize_ef,
    quantize_ef_ref,
    quantize_ref,
    unpack,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp32 rounding slack of the nearest-rounding bound |x - dequant| <= scale / 2 (see _common).
SLACK = 1e-4


def _expand(scales: torch.Tensor, block: int, n: int) -> torch.Tensor:
    return scales.double().repeat_interleave(block)[:n]


def test_padded_numel_and_packed_nbytes() -> None:
    assert padded_numel(0) == 0
    assert padded_numel(1) == 128
    assert padded_numel(128) == 128
    assert padded_numel(129, 64) == 192
    assert padded_numel(1000, 128, multiple=3) == 1152
    assert packed_nbytes(256, 128) == 256 + 8
    with pytest.raises(ValueError, match="n must be >= 0"):
        padded_numel(-1)
    with pytest.raises(ValueError, match="multiple of block"):
        packed_nbytes(100, 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", (32, 64, 128, 256))
def test_error_bound_and_scale_rule(dtype: torch.dtype, block: int) -> None:
    torch.manual_seed(block)
    n = 1823 * 781  # odd size (Triton's fused-softmax tutorial shape), reference only
    x = (torch.randn(n) * torch.logspace(-3, 3, n)).to(dtype)
    codes, scales = quantize_ref(x, block)
    n_pad = padded_numel(n, block)
    assert codes.shape == (n_pad,) and codes.dtype == torch.int8
    assert scales.shape == (n_pad // block,) and scales.dtype == torch.float32
    assert codes.abs().max() <= 127
    assert torch.all(codes[n:] == 0)
    xf = torch.zeros(n_pad, dtype=torch.float32)
    xf[:n] = x.float()
    absmax = xf.view(-1, block).abs().amax(1)
    torch.testing.assert_close(scales, absmax / 127, rtol=0, atol=0)
    # every non-zero block uses the full code range at its absmax element
    assert torch.all(codes.view(-1, block).abs().amax(1)[absmax > 0] == 127)
    deq = dequantize_ref(codes, scales, block, numel=n).double()
    err = (x.double() - deq).abs()
    assert torch.all(err <= _expand(scales, block, n) * (0.5 + SLACK))


def test_round_half_to_even() -> None:
    # absmax 127 gives scale 1 and inv 1: q == x exactly, so the ties are real ties
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -3.51] + [0.0] * 119)
    codes, scales = quantize_ref(x)
    assert scales.tolist() == [1.0]
    assert codes[:9].tolist() == [127, 0, 2, 2, 0, -2, -2, 3, -4]


def test_zero_tiny_and_nonfinite_blocks() -> None:
    x = torch.randn(6 * 128)
    x[0:128] = 0.0  # all-zero block
    x[128:256] = 1e-36  # below TINY = 2**-113: treated as zero
    x[300] = float("nan")
    x[400] = float("inf")
    x[600] = -float("inf")
    codes, scales = quantize_ref(x)
    assert scales[0] == 0 and scales[1] == 0
    assert torch.all(codes[:256] == 0)
    assert torch.isnan(scales[2:5]).all()
    assert torch.all(codes[256:640] == 0)
    assert torch.isfinite(scales[5])
    assert torch.isfinite(scales).tolist() == [True, True, False, False, False, True]
    # error feedback: the residual of a tiny block keeps the value; bad blocks become NaN
    r = torch.zeros_like(x)
    quantize_ef_ref(x, r)
    assert torch.equal(r[128:256], x[128:256])
    assert torch.isnan(r[256:640]).all() and torch.isfinite(r[640:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rdtype", ("same", torch.float32))
def test_error_feedback_identity(dtype: torch.dtype, rdtype) -> None:
    torch.manual_seed(1)
    n = 1000
    x = torch.randn(n).to(dtype)
    rdt = dtype if rdtype == "same" else rdtype
    r = (torch.randn(n) * 0.05).to(rdt)
    v = x.double() + r.double()
    v32 = x.float() + r.float()
    codes, scales = quantize_ef_ref(x, r, 64)
    assert torch.equal(codes, quantize_ref(v32, 64)[0])
    deq = dequantize_ref(codes, scales, 64, numel=n).double()
    # exact in fp32; one rounding of the residual when it is stored in 16 bits
    ulp = 2.0 ** -(8 if rdt == torch.bfloat16 else 11 if rdt == torch.float16 else 24)
    torch.testing.assert_close(deq + r.double(), v, rtol=0, atol=float(v.abs().max()) * ulp)
    assert torch.all((v - deq).abs() <= _expand(scales, 64, n) * (0.5 + SLACK))


def test_stochastic_rounding_unbiased() -> None:
    """Mean of K stochastic draws converges to x; nearest rounding on the same data does not.

    Per element the code is floor(q) or floor(q)+1, so a draw's error has std <= scale / 2 and
    the mean of K draws std <= scale / (2 sqrt K). Bound: 6 sigma per element (4096 elements,
    fixed seeds: deterministic), 5 sigma for the average bias over all elements.
    """
    k, block = 256, 128
    g = torch.Generator().manual_seed(7)
    base = torch.randint(-100, 101, (4096,), generator=g).float()
    x = base + 0.3  # fractional part 0.3: nearest rounding is biased by -0.3 (in code units)
    x[::128] = 127.0  # absmax 127 per block -> scale exactly 1
    draws = torch.stack(
        [
            dequantize_ref(*quantize_ref(x, block, stochastic=True, seed=11, offset=i * 4096))
            for i in range(k)
        ]
    )
    err = (draws.double().mean(0) - x.double()).abs()
    sigma = 0.5 / k**0.5
    assert err.max() <= 6 * sigma
    bias = (draws.double().mean(0) - x.double()).mean().abs()
    assert bias <= 5 * sigma / 4096**0.5
    nearest = dequantize_ref(*quantize_ref(x, block)).double()
    assert (nearest - x.double()).mean().abs() > 100 * sigma / 4096**0.5  # the test can fail
    # stochastic error bound: strictly below one scale
    assert ((draws.double() - x.double()).abs() < 1.0).all()
    # reproducible and offset-dependent
    a = quantize_ref(x, block, stochastic=True, seed=3, offset=5)[0]
    assert torch.equal(a, quantize_ref(x, block, stochastic=True, seed=3, offset=5)[0])
    assert not torch.equal(a, quantize_ref(x, block, stochastic=True, seed=3, offset=6)[0])


@pytest.mark.parametrize("n", (0, 1, 127, 129))
def test_odd_and_empty_lengths(n: int) -> None:
    x = torch.randn(n)
    codes, scales = quantize_ref(x)
    assert codes.numel() == padded_numel(n) and scales.numel() == padded_numel(n) // 128
    assert dequantize_ref(codes, scales, numel=n).shape == (n,)
    r = torch.zeros(n)
    quantize_ef_ref(x, r)
    c2, s2 = quantize_ref(x, pad_to=padded_numel(n, 128, multiple=4))
    assert c2.numel() == padded_numel(n, 128, 4) and torch.equal(c2[: codes.numel()], codes)


def test_dequant_sum_requant_ref_matches_definition() -> None:
    torch.manual_seed(2)
    w, m, block = 4, 1024, 64
    parts = [quantize_ref(torch.randn(m), block) for _ in range(w)]
    codes = torch.stack([p[0] for p in parts])
    scales = torch.stack([p[1] for p in parts])
    c, s, total = dequant_sum_requant_ref(codes, scales, block, return_sum=True)
    expect = sum(dequantize_ref(cw, sw, block) for cw, sw in zip(codes, scales))
    assert torch.equal(total, expect)  # same summation order
    c_q, s_q = quantize_ref(expect, block)
    assert torch.equal(c, c_q) and torch.equal(s, s_q)


@pytest.mark.parametrize("batched", (False, True))
def test_pack_unpack_roundtrip(batched: bool) -> None:
    torch.manual_seed(3)
    block = 32
    shape = (3, 256) if batched else (256,)
    codes = torch.randint(-127, 128, shape, dtype=torch.int8)
    scales = torch.rand(*shape[:-1], 256 // block)
    buf = pack(codes, scales)
    assert buf.dtype == torch.uint8 and buf.shape[-1] == packed_nbytes(256, block)
    c, s = unpack(buf, block)
    assert torch.equal(c, codes) and torch.equal(s, scales)
    assert c.data_ptr() == buf.data_ptr()  # views, no copy
    # documented layout: codes bytes then little-endian fp32 scales
    row = buf[-1] if batched else buf
    assert torch.equal(row[:256].view(torch.int8), codes.reshape(-1, 256)[-1])
    assert torch.equal(row[256:260].view(torch.float32), scales.reshape(-1, 256 // block)[-1, :1])
    if batched:  # strided row views work directly in the consumers
        d = dequant_sum_requant(c, s, block, return_sum=True)[2]
        assert torch.equal(d, dequantize(c, s, block).view(3, 256).sum(0))
    with pytest.raises(ValueError, match="not M"):
        unpack(buf[..., :-1], block)


def test_launchers_dispatch_cpu_to_reference() -> None:
    x = torch.randn(3000, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(quantize(x, 64), quantize_ref(x, 64)))
    r1, r2 = torch.zeros(3000), torch.zeros(3000)
    assert all(torch.equal(a, b) for a, b in zip(quantize_ef(x, r1), quantize_ef_ref(x, r2)))
    assert torch.equal(r1, r2)
    c, s = quantize(x)
    out = torch.empty(3000, dtype=torch.float16)
    y = dequantize(c, s, scale=0.5, numel=3000, out=out)
    assert y is out and torch.equal(
        y, dequantize_ref(c, s, out_dtype=torch.float16, scale=0.5, numel=3000)
    )
    cw, sw = torch.stack([c, c]), torch.stack([s, s])
    assert all(
        torch.equal(a, b)
        for a, b in zip(dequant_sum_requant(cw, sw), dequant_sum_requant_ref(cw, sw))
    )


def test_validation_errors() -> None:
    x = torch.randn(512)
    with pytest.raises(ValueError, match="contiguous"):
        quantize(x[::2])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize(x.double())
    with pytest.raises(ValueError, match="block must be one of"):
        quantize(x, 100)
    with pytest.raises(ValueError, match="pad_to"):
        quantize(x, pad_to=500)
    with pytest.raises(ValueError, match="seed"):
        quantize(x, stochastic=True, seed=-1)
    with pytest.raises(TypeError, match="residual must be"):
        quantize_ef(x.half(), torch.zeros(512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual must have 512"):
        quantize_ef(x, torch.zeros(511))
    with pytest.raises(ValueError, match="residual must be contiguous"):
        quantize_ef(x, torch.zeros(1024)[::2])
    c, s = quantize(x)
    with pytest.raises(TypeError, match="codes must be torch.int8"):
        dequantize(c.int(), s)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize(c, s[:-1])
    with pytest.raises(ValueError, match=r"shape \(W, M\)"):
        dequant_sum_requant(c, s)
    with pytest.raises(ValueError, match="numel"):
        dequantize(c, s, numel=513)
    with pytest.raises(ValueError, match="out must be contiguous"):
        dequantize(c, s, out=torch.empty(1024)[::2])
    with pytest.raises(ValueError, match="backend"):
        quantize(x, backend="cuda")
