"""Where things are in the HF model families verl_ppo supports: the base model of a causal
LM and its repeated decoder layers.

Used by the fused LM head (:mod:`verl_ppo.roles.fused_head`), packed forwards
(:mod:`verl_ppo.packing`), regional compilation (:mod:`verl_ppo.compiled`) and the job's
model facts (:mod:`verl_ppo.fast_path`); it imports none of them.
"""

from __future__ import annotations

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
