"""Triton kernels against the torch references, bit for bit.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before the kernels are imported) through ``backend="triton"``; on a CUDA machine the same
tests run the compiled kernels on the GPU. Tensors stay around 64K elements or fewer (the
interpreter costs ~1 ms per program instance).

Run: .venv/bin/python -m pytest -q tests/kernels/test_quant_triton.py
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from verl_comm.kernels import (
    dequant_sum_requant,
    dequant_sum_requant_ref,
    dequantize,
    dequantize_ref,
    pack,
    padded_numel,
    quantize,
    quantize_ef,
    quantize_ef_ref,
    quantize_ref,
    unpack,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover
    pytest.skip(
        "needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)", allow_module_level=True
    )

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCKS = (32, 64, 128, 256)
T = {"backend": "triton"}
# NaN/Inf test blocks make numpy (the interpreter) warn about 0 * inf; that is the point.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN for floats)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(
            a.isnan(), b.isnan()
        )
    return torch.equal(a, b)


def _data(n: int, dtype: torch.dtype, seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    if specials and n >= 1024:
        x[256:512] = 0.0  # all-zero block(s)
        x[600] = float("nan")
        x[900] = float("inf")
        x[-3] = -float("inf")
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_bit_exact(dtype: torch.dtype, block: int) -> None:
    x = _data(12_365, dtype, seed=block)  # odd length: partial last block and last program
    codes, scales = quantize(x, block, **T)
    c_ref, s_ref = quantize_ref(x.cpu(), block)
    assert _same(codes.cpu(), c_ref) and _same(scales.cpu(), s_ref)
    assert (~torch.isfinite(scales)).sum() >= 2  # the NaN/Inf blocks are flagged


@pytest.mark.parametrize("block", (32, 128))
@pytest.mark.parametrize("n", (1, "B-1", "B+1"))
def test_quantize_small_odd_lengths(block: int, n) -> None:
    n = {"B-1": block - 1, "B+1": block + 1}.get(n, n)
    x = _data(n, torch.float32, seed=n)
    for kw in ({}, {"pad_to": padded_numel(n, block, multiple=8)}):
        got = quantize(x, block, **kw, **T)
        want = quantize_ref(x.cpu(), block, **kw)
        assert all(_same(a.cpu(), b) for a, b in zip(got, want))


def test_empty_input() -> None:
    x = torch.empty(0, device=DEV)
    codes, scales = quantize(x, **T)
    assert codes.shape == (0,) and scales.shape == (0,)
    codes, scales = quantize(x, pad_to=256, **T)  # padding only: zeros
    assert torch.all(codes == 0) and torch.all(scales == 0)
    r = torch.empty(0, device=DEV)
    assert quantize_ef(x, r, **T)[0].numel() == 0
    assert dequantize(codes[:0], scales[:0], **T).numel() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed,offset", ((0, 0), (12345, 3_000_000_007), (2**40 + 17, 99)))
def test_stochastic_matches_reference_draws(dtype: torch.dtype, seed: int, offset: int) -> None:
    x = _data(5000, dtype, seed=3)
    got = quantize(x, 64, stochastic=True, seed=seed, offset=offset, **T)
    want = quantize_ref(x.cpu(), 64, stochastic=True, seed=seed, offset=offset)
    assert all(_same(a.cpu(), b) for a, b in zip(got, want))
    nearest = quantize(x, 64, **T)[0]
    assert (got[0] != nearest).any()  # really stochastic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", (64, 128))
@pytest.mark.parametrize("residual_fp32", (False, True))
@pytest.mark.parametrize("chunk_blocks", (None, 16))  # 16: full chunks take the fused add
def test_quantize_ef_bit_exact_and_identity(
    dtype: torch.dtype, block: int, residual_fp32: bool, chunk_blocks, monkeypatch
) -> None:
    if chunk_blocks is not None:
        monkeypatch.setattr(
            sys.modules["verl_comm.kernels.reference"], "CHUNK_BLOCKS", chunk_blocks
        )
    n = 9_001
    x = _data(n, dtype, seed=5, specials=False)
    rdt = torch.float32 if residual_fp32 else dtype
    r = (_data(n, torch.float32, seed=6, specials=False) * 0.01).to(rdt)
    r_ref = r.cpu().clone()
    v = x.double() + r.double()
    codes, scales = quantize_ef(x, r, block, **T)
    c_ref, s_ref = quantize_ef_ref(x.cpu(), r_ref, block)
    assert _same(codes.cpu(), c_ref) and _same(scales.cpu(), s_ref)
    assert _same(r.cpu(), r_ref)  # residual updated in place, bit for bit
    deq = dequantize(codes, scales, block, numel=n, **T).double()
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[rdt]
    torch.testing.assert_close(deq + r.double(), v, rtol=0, atol=float(v.abs().max()) * ulp)


def test_quantize_ef_nonfinite_policy() -> None:
    x = _data(4096, torch.float32, seed=8)
    r = torch.zeros_like(x)
    _, scales = quantize_ef(x, r, **T)
    bad = ~torch.isfinite(scales)
    # x[256:512] zero; NaN at 600, +Inf at 900, -Inf at 4093
    assert bad.nonzero().flatten().tolist() == [600 // 128, 900 // 128, 4093 // 128]
    assert scales[2:3].cpu().tolist() == [0.0]
    assert torch.isnan(r.view(-1, 128)[bad]).all() and torch.isfinite(r.view(-1, 128)[~bad]).all()


@pytest.mark.parametrize("w", (1, 2, 3, 8))
@pytest.mark.parametrize("block", (32, 128))
def test_dequant_sum_requant_bit_exact(w: int, block: int) -> None:
    m = 4 * 1024
    parts = [
        quantize(_data(m - 5, torch.float32, seed=10 + i, specials=False), block, **T)
        for i in range(w)
    ]
    buf = pack(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    codes, scales = unpack(buf, block)  # strided row views, as received from an all-to-all
    got = dequant_sum_requant(codes, scales, block, return_sum=True, **T)
    want = dequant_sum_requant_ref(codes.cpu(), scales.cpu(), block, return_sum=True)
    assert all(_same(a.cpu(), b) for a, b in zip(got, want))
    plain = dequant_sum_requant(codes, scales, block, **T)
    assert len(plain) == 2 and _same(plain[0], got[0]) and _same(plain[1], got[1])


@pytest.mark.parametrize("out_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("keep", (4 * 1024, 4 * 1024 - 77))  # the whole chunk; a padded tail
def test_dequant_sum_requant_writes_dequantize_bits(out_dtype, keep: int) -> None:
    """``dequant_out``: the owner's chunk of the result from the same pass, with the bits of
    ``dequantize`` of the requantized codes (scale 1/3, a NaN scale block included)."""
    m, block = 4 * 1024, 128
    parts = [quantize(_data(m, torch.float32, seed=20 + i, specials=False), block, **T)
             for i in range(3)]  # fmt: skip
    codes = torch.stack([p[0] for p in parts])
    scales = torch.stack([p[1] for p in parts])
    scales[1, 5] = float("nan")
    deq = torch.empty(keep, dtype=out_dtype, device=codes.device)
    c, s = dequant_sum_requant(codes, scales, block, dequant_out=deq, dequant_scale=1 / 3, **T)
    want = dequantize(c, s, block, scale=1 / 3, numel=keep, out_dtype=out_dtype, **T)
    assert _same(deq, want) and torch.isnan(deq[5 * block : 6 * block].float()).all()
    with pytest.raises(ValueError, match="elements, the chunk"):
        dequant_sum_requant(codes, scales, block, dequant_out=torch.empty(m + 1), **T)


def test_dequant_sum_requant_propagates_nonfinite_scale() -> None:
    codes = torch.randint(-127, 128, (2, 512), dtype=torch.int8, device=DEV)
    scales = torch.rand(2, 4, device=DEV)
    scales[1, 2] = float("nan")
    _, s = dequant_sum_requant(codes, scales, **T)
    assert torch.isfinite(s).tolist() == [True, True, False, True]


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("factor", (1.0, 0.25, 1 / 3))
def test_dequantize_bit_exact(out_dtype: torch.dtype, factor: float) -> None:
    x = _data(20_000, torch.float32, seed=12)
    codes, scales = quantize(x, 64, **T)
    n = 19_990
    got = dequantize(codes, scales, 64, out_dtype=out_dtype, scale=factor, numel=n, **T)
    want = dequantize_ref(codes.cpu(), scales.cpu(), 64, out_dtype=out_dtype, scale=factor, numel=n)
    assert got.dtype == out_dtype and _same(got.cpu(), want)


def test_dequantize_rows_and_out() -> None:
    parts = [
        quantize(_data(1000, torch.float32, seed=20 + i, specials=False), 32, **T) for i in range(3)
    ]
    codes, scales = unpack(
        pack(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])), 32
    )
    out = torch.full((3 * 1024 - 7,), 5.0, dtype=torch.bfloat16, device=DEV)
    y = dequantize(codes, scales, 32, out=out, numel=out.numel(), **T)
    assert y is out
    want = dequantize_ref(
        codes.cpu(), scales.cpu(), 32, out_dtype=torch.bfloat16, numel=out.numel()
    )
    assert _same(out.cpu(), want)


def test_noncontiguous_input_rejected() -> None:
    x = _data(4096, torch.float32, seed=1)
    with pytest.raises(ValueError, match="contiguous"):
        quantize(x[::2], **T)
    with pytest.raises(ValueError, match="stride 1"):
        dequantize(
            torch.zeros(256, 2, dtype=torch.int8, device=DEV)[:, 0], torch.zeros(2, device=DEV), **T
        )


def test_split_launches_cover_every_block_once() -> None:
    from verl_comm.kernels.triton_kernels import split_launches

    assert split_launches(4096, 32, 128, 32) == [(0, 32, 4096)]  # n % 16 == 0: one launch
    assert split_launches(0, 0, 128, 32) == []
    for n, nblocks in ((1, 1), (4097, 33), (12_365, 97), (12_365, 128), (8191, 64)):
        parts = split_launches(n, nblocks, 128, 32)
        covered = [b for b0, b1, _ in parts for b in range(b0, b1)]
        assert covered == list(range(nblocks))
        assert all(bound % 16 == 0 for _, _, bound in parts[:-1])  # vectorizable main launch
        assert parts[-1][2] == n or n % 16 == 0


@pytest.mark.parametrize("launch", ((256, 4), (1024, 2)))
def test_other_launch_configs_bit_exact(launch: tuple[int, int]) -> None:
    x = _data(6_001, torch.bfloat16, seed=30)
    got = quantize(x, 64, pad_to=8192, launch=launch, **T)
    assert all(_same(a.cpu(), b) for a, b in zip(got, quantize_ref(x.cpu(), 64, pad_to=8192)))
    r = torch.zeros(6_001, device=DEV)
    r_ref = r.cpu().clone()
    got = quantize_ef(x, r, 64, launch=launch, **T)
    want = quantize_ef_ref(x.cpu(), r_ref, 64)
    assert all(_same(a.cpu(), b) for a, b in zip(got, want)) and _same(r.cpu(), r_ref)
    codes, scales = got
    y = dequantize(codes, scales, 64, numel=6_001, launch=launch, **T)
    assert _same(y.cpu(), dequantize_ref(codes.cpu(), scales.cpu(), 64, numel=6_001))
    cw, sw = torch.stack([codes, codes]), torch.stack([scales, scales])
    got = dequant_sum_requant(cw, sw, 64, launch=launch, **T)
    assert all(
        _same(a.cpu(), b) for a, b in zip(got, dequant_sum_requant_ref(cw.cpu(), sw.cpu(), 64))
    )
    with pytest.raises(ValueError, match="launch tile"):
        quantize(x, 64, launch=(96, 4), **T)


def test_int64_indexing_path_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 64-bit index variant (used from 2**31 elements) on a small input."""
    from verl_comm.kernels import ops

    monkeypatch.setattr(ops, "_FORCE_INT64", True)
    x = _data(5_003, torch.float32, seed=40)
    r = torch.zeros_like(x)
    r_ref = r.cpu().clone()
    got = quantize_ef(x, r, 128, **T)
    assert all(_same(a.cpu(), b) for a, b in zip(got, quantize_ef_ref(x.cpu(), r_ref, 128)))
    sr = {"stochastic": True, "seed": 9, "offset": 2**32 + 5}
    got = quantize(x, 128, **sr, **T)
    assert all(_same(a.cpu(), b) for a, b in zip(got, quantize_ref(x.cpu(), 128, **sr)))
    codes, scales = got
    y = dequantize(codes, scales, 128, numel=5_003, scale=0.5, **T)
    assert _same(y.cpu(), dequantize_ref(codes.cpu(), scales.cpu(), 128, numel=5_003, scale=0.5))
    cw, sw = torch.stack([codes, codes]), torch.stack([scales, scales])
    got = dequant_sum_requant(cw, sw, 128, return_sum=True, **T)
    want = dequant_sum_requant_ref(cw.cpu(), sw.cpu(), 128, return_sum=True)
    assert all(_same(a.cpu(), b) for a, b in zip(got, want))


