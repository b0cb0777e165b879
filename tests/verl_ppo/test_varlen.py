"""Packed rows through torch's varlen attention (verl_ppo.step.varlen).

On the CPU the adapter (HF attention interface, layouts, GQA, the keyword arguments through
the model) is checked with the per-sequence sdpa reference kernel standing in for the CUDA
kernel; on CUDA the real ``varlen_attn`` is checked against the padded path.
"""

from __future__ import annotations

import pytest
import torch

from tests._models import tiny_causal_lm
from verl_ppo.roles.common import sequence_log_probs
from verl_ppo.step import varlen
from verl_ppo.step.packing import pack, packed_attention, packed_log_probs

pytestmark = pytest.mark.timeout(120)
P, R = 5, 6


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (4, P + R), generator=g)
    mask = torch.ones(4, P + R, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, P + 3 :] = 0
    mask[2, 0] = 0
    mask[2, P + 1 :] = 0
    return (ids * mask).to(device), mask.to(device)


@pytest.fixture
def reference_kernel():
    varlen.register(varlen.reference_kernel)
    yield
    varlen.register(None)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_adapter_equals_padded_forward_and_backward(model_type, reference_kernel):
    """fp32: the same sums in another order per sequence, so a few ulps of the logits."""
    m = tiny_causal_lm(model_type, attn="sdpa", train=True)
    ids, mask = _batch()
    rm = mask[:, P:].bool()
    ref = sequence_log_probs(m, ids, mask, P)[0]
    ref[rm].sum().backward()
    ref_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    pb = pack(ids, mask)
    with varlen.varlen_model(m):
        assert m.config._attn_implementation == varlen.NAME
        logits = m(
            input_ids=pb.input_ids,
            position_ids=pb.position_ids,
            attention_mask=None,
            use_cache=False,
            **varlen.packed_kwargs(pb.seq_lens),
        ).logits
    assert m.config._attn_implementation == "sdpa"  # restored
    full = pb.unpack(logits.float())  # (B, L, V)
    logp = torch.log_softmax(full[:, P - 1 : -1], -1).gather(-1, ids[:, P:, None])[..., 0]
    torch.testing.assert_close(logp[rm], ref[rm], rtol=1e-5, atol=1e-5)
    logp[rm].sum().backward()
    for p, g in zip(m.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)


def test_packed_kwargs_skip_empty_rows():
    kw = varlen.packed_kwargs(torch.tensor([3, 0, 5, 1]))
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 8, 9]
    assert kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["max_length_q"] == 5 and isinstance(kw["max_length_q"], int)


def test_unpacked_call_is_refused(reference_kernel):
    m = tiny_causal_lm("llama", attn="sdpa", train=False)
    ids, mask = _batch()
    with varlen.varlen_model(m), pytest.raises(ValueError, match="runs packed rows only"):
        m(input_ids=ids, attention_mask=mask)


def test_cpu_keeps_the_dense_mask_path():
    m = tiny_causal_lm("llama", attn="sdpa", train=False)
    ctx, kwargs = packed_attention(m, pack(*_batch()))
    assert kwargs == {} and varlen.available() is not None or torch.cuda.is_available()


def test_packing_auto_names_why_it_is_off_on_the_cpu():
    from verl_ppo.config import build_config
    from verl_ppo.job.fast_path import ModelFacts, resolve

    facts = ModelFacts("LlamaForCausalLM", None, None, 2, "sdpa")
    job = resolve(build_config(None), False, facts)
    assert job.sequence_packing is False
    assert "no CUDA device" in job.reasons["train.sequence_packing"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's varlen kernels)")
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_varlen_on_cuda_is_within_bf16_noise_of_padded(model_type):
    """bf16 packed (varlen_attn) and bf16 padded (sdpa) against the fp32 padded result: the
    packed error may not exceed twice the padded one plus one bf16 step of a log-prob."""
    m = tiny_causal_lm(model_type, attn="sdpa", train=False, seed=1).cuda()
    ids, mask = _batch("cuda")
    rm = mask[:, P:].bool()
    exact = sequence_log_probs(m, ids, mask, P)[0][rm]
    mb = m.to(torch.bfloat16)
    pb = pack(ids, mask)
    ctx, kwargs = packed_attention(mb, pb)
    assert "cu_seq_lens_q" in kwargs  # the varlen path, not the dense mask
    padded = sequence_log_probs(mb, ids, mask, P)[0][rm]
    packed = packed_log_probs(mb, ids, mask, P)[0][rm]
    err_pad = (padded - exact).abs().max().item()
    err_pack = (packed - exact).abs().max().item()
    step = 2.0**-8 * exact.abs().max().item()
    assert err_pack <= 2 * err_pad + step, (err_pack, err_pad, step)
