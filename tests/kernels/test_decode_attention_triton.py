"""The split-K decode attention kernel (kernels/decode_attention.py) against
``scaled_dot_product_attention`` with the cache's boolean mask, in fp32 (Triton's interpreter
on CPU, the compiled kernel on a CUDA machine, with tl.dot in full fp32 there: see the
tolerance)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from verl_comm.kernels.decode_attention import decode_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(q, k, v, valid, scale):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = valid[:, None, None, :]
    return F.scaled_dot_product_attention(q[:, :, None], kk, vv, attn_mask=mask, scale=scale)[
        :, :, 0
    ]


@pytest.mark.parametrize("split", [16, None])
@pytest.mark.parametrize("groups", [1, 3])
def test_matches_sdpa_over_padded_and_unwritten_slots(groups: int, split: int | None) -> None:
    """Left padding, a hole of masked slots (holding a NaN key and a NaN value), and slots
    past ``length`` holding garbage (never written by a real step): the kernel must ignore
    all three. ``split=16``: three
    splits and the merge kernel; None: the default (one split on the CPU: no merge)."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, S, D, L = 3, 2, 40, 16, 29
    q = torch.randn(B, Hkv * groups, D, generator=g).to(DEV)
    k = torch.randn(B, Hkv, S, D, generator=g).to(DEV)
    v = torch.randn(B, Hkv, S, D, generator=g).to(DEV)
    valid = torch.zeros(B, S, dtype=torch.bool, device=DEV)
    valid[:, :L] = True
    valid[0, :5] = False  # left padding
    valid[2, 3:9] = False
    k[:, :, L:] = 1e4  # past length: would dominate the softmax if read
    k[2, :, 4] = float("nan")  # a masked slot below length: read, but its score is masked
    v[2, :, 5] = float("nan")  # its value must not be read
    scale = 1 / math.sqrt(D)
    # split 16 -> 3 splits, the last one empty (starts at 32 >= L)
    length = torch.tensor([L], device=DEV)
    out = decode_attention(q, k, v, valid, length, scale, split=split, block_n=16)
    # sdpa adds the mask to the scores (NaN + -inf = NaN): give it the NaN slots zeroed
    want = _reference(
        q, k.nan_to_num(0.0), v.nan_to_num(0.0), valid & (torch.arange(S, device=DEV) < L), scale
    )
    # fp32 softmax-weighted sums of O(1) values over <= 40 slots: a few ulp each on CPU; on
    # the GPU tl.dot rounds its fp32 inputs to tf32 (10-bit mantissa, 2**-11 relative)
    tol = 1e-5 if DEV == "cpu" else 4e-3
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


def test_default_split_is_one_when_the_pairs_fill_the_gpu() -> None:
    from verl_comm.kernels.decode_attention import default_split

    cpu = torch.device("cpu")  # one "SM"
    assert default_split(6, 40, 16, cpu) == 48  # one split, rounded up to block_n
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        assert default_split(sms, 512, 64, dev) == 512
        s = default_split(4, 4096, 64, dev)  # few pairs: about 2 programs per SM
        assert s % 64 == 0 and 4 * -(-4096 // s) >= sms


def test_bad_shapes_are_refused() -> None:
    q, k = torch.zeros(2, 3, 16, device=DEV), torch.zeros(2, 2, 8, 16, device=DEV)
    valid, length = torch.ones(2, 8, dtype=torch.bool, device=DEV), torch.tensor([8], device=DEV)
    with pytest.raises(ValueError, match="divisible"):
        decode_attention(q, k, k, valid, length, 1.0)
    with pytest.raises(ValueError, match="multiple of block_n"):
        decode_attention(q[:, :2], k, k, valid, length, 1.0, split=24, block_n=16)


BF16_DOT = pytest.mark.skipif(
    DEV == "cpu", reason="Triton's interpreter gives garbage for a bf16 tl.dot (CUDA only)"
)


@pytest.mark.parametrize("split", [16, None])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=BF16_DOT)])
def test_rope_and_cache_write_inside_equal_the_eager_step(split: int | None, dtype) -> None:
    """``rope=``: the kernel rotates q and the new key, writes the new key and value at slot
    ``length - 1`` and attends over it: the same cache and output as the eager step
    (rotate-half RoPE, ``index_copy_`` into the cache, then attention over the written
    slots). q, k, v are views into one fused projection row (strided heads); split 16: the
    new slot (32) opens the third split, so that split holds only it."""
    from verl_ppo.rollout.tp_model import _rope_ref

    g = torch.Generator().manual_seed(1)
    B, Hkv, G, S, D, slot = 3, 2, 3, 40, 16, 32
    qkv = torch.randn(B, (Hkv * G + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    q, k, v = qkv.split((Hkv * G * D, Hkv * D, Hkv * D), dim=1)
    q, k, v = q.view(B, Hkv * G, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    f = torch.tensor([40.0, 7.0, 33.0])[:, None] * inv
    cos, sin = (
        t.to(DEV, dtype) for t in (torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin())
    )
    kc = torch.randn(B, Hkv, S, D, generator=g).to(DEV, dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(DEV, dtype)
    valid = torch.zeros(B, S, dtype=torch.bool, device=DEV)
    valid[:, : slot + 1] = True
    valid[0, :5] = False  # left padding
    length = torch.tensor([slot + 1], device=DEV)
    # the eager step: RoPE in fp32 rounded once, the cache written, attention over it
    qr, kr = _rope_ref(q.float(), k.float(), cos.float()[:, None], sin.float()[:, None])
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref[:, :, slot], vc_ref[:, :, slot] = kr.to(dtype), v
    want = _reference(qr.to(dtype).float(), kc_ref.float(), vc_ref.float(), valid, 0.25)

    from verl_comm.kernels.decode_attention import RopeNew

    out = decode_attention(
        q, kc, vc, valid, length, 0.25, split=split, block_n=16, rope=RopeNew(k, v, cos, sin)
    )
    # the rotated key: one rounding of the same fp32 value (a few fp32 ulp, one bf16 ulp);
    # the value is copied
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(kc.float(), kc_ref.float(), atol=rtol, rtol=rtol)
    assert torch.equal(vc, vc_ref)
    # output: the fp32 tolerance of the test above; in bf16 the rotated q and each softmax
    # weight are rounded to bf16 before their products (2**-8 relative each, O(1) values)
    tol = (1e-5 if DEV == "cpu" else 4e-3) if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
