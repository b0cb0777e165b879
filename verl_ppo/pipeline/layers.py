"""The HF model's parts as DeepSpeed pipeline layers (Llama family: Llama, Qwen2, Mistral).

A causal LM becomes ``[embed, decoder layer 0 .. N-1, final norm, head]``; every layer
takes and returns the tuple that travels between stages::

    stage input  (input_ids (B, L) int64, attention_mask (B, L) int64)
    activations  (hidden (B, L, H) float, attention_mask (B, L) int64)
    head output  logits (B, L, V) float (actor), values (B, L) float32 (critic)

Only the float tensor carries a gradient back (DeepSpeed's ``_exec_send_grads`` sends the
grads of floating tensors only). Each decoder layer rebuilds the causal/padding mask with
transformers' own ``create_causal_mask`` and the rotary embedding from the positions of
the unmasked tokens, exactly as ``LlamaModel.forward`` does once per model, so the pipeline
computes what the HF model computes (tested against it).

Tied embeddings (``tie_word_embeddings``) use DeepSpeed's tied layers: one
``TiedLayerSpec("embed", ...)`` on the first stage (the embedding) and one on the last
stage whose ``forward_fn`` is the LM head; DeepSpeed broadcasts the weight at start and
all-reduces its gradient between the two stages (``PipelineModule._index_tied_modules``).

Layers are built lazily (``LayerSpec``): a rank constructs and loads only its stage's layers,
with weights taken from a :class:`~verl_ppo.pipeline.weights.WeightSource` by HF name.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from verl_ppo.job.model_family import LLAMA_FAMILY, LLAMA_NAMES

_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


def hf_classes(config: Any) -> tuple[type, type, type]:
    """``(DecoderLayer, RMSNorm, RotaryEmbedding)`` classes of ``config.model_type``.

    Raises:
        ValueError: a model type outside the Llama family, or a Qwen2 with sliding-window
            layers (not built here).
    """
    mt = getattr(config, "model_type", "")
    if mt not in LLAMA_FAMILY:
        raise ValueError(
            f"pipeline training supports model_type in {LLAMA_FAMILY}, got {mt!r}; use "
            "actor.model_config.hybrid_engine.training_sharding.pipeline_parallel_size: 1"
        )
    if getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"{mt} with use_sliding_window=true is not supported by the pipeline layers "
            "(full attention only); set pipeline_parallel_size: 1"
        )
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    p = _PREFIX[mt]
    return (
        getattr(mod, f"{p}DecoderLayer"),
        getattr(mod, f"{p}RMSNorm"),
        getattr(mod, f"{p}RotaryEmbedding"),
    )


def _load(module: nn.Module, source: Any, prefix: str) -> nn.Module:
    """Copy ``source``'s tensors named ``prefix + local name`` into ``module`` (strict)."""
    names = [n for n, _ in module.named_parameters()]
    sd = {n: source.tensor(prefix + n) for n in names}
    missing, unexpected = module.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m in names]
    if missing or unexpected:
        raise KeyError(f"weights for {prefix}*: missing {missing}, unexpected {unexpected}")
    return module.to(source.dtype)


class EmbedPipe(nn.Module):
    """First stage: token embedding. ``(ids, mask) -> (hidden, mask)``."""

    def __init__(self, config: Any, source: Any, base: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        _load(self.embed, source, LLAMA_NAMES.embed_prefix(base))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        ids, mask = inputs
        return self.embed(ids), mask


class DecoderPipe(nn.Module):
    """One HF decoder layer with its mask and rotary embedding. ``(h, mask) -> (h, mask)``."""

    def __init__(self, config: Any, source: Any, base: str, index: int) -> None:
        super().__init__()
        from transformers.masking_utils import create_causal_mask

        layer_cls, _, rope_cls = hf_classes(config)
        self.config = config
        self.block = _load(layer_cls(config, index), source, LLAMA_NAMES.layer(index, base))
        self.rotary = rope_cls(config=config).to(source.dtype)
        self._mask_fn = create_causal_mask
        self.index = index

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]):
        h, mask = inputs
        position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
        causal = self._mask_fn(
            config=self.config,
            inputs_embeds=h,
            attention_mask=mask,
            cache=None,
            position_ids=position_ids,
        )
        pos = self.rotary(h, position_ids=position_ids)
        h = self.block(h, attention_mask=causal, position_embeddings=pos, position_ids=position_ids)
        return h, mask


class NormPipe(nn.Module):
    """Last stage: the final RMSNorm. ``(h, mask) -> h``."""

    def __init__(self, config: Any, source: Any, base: str) -> None:
        super().__init__()
        _, norm_cls, _ = hf_classes(config)
        self.norm = _load(
            norm_cls(config.hidden_size, eps=config.rms_norm_eps), source, LLAMA_NAMES.norm(base)
        )

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.norm(inputs[0])


