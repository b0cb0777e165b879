"""The small models and batches the CPU tests build (one definition of each).

Imports only torch at module level, so the verl_comm tests use it without the ``ppo`` extra;
transformers is imported by the functions that build Hugging Face models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

TINY_FIELDS: dict[str, Any] = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""2 layers, hidden 32, FFN 64, 4 query heads, 2 KV heads (GQA), vocabulary 50."""


def causal_lm(config: Any, *, seed: int = 0, train: bool = True) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)``, fp32 on the CPU, its weights drawn after
    ``torch.manual_seed(seed)``; in eval mode unless ``train``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).train(train)


def tiny_causal_lm(
    model_type: str,
    *,
    seed: int = 0,
    attn: str | None = None,
    train: bool = True,
    **fields: Any,
) -> torch.nn.Module:
    """A ``model_type`` causal LM of :data:`TINY_FIELDS` (``fields`` replace or add config
    fields) built by :func:`causal_lm`.

    Args:
        attn: the config's ``_attn_implementation`` (None: transformers' default).
    """
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **{**TINY_FIELDS, **fields})
    if attn is not None:
        cfg._attn_implementation = attn
    return causal_lm(cfg, seed=seed, train=train)


def mlp(*widths: int, activation: type[torch.nn.Module] | None = None, seed: int = 0):
    """``Linear(widths[0], widths[1])``, ``activation()``, ..., ``Linear(widths[-2],
    widths[-1])`` as a ``torch.nn.Sequential`` (no activation after the last layer), fp32 on
    the CPU, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i and activation is not None:
            layers.append(activation())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


def left_padded_prompts(
    seed: int,
    shape: tuple[int, int],
    vocab: tuple[int, int],
    pads: Mapping[int, int],
    pad_id: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)``, both int64 ``(batch, length)`` = ``shape``: token ids drawn uniformly
    from ``[vocab[0], vocab[1])`` by a generator seeded with ``seed``; row ``r`` left-padded
    by ``pads[r]`` positions (mask 0, id ``pad_id``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab[0], vocab[1], shape, generator=g)
    mask = torch.ones_like(ids)
    for row, n in pads.items():
        mask[row, :n] = 0
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids.to(device), mask.to(device)


def tiny_reward_classifier(path: Any, num_labels: int, **fields: Any) -> Any:
    """A tiny random BERT sequence classifier (2 layers, hidden 32) with ``num_labels``
    labels, saved with the packaged MiniLM tokenizer into ``path`` (a folder
    ``reward.model`` can name; ``fields`` replace or add config fields). Returns ``path``."""
    import shutil
    from pathlib import Path

    from transformers import BertConfig, BertForSequenceClassification

    from verl_ppo.reward.model import default_encoder_path

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=num_labels,
        **fields,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(path)
    src = default_encoder_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / f, Path(path) / f)
    return path
