"""What each ``auto`` setting resolves to on this machine, and why (reported at start and
as ``auto/<key>`` metrics: 1 = on, 0 = off, or the resolved number).

``auto`` means "on where supported":

- ``rollout.use_cuda_graph``: on with CUDA when the static-cache decoder supports the model
  (Llama family, GPT-2; default RoPE; no sliding window) and the weights are readable in
  place (ZeRO 0-2, or the hybrid engine's TP shards at any ZeRO stage). Off on the CPU.
- ``train.sequence_packing``: on when the model's attention runs packed rows as varlen
  kernels (flash-attention); off with sdpa/eager, which would need a dense ``(T, T)`` mask
  per packed row (quadratic in the token budget).
- ``train.max_tokens_per_micro_batch``: on CUDA, sized from the memory free after the
  engines are built (:func:`token_budget_from_free_memory`); on the CPU, ``None`` (fixed
  ``train.micro_batch_size``).
- ``train.fused_log_probs``: the chunked LM head (:mod:`verl_ppo.roles.fused_head`)
  wherever the head allows it (no bias or logit scaling; not ZeRO-3 partitioned).
- ``algorithm.old_log_prob``: ``bypass`` with one PPO epoch and one mini-batch, else
  ``forward`` (see :func:`resolve_old_log_prob`).
- ``train.torch_compile``: regional ``torch.compile`` of the decoder layers of the actor,
  reference and critic (:mod:`verl_ppo.compiled`) on CUDA; off on the CPU, with ZeRO-3
  (refused if set) and with gradient checkpointing (allowed if set).
- ``actor.optim.fused`` / ``critic.optim.fused``: torch's fused AdamW on CUDA.
- ``actor.zero_stage`` / ``critic.zero_stage``: 1 on CUDA, 0 on the CPU (resolved when the
  config is validated, :func:`verl_ppo.config.resolve_zero_stage`; reported here).

An explicit ``true`` that cannot apply is refused (:class:`verl_ppo.config.ConfigError`)
naming the field and the fix; nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_ppo.config import ConfigError


@dataclass
class FastPath:
    """The resolved settings of one run.

    Attributes:
        use_cuda_graph, sequence_packing, fused_log_probs, bypass_old_log_prob, fused_adamw,
        torch_compile: the resolved switches.
        max_tokens_per_micro_batch: the training token budget (None = fixed micro-batches).
        max_tokens_no_grad: the budget of the no-grad forwards (ref, values, old_log_prob).
        reasons: ``{config key: "value (why)"}`` for the log.
    """

    use_cuda_graph: bool = False
    sequence_packing: bool = False
    fused_log_probs: bool = False
    bypass_old_log_prob: bool = False
    fused_adamw: bool = False
    torch_compile: bool = False
    max_tokens_per_micro_batch: int | None = None
    max_tokens_no_grad: int | None = None
    reasons: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """``auto/<key>`` metrics (1/0 for switches, tokens for budgets, 0 = none)."""
        return {
            "auto/rollout.use_cuda_graph": float(self.use_cuda_graph),
            "auto/train.sequence_packing": float(self.sequence_packing),
            "auto/train.fused_log_probs": float(self.fused_log_probs),
            "auto/algorithm.old_log_prob_bypass": float(self.bypass_old_log_prob),
            "auto/optim.fused_adamw": float(self.fused_adamw),
            "auto/train.torch_compile": float(self.torch_compile),
            "auto/train.max_tokens_per_micro_batch": float(self.max_tokens_per_micro_batch or 0),
        }

    def lines(self) -> list[str]:
        """One ``key = value (why)`` line per setting."""
        return [f"{k} = {v}" for k, v in self.reasons.items()]


def _switch(value: Any, supported: str | None, key: str, fix: str) -> tuple[bool, str]:
    """Resolve ``auto``/bool against ``supported`` (None = supported, else the reason)."""
    if value == "auto":
        return (supported is None), (
            "on (auto)" if supported is None else f"off (auto: {supported})"
        )
    if value and supported is not None:
        raise ConfigError(f"{key}=true cannot apply: {supported}; {fix}")
    return bool(value), ("on" if value else "off") + " (set)"


def resolve_old_log_prob(cfg: Any) -> tuple[bool, str]:
    """Whether the old-log-prob forward is bypassed.

    With one PPO epoch and one mini-batch the policy is updated once, after the only
    forward of each micro-batch: the ratio's ``old_log_prob`` equals that forward's own
    log-prob (detached), so the extra forward is skipped. The KL-in-reward term, computed
    before the update, then uses the rollout's log-probs: the sampler's
    ``log_softmax(logits / T)`` of the same weights (bf16 decode instead of the training
    forward; verl calls using the rollout's log-probs as old log-probs bypass mode).

    Raises:
        ConfigError: ``bypass`` with several epochs or mini-batches (the ratio would be 1
            where it must not be).
    """
    t, mode = cfg.train, cfg.algorithm.old_log_prob
    one = t.ppo_epochs == 1 and t.rollout_batch_size == t.ppo_mini_batch_size
    why = (
        None
        if one
        else f"ppo_epochs={t.ppo_epochs}, {t.rollout_batch_size // t.ppo_mini_batch_size} mini-batches"
    )
    if mode == "bypass" and not one:
        raise ConfigError(
            f"algorithm.old_log_prob=bypass needs one PPO epoch and one mini-batch ({why}); "
            "set algorithm.old_log_prob=forward or auto"
        )
    if mode == "forward":
        return False, "forward (set)"
    if mode == "bypass":
        return True, "bypass (set)"
    return one, ("bypass (auto: one epoch, one mini-batch)" if one else f"forward (auto: {why})")


def resolve(cfg: Any, cuda: bool, policy: Any) -> FastPath:
    """Resolve every ``auto`` except the token budget (which needs the engines built).

    Args:
        cfg: the :class:`~verl_ppo.config.PPOConfig`.
        cuda: the run is on CUDA.
        policy: the HF policy model (before DeepSpeed wraps it).

    Raises:
        ConfigError: an explicit setting that cannot apply (message names field and fix).
    """
    from verl_ppo.compiled import decoder_layers, torch_compile_unsupported
    from verl_ppo.roles.fused_head import fused_head_unsupported
    from verl_ppo.rollout.cuda_graph import static_decoding_unsupported

    fp = FastPath()
    fp.reasons["actor.zero_stage"] = cfg.actor.zero_stage_reason()
    if cfg.algorithm.adv_estimator == "gae":
        fp.reasons["critic.zero_stage"] = cfg.critic.zero_stage_reason()
    hybrid = cfg.actor.model_config_.hybrid_engine.enable
    why_graph = None if cuda else "no CUDA device"
    if why_graph is None:
        why_graph = static_decoding_unsupported(policy)
    if why_graph is None and cfg.actor.zero_stage == 3 and not hybrid:
        why_graph = "ZeRO-3 partitions the weights the graph reads (enable the hybrid engine)"
    fp.use_cuda_graph, fp.reasons["rollout.use_cuda_graph"] = _switch(
        cfg.rollout.use_cuda_graph, why_graph, "rollout.use_cuda_graph", "set it to auto or false"
    )
    if fp.use_cuda_graph:
        fp.reasons["rollout.use_cuda_graph"] += (
            "; RMSNorm, RoPE and SiLU-mul of the decode step fused by torch.compile "
            "(eager if compilation fails, logged)"
        )
    attn = getattr(policy.config, "_attn_implementation", None) or "sdpa"
    why_pack = (
        None
        if "flash" in str(attn)
        else (
            f"attention is {attn}: a packed row needs a dense (T, T) mask; flash-attention runs it varlen"
        )
    )
    if cfg.train.sequence_packing is True:
        why_pack = None  # works with any attention (dense mask), chosen by the user
    fp.sequence_packing, fp.reasons["train.sequence_packing"] = _switch(
        cfg.train.sequence_packing, why_pack, "train.sequence_packing", "set it to auto"
    )
    why_head = fused_head_unsupported(policy)
    if why_head is None and (cfg.actor.zero_stage == 3):
        why_head = "ZeRO-3 partitions the LM head weight"
    fp.fused_log_probs, fp.reasons["train.fused_log_probs"] = _switch(
        cfg.train.fused_log_probs, why_head, "train.fused_log_probs", "set it to auto or false"
    )
    fp.bypass_old_log_prob, fp.reasons["algorithm.old_log_prob"] = resolve_old_log_prob(cfg)
    why_compile = torch_compile_unsupported(cuda, policy)
    stages = {cfg.actor.zero_stage}
    if cfg.algorithm.adv_estimator == "gae":
        stages.add(cfg.critic.zero_stage)
    if why_compile is None and 3 in stages:
        why_compile = (
            "ZeRO-3 gathers each layer's parameters in module hooks, which the compiled "
            "layer call would trace (not supported here)"
        )
    if (
        why_compile is None
        and cfg.model.gradient_checkpointing
        and cfg.train.torch_compile == "auto"
    ):
        why_compile = "model.gradient_checkpointing (compiled recomputation not measured here)"
    fp.torch_compile, fp.reasons["train.torch_compile"] = _switch(
        cfg.train.torch_compile, why_compile, "train.torch_compile", "set it to auto or false"
    )
    if fp.torch_compile:
        fp.reasons["train.torch_compile"] += (
            f"; {len(decoder_layers(policy))} decoder layers, compiled at their first forward"
        )
    fused = {cfg.actor.optim.fused, cfg.critic.optim.fused}
    why_adam = None if cuda else "no CUDA device (foreach AdamW)"
    res = [_switch(v, why_adam, "optim.fused", "set it to auto or false") for v in fused]
    fp.fused_adamw = all(r[0] for r in res)
    fp.reasons["optim.fused (AdamW)"] = ", ".join(r[1] for r in res)
    return fp


def training_bytes_per_token(model_config: Any, dtype_bytes: int, checkpointing: bool) -> int:
    """Activation bytes a training forward keeps per token for backward (an upper estimate).

    Per layer of a HF Llama-family decoder with sdpa: about 12 hidden-sized and 4
    FFN-sized tensors in the compute dtype (norm outputs, q/k/v, attention output,
    residuals; gate, up, activation, product), plus two fp32 hidden-sized norm inputs.
    With gradient checkpointing only the layer inputs are kept, plus one layer's full set.
    """
    from verl_ppo.model_dims import model_dims

    d = model_dims(model_config)
    layer = dtype_bytes * (12 * d.hidden + 4 * d.intermediate) + 2 * 4 * d.hidden
    if checkpointing:
        return d.num_layers * dtype_bytes * d.hidden + layer
    return d.num_layers * layer


BUDGET_FRACTION = 0.6
"""Share of the free GPU memory the training micro-batches' activations may take."""


def token_budget_from_free_memory(
    free_bytes: int, bytes_per_token: int, cap_tokens: int, fraction: float = BUDGET_FRACTION
) -> int:
    """``fraction`` of the free memory over ``bytes_per_token``, a multiple of 256 tokens
    (at least 256), capped at ``cap_tokens`` (more than a mini-batch buys nothing)."""
    budget = int(fraction * free_bytes / max(bytes_per_token, 1)) // 256 * 256
    return max(256, min(budget, cap_tokens))