class LMHeadPipe(nn.Module):
    """Last stage, untied embeddings: ``lm_head``. ``h -> logits (B, L, V)``."""

    def __init__(self, config: Any, source: Any) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        _load(self.lm_head, source, f"{LLAMA_NAMES.lm_head}.")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def tied_lm_head(embed: EmbedPipe, h: torch.Tensor) -> torch.Tensor:
    """The ``forward_fn`` of the tied embedding on the last stage: ``h @ E^T``."""
    return torch.nn.functional.linear(h, embed.embed.weight)


class ValueHeadPipe(nn.Module):
    """Last stage of the critic: ``Linear(hidden, 1)``. ``h -> values (B, L) float32``."""

    def __init__(self, config: Any, source: Any) -> None:
        super().__init__()
        self.value_head = _load(nn.Linear(config.hidden_size, 1), source, "value_head.")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.value_head(h).squeeze(-1).float()


def layer_specs(config: Any, source: Any, role: str) -> list[Any]:
    """The pipeline layer list of the actor (``role="policy"``) or critic (``"value"``).

    Args:
        config: HF config of the policy.
        source: a :class:`~verl_ppo.pipeline.weights.WeightSource` (HF names; the critic's
            backbone under ``backbone.``, its head under ``value_head.``).
        role: ``"policy"`` (LM head, tied when the config ties) or ``"value"``.

    Returns:
        ``LayerSpec`` / ``TiedLayerSpec`` objects: ``1 + num_hidden_layers + 2`` of them.
    """
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    hf_classes(config)  # validate the family before anything is built
    base = LLAMA_NAMES.base if role == "policy" else "backbone."
    tied = role == "policy" and bool(getattr(config, "tie_word_embeddings", False))
    specs: list[Any] = []
    if tied:
        specs.append(
            TiedLayerSpec("embed", EmbedPipe, config, source, base, tied_weight_attr="embed.weight")
        )
    else:
        specs.append(LayerSpec(EmbedPipe, config, source, base))
    specs += [
        LayerSpec(DecoderPipe, config, source, base, i) for i in range(config.num_hidden_layers)
    ]
    specs.append(LayerSpec(NormPipe, config, source, base))
    if role == "value":
        specs.append(LayerSpec(ValueHeadPipe, config, source))
    elif tied:
        specs.append(
            TiedLayerSpec(
                "embed",
                EmbedPipe,
                config,
                source,
                base,
                forward_fn=tied_lm_head,
                tied_weight_attr="embed.weight",
            )
        )
    else:
        specs.append(LayerSpec(LMHeadPipe, config, source))
    return specs


def stage_parts(num_layers: int, pp: int) -> list[int]:
    """DeepSpeed ``parts`` boundaries over ``[embed, layers..., norm, head]`` that give stage
    ``s`` the decoder layers :func:`verl_ppo.reshard.layout.stage_layer_range` gives it,
    the embedding to the first stage and norm + head to the last (the layout the reshard
    planner assumes)."""
    from verl_ppo.reshard.layout import stage_layer_range

    parts = [0]
    for s in range(pp):
        r = stage_layer_range(num_layers, pp, s)
        parts.append(1 + r.stop)
    parts[-1] = num_layers + 3
    return parts


def hf_name(pipe_name: str, layers: dict[int, nn.Module], base: str) -> str:
    """HF parameter name of a ``PipelineModule`` parameter name.

    ``"3.block.self_attn.q_proj.weight"`` -> ``"model.layers.2.self_attn.q_proj.weight"``;
    ``"tied_modules.embed.embed.weight"`` -> ``"model.embed_tokens.weight"``.

    Raises:
        KeyError: a name that no pipeline layer of this module produces.
    """
    head, _, rest = pipe_name.partition(".")
    if head == "tied_modules":
        key, _, rest = rest.partition(".")
        if key == "embed" and rest == "embed.weight":
            return LLAMA_NAMES.embed_weight(base)
        raise KeyError(pipe_name)
    layer = layers[int(head)]
    if isinstance(layer, EmbedPipe):
        return LLAMA_NAMES.embed_prefix(base) + rest.removeprefix("embed.")
    if isinstance(layer, DecoderPipe):
        return LLAMA_NAMES.layer(layer.index, base) + rest.removeprefix("block.")
    if isinstance(layer, NormPipe):
        return LLAMA_NAMES.norm(base) + rest.removeprefix("norm.")
    if isinstance(layer, LMHeadPipe):
        return f"{LLAMA_NAMES.lm_head}.{rest.removeprefix('lm_head.')}"
    if isinstance(layer, ValueHeadPipe):
        return f"value_head.{rest.removeprefix('value_head.')}"
    raise KeyError(pipe_name)
