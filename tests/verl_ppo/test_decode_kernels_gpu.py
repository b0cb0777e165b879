"""The rollout's CUDA decode kernels (one-pass sampler, split-K decode attention) against the
paths they replace; skipped without CUDA. CPU coverage: tests/kernels/test_sampling_triton.py
and test_decode_attention_triton.py run the same kernels in Triton's interpreter."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests._models import left_padded_prompts, tiny_causal_lm
from tests.verl_ppo._decoders import assert_decoders_match_generate
from verl_ppo.rollout.cuda_graph import StaticCacheDecoder

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode kernels need CUDA"),
    pytest.mark.timeout(300),
]


def test_decode_attention_matches_sdpa_in_bf16():
    from verl_comm.kernels.decode_attention import decode_attention

    g = torch.Generator("cuda").manual_seed(0)
    B, Hkv, G, S, D, L = 16, 2, 7, 512, 64, 300
    kw = dict(device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = (
        torch.randn(B, Hkv * G, D, **kw),
        torch.randn(B, Hkv, S, D, **kw),
        torch.randn(B, Hkv, S, D, **kw),
    )
    valid = torch.zeros(B, S, dtype=torch.bool, device="cuda")
    valid[:, 37:L] = True
    out = decode_attention(q, k, v, valid, torch.tensor([L], device="cuda"), 1 / math.sqrt(D))
    kk, vv = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    want = F.scaled_dot_product_attention(
        q.float()[:, :, None], kk, vv, attn_mask=valid[:, None, None, :]
    )[:, :, 0]
    # bf16 inputs, fp32 accumulation, bf16 output: within 2 bf16 ulps of O(1) outputs
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_sampler_follows_softmax_on_cuda():
    from verl_ppo.rollout.sampler import SamplingParams, sample_next

    row = torch.tensor([1.5, 0.5, float("-inf"), 0.0, -1.0], device="cuda")
    n = 200_000
    logits = row.repeat(n, 1)
    gen = torch.Generator("cuda").manual_seed(3)
    tok, lp = sample_next(logits, SamplingParams(temperature=1.0), gen)
    p = torch.softmax(row, -1)
    freq = torch.bincount(tok, minlength=5).double() / n
    sd = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p.double()).abs() <= 5 * sd + 1e-12).all(), (freq, p)
    torch.testing.assert_close(lp, torch.log(p)[tok], atol=1e-5, rtol=0)
    again, _ = sample_next(logits, SamplingParams(), torch.Generator("cuda").manual_seed(3))
    assert torch.equal(tok, again)


@pytest.mark.parametrize("graph", [False, True])
def test_fused_decode_equals_sdpa_decode_and_hf_generate_in_bf16(graph):
    """Greedy and sampled with one seed: the decoder with the decode kernel gives the tokens
    of the same decoder on sdpa and of HF's eager generate (well-separated logits:
    initializer_range 0.3, so bf16 rounding differences do not flip a token)."""
    m = tiny_causal_lm("qwen2", head_dim=16, initializer_range=0.3, train=False)
    m = m.to("cuda", torch.bfloat16)
    ids, mask = left_padded_prompts(
        seed=3, shape=(3, 6), vocab=(1, 50), pads={0: 2, 2: 1}, device="cuda"
    )
    fused = StaticCacheDecoder(m, max_seq_len=64, use_cuda_graph=graph)
    plain = StaticCacheDecoder(m, max_seq_len=64, use_cuda_graph=graph)
    assert fused.tp_model.decode_kernel
    plain.tp_model.decode_kernel = False
    assert_decoders_match_generate(m, {"fused": fused, "sdpa": plain}, ids, mask, 12)
