"""The ``auto`` switches of the PPO config, in one table (:data:`SWITCHES`): for each, what
blocks it (the config, the device, the model). :func:`verl_ppo.job.fast_path.resolve` turns an
``auto`` off where something blocks it, and :func:`verl_ppo.job.rules.check` refuses an
explicit ``true`` with the same reason, so a rule is never written twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_ppo.job.facts import PP_KEY, Facts, pipeline_degree, trained_roles


@dataclass(frozen=True)
class Switch:
    """An ``auto``/true/false setting: ``blocked(cfg, facts, auto)`` says why it cannot
    apply (None: it can; ``auto``: the value is ``auto``, some reasons only turn ``auto``
    off and let an explicit ``true`` run)."""

    key: str
    blocked: Callable[[Any, Facts, bool], str | None]
    fix: str = "set it to auto or false"

    def value(self, cfg: Any) -> Any:
        """The value as written (``auto``, True or False)."""
        node = cfg
        for part in self.key.split("."):
            node = getattr(node, part)
        return node


def _cuda_graph(cfg: Any, f: Facts, auto: bool) -> str | None:
    pp = pipeline_degree(cfg)
    if pp > 1:
        return (
            f"{PP_KEY}={pp}: generation runs on the TP rollout model, which does not capture "
            "CUDA graphs"
        )
    if f.cuda is False:
        return "no CUDA device"
    if f.model is not None and f.model.static_decoding is not None:
        return f.model.static_decoding
    if f.actor_stage == 3 and not cfg.actor.model_config_.hybrid_engine.enable:
        return "ZeRO-3 partitions the weights the graph reads (enable the hybrid engine)"
    return None


def _packing(cfg: Any, f: Facts, auto: bool) -> str | None:
    pp = pipeline_degree(cfg)
    if pp > 1:
        return (
            f"{PP_KEY}={pp}: pipeline micro-batches have a fixed number of sequences "
            "(DeepSpeed's schedule)"
        )
    attn = None if f.model is None else f.model.attention
    if auto and attn is not None and "flash" not in attn:  # set: any attention (dense mask)
        from verl_ppo.step.varlen import available

        why_not = "no CUDA device" if f.cuda is False else available()
        if why_not is None and "float32" in (cfg.amp_dtype, cfg.model.dtype):
            why_not = "the weights run in float32 (torch's varlen kernels take bf16/fp16)"
        if why_not is not None:  # torch's varlen kernels run the packed row on CUDA
            return f"attention is {attn} and {why_not}: a packed row would need a dense (T, T) mask"
    return None


def _fused_head(cfg: Any, f: Facts, auto: bool) -> str | None:
    pp = pipeline_degree(cfg)
    if pp > 1:
        return (
            f"{PP_KEY}={pp}: the log-probs are the pipeline's loss function on the last "
            "stage's logits"
        )
    if f.model is not None and f.model.fused_head is not None:
        return f.model.fused_head
    if f.actor_stage == 3:
        return "ZeRO-3 partitions the LM head weight"
    return None


def _compile(cfg: Any, f: Facts, auto: bool) -> str | None:
    pp = pipeline_degree(cfg)
    if pp > 1:
        return (
            f"{PP_KEY}={pp}: the pipeline stages run DeepSpeed's PipelineModule layers, which "
            "are not compiled"
        )
    if f.cuda is False:
        return "no CUDA device (inductor on the CPU would build C++ on every new host)"
    if f.model is not None and not f.model.decoder_layers:
        return f"{f.model.class_name} has no decoder layer list to compile"
    if any(f.stage(r) == 3 for r in trained_roles(cfg)):
        return (
            "ZeRO-3 gathers each layer's parameters in module hooks, which the compiled layer "
            "call would trace (not supported here)"
        )
    if auto and cfg.model.gradient_checkpointing:
        return "model.gradient_checkpointing (compiled recomputation not measured here)"
    return None


def _fused_adamw(cfg: Any, f: Facts, auto: bool) -> str | None:
    return "no CUDA device (foreach AdamW)" if f.cuda is False else None


SWITCHES: tuple[Switch, ...] = (
    Switch("rollout.use_cuda_graph", _cuda_graph),
    Switch("train.sequence_packing", _packing, "set it to auto"),
    Switch("train.fused_log_probs", _fused_head),
    Switch("train.torch_compile", _compile),
    Switch("actor.optim.fused", _fused_adamw),
    Switch("critic.optim.fused", _fused_adamw),
)


def switch_message(switch: Switch, why: str) -> str:
    """The refusal of an explicit ``true`` that ``why`` blocks."""
    return f"{switch.key}=true cannot apply: {why}; {switch.fix}"
