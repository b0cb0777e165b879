"""ModelFlops.forward against a count made by hand, position by position (causal attention)."""

import torch
from transformers import LlamaConfig

from verl_ppo.observe.perf import ModelFlops


def _hand_count(cfg: LlamaConfig, seq_lens: list[int], head_tokens: int) -> int:
    h, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    per_token_layer = (
        h * h  # q
        + 2 * h * cfg.num_key_value_heads * hd  # k, v
        + h * h  # o
        + 3 * h * cfg.intermediate_size  # gate, up, down
    )
    flops = 2 * per_token_layer * cfg.num_hidden_layers * sum(seq_lens)
    flops += 2 * cfg.vocab_size * h * head_tokens
    for n in seq_lens:  # query i sees keys 0..i: q.k and p.v, 2 * head_dim FLOPs each
        for i in range(n):
            for _key in range(i + 1):
                flops += 2 * (2 * hd) * cfg.num_attention_heads * cfg.num_hidden_layers
    return flops


def test_forward_flops_equal_a_hand_count_with_causal_attention():
    cfg = LlamaConfig(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        num_hidden_layers=2,
        vocab_size=10,
    )
    mf = ModelFlops.of(cfg)
    for lens, head in (([3, 1], 2), ([7, 5, 1], 0), ([1], 1)):
        got = mf.forward(torch.tensor(lens), head)
        # integers below 2**53: the float64 sum is exact
        assert got == _hand_count(cfg, lens, head), (lens, got, _hand_count(cfg, lens, head))
    # a 3-token sequence has 6 causal (query, key) pairs, not 9
    body = mf.forward(torch.tensor([3]), 0) - 2 * mf.body * 3
    assert body == 6 * (4 * 4) * 2 * 2  # pairs x (4 x head_dim 4) x heads 2 x layers 2
