"""Shape numbers of a HF decoder config (the Llama family and GPT-2), read once.

Used by the resharding engine (shard boxes), the TP rollout model (local heads) and the
performance counters (FLOPs per token, bytes per decode step); kept apart from both so
that neither package imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_ppo.job.model_family import LLAMA_FAMILY


@dataclass(frozen=True)
class ModelDims:
    """The shape numbers validation needs, read once from an HF-style config."""

    model_type: str
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied: bool


def model_dims(config: Any) -> ModelDims:
    """Read dims from a ``transformers.PretrainedConfig`` (or any object with the same
    attribute names; the GPU benchmark passes a ``SimpleNamespace``).

    Raises:
        ValueError: unsupported ``model_type``.
    """
    mt = getattr(config, "model_type", "")
    tied = bool(getattr(config, "tie_word_embeddings", True))
    if mt in LLAMA_FAMILY:
        heads = config.num_attention_heads
        hd = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return ModelDims(
            mt,
            config.num_hidden_layers,
            heads,
            kv,
            hd,
            config.hidden_size,
            config.intermediate_size,
            config.vocab_size,
            tied,
        )
    if mt == "gpt2":
        heads, h = config.n_head, config.n_embd
        inner = getattr(config, "n_inner", None) or 4 * h
        return ModelDims(
            mt, config.n_layer, heads, heads, h // heads, h, inner, config.vocab_size, tied
        )
    raise ValueError(
        f"model_type {mt!r} is not supported by the resharding engine and the TP rollout model; "
        f"supported: {', '.join(LLAMA_FAMILY)}, gpt2"
    )
