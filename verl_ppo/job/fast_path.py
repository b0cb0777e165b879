"""The job, resolved once: what every ``auto`` setting becomes on this machine for this
model, and why, as one frozen :class:`ResolvedJob` the rest of the code reads (reported at
start as ``fast path:`` lines and as ``auto/<key>`` metrics: 1 = on, 0 = off, or the
resolved number).

``auto`` means "on where supported"; what blocks each switch is written once, in
:data:`verl_ppo.job.rules.SWITCHES` (an explicit ``true`` that cannot apply is refused with
the same reason, naming the field and the fix):

- ``actor.zero_stage`` / ``critic.zero_stage``: 1 on CUDA (optimizer state partitioned over
  the data-parallel ranks; on one H200 ZeRO-1 ran the default PPO step 1.29x faster than
  ZeRO-0, ``benchmarks/results/ppo_throughput_zero_stage.md``), 0 on the CPU.
- ``amp_dtype``: bf16 on CUDA, fp32 on the CPU.
- ``rollout.use_cuda_graph``: on with CUDA when the static-cache decoder supports the model
  (Llama family, GPT-2; default RoPE; no sliding window) and the weights are readable in
  place (ZeRO 0-2, or the hybrid engine's TP shards at any ZeRO stage).
- ``train.sequence_packing``: on when packed rows run as varlen kernels: the model's own
  flash-attention, or on CUDA in bf16 torch's ``varlen_attn`` (:mod:`verl_ppo.step.varlen`);
  off otherwise (sdpa/eager would need a dense ``(T, T)`` mask per packed row, quadratic in
  the token budget).
- ``train.fused_log_probs``: the chunked LM head (:mod:`verl_ppo.roles.fused_head`)
  wherever the head allows it (no bias or logit scaling; not ZeRO-3 partitioned).
- ``train.torch_compile``: regional ``torch.compile`` of the decoder layers of the actor,
  reference and critic (:mod:`verl_ppo.step.compiled`) on CUDA; off on the CPU, with ZeRO-3
  (refused if set) and with gradient checkpointing (allowed if set).
- ``actor.optim.fused`` / ``critic.optim.fused``: torch's fused AdamW on CUDA.
- ``algorithm.old_log_prob``: ``bypass`` with one PPO epoch and one mini-batch, else
  ``forward`` (see :func:`resolve`).
- ``train.max_tokens_per_micro_batch``: on CUDA, sized from the memory free after the
  engines are built (:func:`with_token_budget`, the one setting resolved after the engines
  exist); on the CPU, ``None`` (fixed ``train.micro_batch_size``).

Pipeline training (``pipeline_parallel_size >= 2``) turns the first four switches and the
token budget off (fixed-size pipeline micro-batches, the TP rollout model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from verl_ppo.job.rules import (
    PP_KEY,
    SWITCHES,
    Facts,
    check,
    pipeline_degree,
    several_updates,
)


@dataclass(frozen=True)
class ModelFacts:
    """What the switches need to know of the policy model (no weights needed).

    Attributes:
        class_name: the model's class.
        static_decoding: why the static-cache decoder cannot run it (None: it can).
        fused_head: why the chunked LM head cannot apply (None: it can).
        decoder_layers: number of repeated decoder layers found (0: none known).
        attention: HF's attention implementation (``sdpa``, ``eager``, ``flash_attention_2``).
    """

    class_name: str
    static_decoding: str | None
    fused_head: str | None
    decoder_layers: int
    attention: str

    @classmethod
    def of(cls, policy: Any) -> ModelFacts:
        """The facts of a HF causal LM (a meta-device copy is enough)."""
        from verl_ppo.job.model_family import decoder_layers
        from verl_ppo.roles.fused_head import fused_head_unsupported
        from verl_ppo.rollout.cuda_graph import static_decoding_unsupported

        return cls(
            type(policy).__name__,
            static_decoding_unsupported(policy),
            fused_head_unsupported(policy),
            len(decoder_layers(policy)),
            str(getattr(policy.config, "_attn_implementation", None) or "sdpa"),
        )

    @classmethod
    def of_config(cls, model_config: Any) -> ModelFacts:
        """The facts of the model ``model_config`` builds, from a weightless (meta-device)
        copy."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return cls.of(AutoModelForCausalLM.from_config(model_config))


def model_config_of(cfg: Any) -> Any:
    """The HF config the run will build its policy from, without loading weights.

    ``model.tiny``: the config built from those fields (vocabulary from the tokenizer, as
    :func:`verl_ppo.workers.models.build_policy` does); otherwise the folder's ``config.json``.

    Raises:
        verl_ppo.data.model_store.ModelStoreError: no usable model folder.
        ValueError: bad ``model.tiny`` fields.
    """
    from transformers import AutoConfig

    from verl_ppo.data.model_store import resolve_model_path

    if cfg.model.tiny is not None:
        from verl_ppo.workers.models import _tiny_config, load_tokenizer

        return _tiny_config(cfg.model, load_tokenizer(cfg.model))
    return AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))


