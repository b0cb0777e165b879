"""Helpers shared by the resharding tests and benchmark (like ``torch.testing``); their
multi-process runs use :func:`verl_comm.distributed.launch.spawn`.

- :func:`tiny_config`: small Llama / Qwen2 / GPT-2 configs.
- :func:`random_full_state`: seeded full weights from specs (every rank gets the same).
- :func:`emulated_train_shards`: what a rank would hold in a layout, sliced from full
  weights (an emulated training layout, for planner/executor tests and benchmarks only;
  the trainer reads the engines' real holdings).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ppo.reshard.planner import ReshardPlan
from verl_ppo.reshard.specs import ParamSpec, slice_shard


def tiny_config(kind: str = "llama", **overrides: Any):
    """A small HF config: ``"llama"`` (8 heads / 4 KV heads, untied), ``"qwen2"``
    (8 / 2, tied, q/k/v biases), ``"gpt2"`` (4 heads, tied); overrides win."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if kind == "gpt2":
        kw = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        kw.update(overrides)
        return GPT2Config(**kw, bos_token_id=0, eos_token_id=1)
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4 if kind == "llama" else 2,
        tie_word_embeddings=kind != "llama",
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    kw.update(overrides)
    return (LlamaConfig if kind == "llama" else Qwen2Config)(**kw)


def random_full_state(
    specs: tuple[ParamSpec, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Seeded random full weights, N(0, 0.02^2) (norm weights near 1), identical on every rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for s in specs:
        t = torch.randn(s.shape, generator=g) * 0.02
        if s.split == "replicated" and len(s.shape) == 1 and "norm" in s.name or ".ln_" in s.name:
            t = t + 1.0
        out[s.name] = t.to(device=device, dtype=dtype)
    return out


def emulated_train_shards(
    plan: ReshardPlan, rank: int, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What ``rank`` would hold in ``plan.train``, sliced from full weights (copies).

    An emulation of the training layout for tests and benchmarks of the planner and
    executor; training engines are read as they are (``HybridEngine.train_shards``)."""
    return {s.name: slice_shard(full[s.name], sh) for _, s, sh in plan.held(rank)}


def expected_rollout(
    plan: ReshardPlan, rank: int, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``rank``'s rollout shards sliced directly from full weights (the reference)."""
    return {s.name: slice_shard(full[s.name], sh) for _, s, sh in plan.held(rank, rollout=True)}