def _send_rows(n_pad: int, w: int, block: int, fill: int) -> tuple[torch.Tensor, ...]:
    """Strided ``(W, M)`` codes and ``(W, M / B)`` scales views of a packed send buffer."""
    from verl_comm.kernels import packed_nbytes

    buf = torch.full((w, packed_nbytes(n_pad // w, block)), fill, dtype=torch.uint8, device=DEV)
    return unpack(buf, block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w,n", ((1, 5_003), (3, 5_003), (4, 1)))
@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_quantize_out_rows_bit_exact(dtype: torch.dtype, w: int, n: int, backend: str) -> None:
    """``out=`` (issue 28): codes and scales written in place into the strided rows of a
    packed send buffer equal a call without ``out`` bit for bit (nearest, stochastic, and
    error feedback with its residual); rows of only padding (n = 1, W = 4) get zeros."""
    block = 64
    x = _data(n, dtype, seed=n + w)
    n_pad = padded_numel(n, block, multiple=w)
    kw = {"pad_to": n_pad, "backend": backend}
    for extra in ({}, {"stochastic": True, "seed": 11, "offset": 5}):
        want = quantize(x, block, **extra, **kw)
        rows = _send_rows(n_pad, w, block, fill=0x55)
        got = quantize(x, block, out=rows, **extra, **kw)
        assert got[0] is rows[0] and got[1] is rows[1]
        assert _same(rows[0].reshape(-1), want[0]) and _same(rows[1].reshape(-1), want[1])
    x = _data(n, dtype, seed=1, specials=False)
    r0 = (_data(n, torch.float32, seed=2, specials=False) * 0.01).to(dtype)
    r1 = r0.clone()
    want = quantize_ef(x, r0, block, **kw)
    rows = _send_rows(n_pad, w, block, fill=0xAA)
    quantize_ef(x, r1, block, out=rows, **kw)
    assert _same(rows[0].reshape(-1), want[0]) and _same(rows[1].reshape(-1), want[1])
    assert _same(r1, r0)
    flat = torch.empty_like(want[0]), torch.empty_like(want[1])  # 1-D out as well
    quantize(x, block, out=flat, **kw)
    assert _same(flat[0], quantize(x, block, **kw)[0])


@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_dequant_sum_requant_out_bit_exact(backend: str) -> None:
    """``out=`` into this rank's row of a packed all-gather buffer: the bits of a call
    without ``out``; the fp32 sum is still returned with ``return_sum``."""
    w, m, block = 3, 1_024, 128
    codes, scales = quantize(_data(w * m, torch.float32, seed=4), block)
    c2, s2 = codes.view(w, m), scales.view(w, m // block)
    want = dequant_sum_requant(c2, s2, block, return_sum=True, backend=backend)
    g_codes, g_scales = _send_rows(w * m, w, block, fill=0x33)
    mine = g_codes[1], g_scales[1]
    got = dequant_sum_requant(c2, s2, block, return_sum=True, out=mine, backend=backend)
    assert got[0] is mine[0] and got[1] is mine[1]
    assert all(_same(a, b) for a, b in zip(got, want))
    assert (g_codes[0].view(torch.uint8) == 0x33).all()  # other rows untouched


def test_out_rejected_when_wrong() -> None:
    x = _data(1000, torch.float32, seed=0)
    codes, scales = quantize(x, 64)
    with pytest.raises(ValueError, match="1024"):
        quantize(x, 64, out=(codes[:512], scales[:8]), **T)
    with pytest.raises(TypeError, match="int8"):
        quantize(x, 64, out=(codes.view(torch.uint8), scales), **T)
    with pytest.raises(TypeError, match="tuple"):
        quantize(x, 64, out=[codes, scales], **T)
    with pytest.raises(ValueError, match="stride 1"):
        strided = torch.empty(1, 2048, dtype=torch.int8, device=DEV)[:, ::2]
        quantize(x, 64, out=(strided, scales.view(1, 16)), **T)
    c2, s2 = codes.view(2, 512), scales.view(2, 8)
    with pytest.raises(ValueError, match="1-D"):
        dequant_sum_requant(c2, s2, 64, out=(c2[:1], s2[:1]), **T)