@dataclass(frozen=True)
class ResolvedJob:
    """Every ``auto`` of one run, resolved; read everywhere, never re-decided.

    Attributes:
        cuda: the run is on CUDA (the device every ``auto`` was judged against).
        actor_zero_stage, critic_zero_stage: the ZeRO stages the engines run.
        dtype: parameter/compute dtype of every module (``amp_dtype``).
        pipeline_parallel_size: PP degree of the actor's training layout (1 = data parallel).
        use_cuda_graph, sequence_packing, fused_log_probs, bypass_old_log_prob, fused_adamw,
        torch_compile: the resolved switches.
        max_tokens_per_micro_batch: the training token budget (None = fixed micro-batches).
        max_tokens_no_grad: the budget of the no-grad forwards (ref, values, old_log_prob).
        reasons: ``{config key: "value (why)"}`` for the log, in resolution order.
    """

    cuda: bool
    actor_zero_stage: int
    critic_zero_stage: int
    dtype: torch.dtype
    pipeline_parallel_size: int
    use_cuda_graph: bool
    sequence_packing: bool
    fused_log_probs: bool
    bypass_old_log_prob: bool
    fused_adamw: bool
    torch_compile: bool
    max_tokens_per_micro_batch: int | None = None
    max_tokens_no_grad: int | None = None
    reasons: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))

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
        """One ``key = value (why)`` line per setting (the start-up ``fast path:`` lines)."""
        return [f"{k} = {v}" for k, v in self.reasons.items()]


def resolve_stages(cfg: Any, cuda: bool) -> tuple[int, int, dict[str, str]]:
    """``actor.zero_stage`` and ``critic.zero_stage`` (``auto``: 1 on CUDA, 0 on the CPU),
    with their reasons."""
    out, reasons = [], {}
    for role in ("actor", "critic"):
        value = getattr(cfg, role).zero_stage
        stage = (1 if cuda else 0) if value == "auto" else int(value)
        where = "CUDA" if cuda else "CPU"
        reasons[f"{role}.zero_stage"] = (
            f"{stage} (auto: {where})" if value == "auto" else f"{stage} (set)"
        )
        out.append(stage)
    return out[0], out[1], reasons


def check_config(cfg: Any) -> None:
    """The rule tables (:mod:`verl_ppo.job.rules`) for a config being built: ZeRO stages
    resolved for this machine; the device and the model are judged later (preflight, the
    trainer), so a config can be written on a machine that will not run it.

    Raises:
        verl_ppo.errors.ConfigError: every broken rule, naming the keys and the fix.
    """
    actor, critic, _ = resolve_stages(cfg, torch.cuda.is_available())
    check(cfg, Facts(actor, critic))


def _switch(value: Any, why: str | None) -> tuple[bool, str]:
    """``auto``/bool against ``why`` (None = supported); explicit ``true`` against a
    reason was refused by :func:`verl_ppo.job.rules.check`."""
    if value == "auto":
        return why is None, ("on (auto)" if why is None else f"off (auto: {why})")
    return bool(value), ("on" if value else "off") + " (set)"


def resolve(cfg: Any, cuda: bool, model: Any) -> ResolvedJob:
    """Resolve every ``auto`` of ``cfg`` but the token budget (see :func:`with_token_budget`).

    Args:
        cfg: the :class:`~verl_ppo.config.PPOConfig`.
        cuda: the run is on CUDA.
        model: the policy (a HF causal LM, or a meta-device copy) or its
            :class:`ModelFacts` (:meth:`ModelFacts.of_config`).

    Raises:
        verl_ppo.errors.ConfigError: a broken rule, or an explicit setting that cannot
            apply (message names field and fix).
    """
    facts_model = model if isinstance(model, ModelFacts) else ModelFacts.of(model)
    actor, critic, reasons = resolve_stages(cfg, cuda)
    if cfg.algorithm.adv_estimator != "gae":
        del reasons["critic.zero_stage"]
    facts = Facts(actor, critic, cuda, facts_model)
    check(cfg, facts)
    on: dict[str, bool] = {}
    for s in SWITCHES:
        value = s.value(cfg)
        on[s.key], reasons[s.key] = _switch(value, s.blocked(cfg, facts, value == "auto"))
    if on["rollout.use_cuda_graph"]:
        reasons["rollout.use_cuda_graph"] += (
            "; decode step: residual add + RMSNorm and SiLU-mul fused by torch.compile (eager "
            "if compilation fails, logged), RoPE + KV-cache write and split-K attention as "
            "Triton kernels, q/k/v and gate/up as one GEMM each (fused copies, when they fit "
            "in 1/8 of free memory)"
        )
    if on["train.torch_compile"]:
        reasons["train.torch_compile"] += (
            f"; {facts_model.decoder_layers} decoder layers, compiled at their first forward"
        )
    bypass, reasons["algorithm.old_log_prob"] = _old_log_prob(cfg)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.amp_dtype)
    if dtype is None:
        dtype = torch.bfloat16 if cuda else torch.float32
    given = cfg.train.max_tokens_per_micro_batch
    return ResolvedJob(
        cuda=cuda,
        actor_zero_stage=actor,
        critic_zero_stage=critic,
        dtype=dtype,
        pipeline_parallel_size=pipeline_degree(cfg),
        use_cuda_graph=on["rollout.use_cuda_graph"],
        sequence_packing=on["train.sequence_packing"],
        fused_log_probs=on["train.fused_log_probs"],
        bypass_old_log_prob=bypass,
        fused_adamw=on["actor.optim.fused"] and on["critic.optim.fused"],
        torch_compile=on["train.torch_compile"],
        max_tokens_per_micro_batch=None if given == "auto" else given,
        reasons=MappingProxyType(reasons),
    )


