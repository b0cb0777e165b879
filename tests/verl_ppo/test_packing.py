"""Sequence packing: packed forward == padded forward (fp32, tiny Llama/Qwen2)."""

from __future__ import annotations

import pytest
import torch

from tests._models import tiny_causal_lm
from verl_ppo.roles.common import sequence_log_probs
from verl_ppo.roles.critic import ValueModel
from verl_ppo.step.packing import pack, packed_forward, packed_log_probs, packed_values

pytestmark = pytest.mark.timeout(120)
P, R = 5, 6


def _batch():
    """Left-padded prompts, right-padded responses, one 1-token response, one full row."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (4, P + R), generator=g)
    mask = torch.ones(4, P + R, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, P + 3 :] = 0  # response of 3 tokens
    mask[2, 0] = 0
    mask[2, P + 1 :] = 0  # response of 1 token
    return ids * mask, mask


def test_pack_layout_and_unpack_roundtrip():
    ids, mask = _batch()
    pb = pack(ids, mask)
    assert pb.num_tokens == int(mask.sum())
    assert torch.equal(pb.input_ids[0], ids[mask.bool()])
    assert torch.equal(pb.seq_lens, mask.sum(-1))
    # positions restart at 0 for each sequence and count valid tokens only
    starts = torch.cat([torch.zeros(1, dtype=torch.long), pb.seq_lens.cumsum(0)[:-1]])
    assert pb.position_ids[0, starts].eq(0).all()
    assert pb.position_ids[0, starts[1] - 1] == pb.seq_lens[0] - 1
    back = pb.unpack(pb.input_ids[..., None].float(), fill=-1.0)[..., 0]
    assert torch.equal(back, torch.where(mask.bool(), ids.float(), torch.tensor(-1.0)))


@pytest.mark.parametrize(
    "model_type,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2", "eager")]
)
def test_packed_log_probs_equal_padded(model_type, attn):
    m = tiny_causal_lm(model_type, attn=attn, train=False)
    ids, mask = _batch()
    ref, ref_ent = sequence_log_probs(m, ids, mask, P, temperature=0.7, with_entropy=True)
    got, ent = packed_log_probs(m, ids, mask, P, temperature=0.7, with_entropy=True)
    rm = mask[:, P:].bool()
    assert got.shape == ref.shape == (4, R)
    torch.testing.assert_close(got[rm], ref[rm], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[rm], ref_ent[rm], rtol=1e-5, atol=1e-5)
    assert got[~rm].eq(0).all() and ent[~rm].eq(0).all()


def test_attention_does_not_cross_sequences():
    """Negative control: the same packed row with positions NOT restarting differs."""
    m = tiny_causal_lm("llama", attn="sdpa", train=False)
    ids, mask = _batch()
    pb = pack(ids, mask)
    fn = lambda i, p: m(input_ids=i, position_ids=p, use_cache=False).logits  # noqa: E731
    good = pb.unpack(fn(pb.input_ids, pb.position_ids))
    ref = m(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)
    ).logits
    v = mask.bool()
    torch.testing.assert_close(good[v], ref[v], rtol=1e-5, atol=1e-5)
    flat = torch.arange(pb.num_tokens)[None]  # one long sequence: later rows see earlier ones
    bad = pb.unpack(fn(pb.input_ids, flat))
    assert (bad[v] - ref[v]).abs().max() > 1e-2


def test_packed_values_and_gradients_equal_padded():
    policy = tiny_causal_lm("qwen2", attn="sdpa", train=False)
    vm = ValueModel(policy.model, 32)
    torch.nn.init.normal_(vm.value_head.weight, std=0.5)
    ids, mask = _batch()
    rm = mask[:, P:].float()
    ref = vm(ids, mask)[:, P - 1 : -1]
    (ref * rm).sum().backward()
    g_ref = [p.grad.clone() for p in vm.parameters()]
    vm.zero_grad()
    got = packed_values(vm, ids, mask, P)
    (got * rm).sum().backward()
    torch.testing.assert_close(got * rm, ref * rm, rtol=1e-5, atol=1e-5)
    for p, g in zip(vm.parameters(), g_ref):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_packed_forward_generic_fn_shape():
    m = tiny_causal_lm("llama", attn="sdpa", train=False)
    ids, mask = _batch()
    out = packed_forward(
        lambda i, p: m.model(input_ids=i, position_ids=p, use_cache=False).last_hidden_state,
        ids,
        mask,
    )
    assert out.shape == (4, P + R, 32) and out[~mask.bool()].eq(0).all()


def test_bad_input_is_named():
    m = tiny_causal_lm("llama", attn="sdpa", train=False)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="attention_mask"):
        pack(ids, mask[:, :-1])
    with pytest.raises(ValueError, match="no valid token"):
        pack(ids, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="prompt_len"):
        packed_log_probs(m, ids, mask, 0)
