"""The fused decode step of the rollout model on the CPU: fused q/k/v and gate/up copies,
and the single-token path through the Triton kernels (RoPE + cache write, split-K
attention) in Triton's interpreter, against the unfused eager static-cache decoder.

On a CUDA machine the decoder turns both on by itself (tests/verl_ppo/test_decode_kernels_gpu.py
checks the bf16 result there); here they are switched on by hand, in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._models import left_padded_prompts, tiny_causal_lm
from verl_ppo.rollout.cuda_graph import StaticCacheDecoder
from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup

pytestmark = pytest.mark.timeout(180)
PROMPTS = dict(seed=3, shape=(3, 6), vocab=(1, 50), pads={0: 2, 2: 1})
GEN = dict(max_new_tokens=8, eos_token_id=-1, pad_token_id=0)


def _decoders(m, kernels: bool):
    plain = StaticCacheDecoder(m, max_seq_len=32, use_cuda_graph=False)
    fused = StaticCacheDecoder(m, max_seq_len=32, use_cuda_graph=False)
    fused.tp_model.fuse_projections()
    if kernels:  # the CUDA decode path, in Triton's interpreter
        fused.tp_model.decode_kernel = True
    return plain, fused


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_projections_give_the_unfused_logits_and_follow_weight_updates(model_type):
    m = tiny_causal_lm(model_type, head_dim=8, initializer_range=0.3, train=False)
    ids, mask = left_padded_prompts(**PROMPTS)
    plain, fused = _decoders(m, kernels=False)
    # one GEMM over [q; k; v] against three: the same dot products, summed in another
    # order at most (fp32, 32-long rows of O(1) values: ~1e-6 relative)
    torch.testing.assert_close(
        fused.prefill(ids, mask), plain.prefill(ids, mask), rtol=1e-5, atol=1e-5
    )
    with torch.no_grad():  # an optimizer step, in place, as ZeRO 0-2 does
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    a = fused.generate(ids, mask, do_sample=False, **GEN)
    b = plain.generate(ids, mask, do_sample=False, **GEN)
    assert torch.equal(a, b)  # stale fused copies would give other tokens


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU model through Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py "
    "without CUDA); on CUDA tests/verl_ppo/test_decode_kernels_gpu.py covers this path",
)
def test_single_token_kernel_path_gives_the_eager_tokens_greedy_and_sampled():
    m = tiny_causal_lm("qwen2", head_dim=8, initializer_range=0.3, train=False)
    ids, mask = left_padded_prompts(**PROMPTS)
    plain, fused = _decoders(m, kernels=True)
    for sample in (False, True):
        kw = dict(do_sample=sample, **GEN)
        a = fused.generate(ids, mask, generator=torch.Generator().manual_seed(1), **kw)
        b = plain.generate(ids, mask, generator=torch.Generator().manual_seed(1), **kw)
        assert torch.equal(a, b)


def test_no_fused_copies_for_gpt2_and_refresh_without_them_is_a_no_op():
    m = tiny_causal_lm("gpt2", n_embd=32, n_layer=2, n_head=4, train=False)
    tp = TPCausalLM(m.config, dict(m.named_parameters()), TPGroup.single())
    assert tp.fused_nbytes() == 0
    tp.fuse_projections()
    tp.refresh_fused()
    assert tp.fused is None