def _old_log_prob(cfg: Any) -> tuple[bool, str]:
    """Whether the old-log-prob forward is bypassed.

    With one PPO epoch and one mini-batch the policy is updated once, after the only
    forward of each micro-batch: the ratio's ``old_log_prob`` equals that forward's own
    log-prob (detached), so the extra forward is skipped. The KL-in-reward term, computed
    before the update, then uses the rollout's log-probs: the sampler's
    ``log_softmax(logits / T)`` of the same weights (bf16 decode instead of the training
    forward; verl calls using the rollout's log-probs as old log-probs bypass mode).
    ``bypass`` with several updates is refused by :data:`verl_ppo.job.rules.RULES`.
    """
    mode, why = cfg.algorithm.old_log_prob, several_updates(cfg)
    if mode != "auto":
        return mode == "bypass", f"{mode} (set)"
    if why is None:
        return True, "bypass (auto: one epoch, one mini-batch)"
    return False, f"forward (auto: {why})"


def layouts(cfg: Any, world_size: int, actor_zero_stage: int) -> tuple[Any, Any] | None:
    """The hybrid engine's training and rollout layouts for ``world_size`` ranks (None when
    it is off), after checking the batch sizes against the ranks, and against the ranks of
    one pipeline when the actor trains pipeline-parallel. The one place the layouts are
    derived from the config; :func:`verl_ppo.job.preflight.preflight` checks them against the
    model.

    Raises:
        ValueError / verl_ppo.errors.ConfigError: naming the numbers and the fields.
    """
    cfg.derived(world_size)  # rollout: every rank generates its share
    he = cfg.actor.model_config_.hybrid_engine
    if not he.enable:
        return None
    train, rollout = he.layouts(world_size, actor_zero_stage)
    if train.pp > 1:
        cfg.derived(train.dp)  # training: per pipeline
    return train, rollout


def with_token_budget(
    job: ResolvedJob, cfg: Any, local_mini_batch: int, free_bytes: int | None, model_config: Any
) -> ResolvedJob:
    """``train.max_tokens_per_micro_batch``, resolved once the engines exist.

    Args:
        job: the job :func:`resolve` returned.
        cfg: the config.
        local_mini_batch: sequences per mini-batch on this rank.
        free_bytes: GPU memory free now, the smallest over ranks (None on the CPU).
        model_config: the policy's HF config (activation bytes per token).

    Returns:
        The job with the training budget and the no-grad forwards' budget (4x: they keep
        no activations, at least one mini-batch) and the reason.
    """
    given = cfg.train.max_tokens_per_micro_batch
    cap = local_mini_batch * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    budget = None if given == "auto" else given
    if job.pipeline_parallel_size > 1:
        why = f"None ({PP_KEY}={job.pipeline_parallel_size}: fixed-size pipeline micro-batches)"
    elif given != "auto":
        why = f"{given} (set)"
    elif free_bytes is None:
        micro = min(cfg.train.micro_batch_size, local_mini_batch)
        why = f"None (auto: CPU, train.micro_batch_size={micro})"
    else:
        bpt = training_bytes_per_token(
            model_config, 2 if job.dtype == torch.bfloat16 else 4, cfg.model.gradient_checkpointing
        )
        budget = token_budget_from_free_memory(free_bytes, bpt, cap)
        why = (
            f"{budget} (auto: {BUDGET_FRACTION} x {free_bytes / 2**30:.1f} GiB free / "
            f"{bpt / 2**20:.2f} MiB per token, at most one mini-batch of {cap})"
        )
    no_grad = None if budget is None else max(4 * budget, cap)
    reasons = {**job.reasons, "train.max_tokens_per_micro_batch": why}
    return dataclasses.replace(
        job,
        max_tokens_per_micro_batch=budget,
        max_tokens_no_grad=no_grad,
        reasons=MappingProxyType(reasons),
    )


def training_bytes_per_token(model_config: Any, dtype_bytes: int, checkpointing: bool) -> int:
    """Activation bytes a training forward keeps per token for backward (an upper estimate).

    Per layer of a HF Llama-family decoder with sdpa: about 12 hidden-sized and 4
    FFN-sized tensors in the compute dtype (norm outputs, q/k/v, attention output,
    residuals; gate, up, activation, product), plus two fp32 hidden-sized norm inputs.
    With gradient checkpointing only the layer inputs are kept, plus one layer's full set.
    """
    from verl_ppo.job.model_dims import model_dims

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
