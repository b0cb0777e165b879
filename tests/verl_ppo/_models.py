"""The tiny random Hugging Face models the CPU tests build (one definition of their shape)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY_FIELDS: dict[str, Any] = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""2 layers, hidden 32, FFN 64, 4 query heads, 2 KV heads (GQA), vocabulary 50."""


def tiny_causal_lm(
    model_type: str, *, seed: int = 0, attn: str | None = None, **fields: Any
) -> torch.nn.Module:
    """A ``model_type`` causal LM of :data:`TINY_FIELDS` (``fields`` replace or add config
    fields), fp32 on the CPU in train mode, its weights drawn after ``torch.manual_seed(seed)``.

    Args:
        attn: the config's ``_attn_implementation`` (None: transformers' default).
    """
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**TINY_FIELDS, **fields})
    if attn is not None:
        cfg._attn_implementation = attn
    return AutoModelForCausalLM.from_config(cfg)


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
