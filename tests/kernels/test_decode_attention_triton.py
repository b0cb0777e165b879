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
