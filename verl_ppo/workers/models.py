"""Building the policy, reference and value models from the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_ppo.data.model_store import resolve_model_path


def load_tokenizer(model_cfg: Any) -> Any:
    """The tokenizer of ``model.path`` (or SmolLM2's), left padding, pad = eos if unset."""
    return tokenizer_for_generation(resolve_model_path(model_cfg.path))


def tokenizer_for_generation(path: str | Path) -> Any:
    """The tokenizer of the HF folder ``path`` set up for batched generation: left
    padding, pad = eos if it has no pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _tiny_config(model_cfg: Any, tokenizer: Any) -> Any:
    """A HF config from ``model.tiny``: ``model_type`` (default llama) plus its fields."""
    from transformers import AutoConfig

    fields = {"vocab_size": len(tokenizer), "tie_word_embeddings": True, **model_cfg.tiny}
    model_type = fields.pop("model_type", "llama")
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(
            f"model.tiny.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens"
        )
    return AutoConfig.for_model(model_type, **fields)


def build_policy(model_cfg: Any, tokenizer: Any, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The policy (a HF causal LM): ``model.tiny`` random init (seeded) or pretrained weights."""
    from transformers import AutoModelForCausalLM

    if model_cfg.tiny is not None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_tiny_config(model_cfg, tokenizer))
        return model.to(dtype)
    path: Path = resolve_model_path(model_cfg.path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def build_value_model(policy: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A :class:`~verl_ppo.roles.critic.ValueModel` whose backbone is a copy of the policy's
    base model (same initial weights, separate parameters)."""
    import copy

    from verl_ppo.roles.critic import ValueModel

    backbone = copy.deepcopy(
        policy.get_decoder() if hasattr(policy, "get_decoder") else policy.model
    )
    return ValueModel(backbone, policy.config.hidden_size).to(dtype)


def check_uniform_dtype(module: torch.nn.Module, dtype: torch.dtype, what: str) -> None:
    """Raise if any floating parameter or buffer of ``module`` is not ``dtype``.

    The run uses one ``amp_dtype``; a module left in another float dtype by accident would
    silently compute in it.

    Raises:
        TypeError: naming the first offending tensor.
    """
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_floating_point() and t.dtype != dtype and "inv_freq" not in name:
            raise TypeError(
                f"{what}: {name} is {t.dtype}, expected {dtype} (amp_dtype); "
                "convert the module with .to(dtype) or set amp_dtype accordingly"
            )
