"""The KV-cache sampler matches HF greedy decoding and masks correctly."""

import torch

from tests._models import tiny_causal_lm
from verl_ppo.rollout.generate import filter_logits, generate, response_mask_from

MODEL = dict(model_type="llama", vocab_size=64, max_position_embeddings=64, train=False)


def test_greedy_matches_hf_generate_with_left_padding():
    m = tiny_causal_lm(**MODEL)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ours = generate(
        m, ids, mask, max_new_tokens=6, eos_token_id=63, pad_token_id=0, do_sample=False
    )
    hf = m.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=63,
        pad_token_id=0,
    )
    n = min(ours.shape[1], hf.shape[1])
    assert torch.equal(ours[:, :n], hf[:, :n])


def test_left_padding_does_not_change_the_response():
    m = tiny_causal_lm(**MODEL)
    a = generate(
        m,
        torch.tensor([[5, 6, 7]]),
        torch.ones(1, 3, dtype=torch.long),
        max_new_tokens=5,
        eos_token_id=63,
        pad_token_id=0,
        do_sample=False,
    )
    b = generate(
        m,
        torch.tensor([[0, 0, 5, 6, 7]]),
        torch.tensor([[0, 0, 1, 1, 1]]),
        max_new_tokens=5,
        eos_token_id=63,
        pad_token_id=0,
        do_sample=False,
    )
    assert torch.equal(a[:, 3:], b[:, 5:])


def test_sampling_is_reproducible_with_a_generator():
    m = tiny_causal_lm(**MODEL)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    kw = dict(max_new_tokens=8, eos_token_id=63, pad_token_id=0, do_sample=True)
    a = generate(m, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    b = generate(m, ids, mask, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b)


def test_response_mask_includes_first_eos_only_even_when_pad_equals_eos():
    resp = torch.tensor([[4, 9, 2, 9, 9], [4, 4, 4, 4, 4]])
    m = response_mask_from(resp, eos_token_id=9, pad_token_id=9)
    assert m.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_top_k_top_p_filtering():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    k = filter_logits(logits, top_k=2)
    assert torch.isinf(k[0, :2]).all() and torch.isfinite(k[0, 2:]).all()
    p = filter_logits(logits, top_p=0.5)
    assert torch.isfinite(p[0, 3]) and torch.isinf(p[0, 0])
