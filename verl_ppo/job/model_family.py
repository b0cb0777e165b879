"""Where things are in the HF model families verl_ppo supports (the Llama family and
GPT-2): the parameter names (:data:`LLAMA_NAMES`, :data:`GPT2_NAMES`, the one table the
shard specs, the TP rollout model and the pipeline stages read), the base model of a
causal LM and its repeated decoder layers.

Used by the fused LM head (:mod:`verl_ppo.roles.fused_head`), packed forwards
(:mod:`verl_ppo.step.packing`), regional compilation (:mod:`verl_ppo.step.compiled`) and the job's
model facts (:mod:`verl_ppo.job.fast_path`); it imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch


def decoder_of(model: Any) -> torch.nn.Module:
    """The base model of a HF causal LM (returns ``last_hidden_state``)."""
    if hasattr(model, "get_decoder"):
        dec = model.get_decoder()
        if dec is not None:
            return dec
    return model.base_model


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated decoder layers of a HF causal LM, a HF base model or a
    :class:`~verl_ppo.roles.critic.ValueModel` (``layers``; GPT-2: ``h``), or ``[]`` when
    it has none we know."""
    base = getattr(model, "module", model)  # a DeepSpeed engine: its module
    base = getattr(base, "backbone", base)  # ValueModel: the copied base model
    for _ in range(2):  # a causal LM -> its base model
        for name in ("layers", "h"):
            layers = getattr(base, name, None)
            if isinstance(layers, torch.nn.ModuleList):
                return list(layers)
        try:
            base = decoder_of(base)
        except AttributeError:
            return []
    return []


LLAMA_FAMILY = ("llama", "qwen2", "mistral")
"""``model_type`` values with separate q/k/v/o and gate/up/down projections, RMSNorm, RoPE."""


@dataclass(frozen=True)
class FamilyNames:
    """HF parameter names of one model family (the one table verl_ppo reads them from).

    Attributes:
        base: the base model's prefix in a causal LM (``model.``, GPT-2 ``transformer.``).
        embed, layers, final_norm: module names under the base model.
        parts: a decoder layer's modules by role (``q``, ``o``, ``gate``, ``attn_norm``, ...).
        lm_head: the untied output projection (a module of the causal LM, not of its base).
    """

    base: str
    embed: str
    layers: str
    final_norm: str
    parts: Mapping[str, str]
    lm_head: str = "lm_head"

    def embed_prefix(self, base: str | None = None) -> str:
        """``model.embed_tokens.`` (``base`` replaces the prefix, e.g. ``backbone.``)."""
        return f"{self.base if base is None else base}{self.embed}."

    def embed_weight(self, base: str | None = None) -> str:
        """``model.embed_tokens.weight``."""
        return f"{self.embed_prefix(base)}weight"

    def head_weight(self) -> str:
        """``lm_head.weight``."""
        return f"{self.lm_head}.weight"

    def layer(self, i: int, base: str | None = None) -> str:
        """Prefix of decoder layer ``i``: ``model.layers.3.``."""
        return f"{self.base if base is None else base}{self.layers}.{i}."

    def norm(self, base: str | None = None) -> str:
        """Prefix of the final norm: ``model.norm.``."""
        return f"{self.base if base is None else base}{self.final_norm}."

    def param(self, i: int, part: str, kind: str = "weight") -> str:
        """``model.layers.3.self_attn.q_proj.weight`` for ``(3, "q")``."""
        return f"{self.layer(i)}{self.parts[part]}.{kind}"


LLAMA_NAMES = FamilyNames(
    "model.",
    "embed_tokens",
    "layers",
    "norm",
    MappingProxyType(
        {
            "q": "self_attn.q_proj",
            "k": "self_attn.k_proj",
            "v": "self_attn.v_proj",
            "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj",
            "up": "mlp.up_proj",
            "down": "mlp.down_proj",
            "attn_norm": "input_layernorm",
            "mlp_norm": "post_attention_layernorm",
        }
    ),
)
GPT2_NAMES = FamilyNames(
    "transformer.",
    "wte",
    "h",
    "ln_f",
    MappingProxyType(
        {
            "attn_norm": "ln_1",
            "qkv": "attn.c_attn",
            "o": "attn.c_proj",
            "mlp_norm": "ln_2",
            "fc": "mlp.c_fc",
            "proj": "mlp.c_proj",
        }
    ),
)


def names_of(model_type: str) -> FamilyNames:
    """The parameter names of ``model_type`` (the Llama family or ``gpt2``).

    Raises:
        ValueError: an unsupported ``model_type``.
    """
    if model_type in LLAMA_FAMILY:
        return LLAMA_NAMES
    if model_type == "gpt2":
        return GPT2_NAMES
    raise ValueError(f"model_type={model_type!r}: supported {', '.join(LLAMA_FAMILY)}, gpt2")
