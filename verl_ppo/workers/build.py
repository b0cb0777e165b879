"""The workers of a PPO job: the actor, reference and (GAE) critic with their DeepSpeed
strategies (data-parallel or pipeline layout), the hybrid engine that reshards the actor
for generation, and the reward model.

:class:`Workers` builds them in its constructor (collective where it builds DeepSpeed
engines) from what it is given; it resolves the one ``auto`` that needs the engines built,
the token budget (:func:`verl_ppo.job.fast_path.with_token_budget`), and exposes the result as
:attr:`Workers.job`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.distributed import DistContext
from verl_comm.telemetry import CommRecorder
from verl_ppo.config import Derived, PPOConfig
from verl_ppo.data.tasks import Task
from verl_ppo.job.fast_path import ResolvedJob, with_token_budget
from verl_ppo.observe.perf import ModelFlops, device_peaks
from verl_ppo.pipeline.build import PipelineRoles, build_pipeline_roles
from verl_ppo.reshard.hybrid import HybridEngine
from verl_ppo.reward import build_reward_model
from verl_ppo.reward.base import RewardModel
from verl_ppo.reward.cache import CachedReward
from verl_ppo.reward.rule import RuleReward
from verl_ppo.roles import Actor, Critic, Reference
from verl_ppo.workers.models import build_policy, build_value_model, check_uniform_dtype
from verl_ppo.workers.strategy import DeepSpeedStrategy, ds_config


def build_reward(cfg: PPOConfig, task: Task, device: torch.device, timeout_s: float) -> RewardModel:
    """The reward model: ``reward.custom_reward_function`` when set, else ``reward.model``
    (rule scorer of the task by default), wrapped in
    the exact-key LRU cache when ``reward.cache_entries`` > 0; a remote reward's calls are
    capped at ``timeout_s`` (``comm.timeout_s``)."""
    rc = cfg.reward
    if rc.custom_reward_function.path is not None:  # verl's compute_score (reward/custom.py)
        from verl_ppo.reward.custom import CustomReward

        fn = rc.custom_reward_function
        model: Any = CustomReward(fn.path, fn.name, rc.num_workers, fn.on_error)
    elif rc.model == "rule":
        model = RuleReward(score_fn=task.score)
    else:
        model = build_reward_model(rc.model, device=str(device), deadline_s=timeout_s)
    if rc.cache_entries:
        model = CachedReward(model, rc.cache_entries)
    return model


class Workers:
    """Actor, reference, critic (GAE), hybrid engine and reward of one PPO job.

    Args:
        cfg: the config.
        job: the resolved job (ZeRO stages, dtype, switches); the token budget is resolved
            here, once the engines exist.
        ctx: the job's distributed context (rank, world size, data-parallel group, deadline).
        device: this rank's device.
        d: per-rank batch sizes for ``ctx.world_size`` ranks.
        tokenizer: the policy's tokenizer.
        task: the prompt source (its scorer is the rule reward).
        recorder: communication telemetry of the gradient hooks and the reshard engine.
        log: the rank's logger (rank 0 reports the engines and the ``fast path:`` lines).
        rollout_layout: the hybrid engine's rollout layout (:func:`verl_ppo.job.fast_path.layouts`),
            None when it is off.

    Attributes:
        job: the job with ``train.max_tokens_per_micro_batch`` resolved.
        actor, critic (None under GRPO), reference: the roles.
        engines: role -> strategy (checkpoints and export; the frozen reference is not saved).
        pipeline: the :class:`~verl_ppo.pipeline.build.PipelineRoles` of a PP x DP run, or None.
        hybrid: the :class:`~verl_ppo.reshard.hybrid.HybridEngine`, or None.
        reward: the reward model.
        policy_config: the policy's HF config.
        model_flops, peaks: FLOP model of the policy and the device's peak FLOP/s (None when
            unknown) for the MFU metrics.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        job: ResolvedJob,
        ctx: DistContext,
        device: torch.device,
        d: Derived,
        tokenizer: Any,
        task: Task,
        recorder: CommRecorder,
        log: logging.Logger,
        rollout_layout: Any = None,
    ) -> None:
        self.cfg, self.job, self.ctx, self.device, self.d = cfg, job, ctx, device, d
        self.recorder, self.log = recorder, log
        self.reward = build_reward(cfg, task, device, ctx.timeout_s)
        self.pipeline: PipelineRoles | None = None
        if job.pipeline_parallel_size > 1:  # PP x DP on DeepSpeed's pipeline engine
            self._build_pipeline_roles(tokenizer)
        else:
            self._build_roles(tokenizer)
        self.hybrid: HybridEngine | None = None
        he = cfg.actor.model_config_.hybrid_engine
        if he.enable:
            self.hybrid = HybridEngine.build(
                self.policy_config,
                he,
                self.actor.strategy.layout,  # the layout the engine really runs
                rollout=rollout_layout,
                ctx=ctx,
                recorder=recorder,
            )

    def grad_comm(self) -> dict[str, Any]:
        """Role -> active :class:`~verl_ppo.workers.grad_comm.GradCommHandle` (empty when DeepSpeed
        reduces the gradients itself)."""
        return {
            role: s.grad_comm
            for role, s in self.engines.items()
            if s.grad_comm is not None and s.grad_comm.active
        }

    def _build_roles(self, tokenizer: Any) -> None:
        """Actor, reference and (for GAE) critic; each trained role's strategy owns its
        DeepSpeed engine and gradient communication (collective)."""
        cfg, job, d, dtype = self.cfg, self.job, self.d, self.job.dtype
        policy = build_policy(cfg.model, tokenizer, dtype, cfg.seed).to(self.device)
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        ref_model = copy.deepcopy(policy)
        check_uniform_dtype(policy, dtype, "actor")
        self.policy_config = policy.config
        # copied before the actor engine exists: ZeRO-3 partitions the policy's parameters
        # in place, and a copy made afterwards holds empty (numel 0) tensors
        value_model = None
        if cfg.algorithm.adv_estimator == "gae":
            value_model = build_value_model(policy, dtype).to(self.device)
        if job.torch_compile:  # after every copy: the compiled wrappers are not copied
            from verl_ppo.step.compiled import compile_decoder_layers

            for m in (policy, ref_model, value_model):
                if m is not None:
                    compile_decoder_layers(m)
        actor_strategy = self._strategy(cfg.actor, job.actor_zero_stage)
        actor_strategy.init(policy)
        packing, fused, mb = job.sequence_packing, job.fused_log_probs, d.local_micro_batch_size
        budget = job.max_tokens_per_micro_batch  # auto: sized below, once the engines exist
        group, temp = self.ctx.group, cfg.rollout.temperature
        self.actor = Actor(
            actor_strategy, cfg.algorithm, mb, temp, group=group, packing=packing,
            max_tokens_per_micro_batch=budget, fused=fused,
        )  # fmt: skip
        self.reference = Reference(ref_model, mb, temp, packing=packing, fused=fused)
        self.engines: dict[str, Any] = {"actor": actor_strategy}
        self.critic: Critic | None = None
        if value_model is not None:
            critic_strategy = self._strategy(cfg.critic, job.critic_zero_stage)
            critic_strategy.init(value_model)
            self.critic = Critic(
                critic_strategy, cfg.algorithm, mb, group=group, packing=packing,
                max_tokens_per_micro_batch=budget,
            )  # fmt: skip
            self.engines["critic"] = critic_strategy
        self._size_token_budget(policy.config)
        self.model_flops = ModelFlops.of(policy.config)
        self.peaks = device_peaks(self.device)
        if self.ctx.rank == 0:
            for name, strategy in self.engines.items():
                self.log.info("%s engine: %s", name, strategy.describe())
            for line in self.job.lines():
                self.log.info("fast path: %s", line)
            if self.peaks is None:
                self.log.info(
                    "fast path: no MFU metrics (no peak FLOP/s known for %s)", self.device
                )

    def _build_pipeline_roles(self, tokenizer: Any) -> None:
        """Actor, reference and (GAE) critic as DeepSpeed pipeline engines: this rank builds
        and holds its stage only (:mod:`verl_ppo.pipeline`)."""
        cfg = self.cfg
        use_critic = cfg.algorithm.adv_estimator == "gae"
        roles = build_pipeline_roles(cfg, self.job, tokenizer, self.ctx.world_size, use_critic)
        self.pipeline = roles
        self.policy_config = roles.hf_config
        self.actor, self.critic, self.reference = roles.actor, roles.critic, roles.reference
        self.engines = dict(roles.engines)
        self.model_flops = ModelFlops.of(roles.hf_config)
        self.peaks = device_peaks(self.device)
        if self.ctx.rank == 0:
            self.log.info(
                "pipeline: %s, stage params per role %s",
                roles.layout.describe(),
                roles.memory_metrics(),
            )

    def _size_token_budget(self, model_config: Any) -> None:
        """``train.max_tokens_per_micro_batch: auto``: on CUDA, from the memory free now
        (engines built; the smallest over ranks), resolved by
        :func:`verl_ppo.job.fast_path.with_token_budget`; the roles get the result."""
        free = None
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if self.ctx.world_size > 1:
                t = torch.tensor([float(free)], dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.ctx.group)
                free = int(t.item())
        self.job = with_token_budget(
            self.job, self.cfg, self.d.local_mini_batch_size, free, model_config
        )
        for role in (self.actor, self.critic, self.reference):
            if role is not None:
                role.max_tokens = self.job.max_tokens_per_micro_batch
                role.max_tokens_no_grad = self.job.max_tokens_no_grad

    def _strategy(self, role_cfg: Any, zero_stage: int) -> DeepSpeedStrategy:
        """The DeepSpeed strategy of one role (``actor`` or ``critic`` config section), with
        the job's compression, data-parallel group and deadline."""
        return DeepSpeedStrategy(
            ds_config(
                zero_stage=zero_stage,
                grad_clip=role_cfg.optim.grad_clip,
                offload_optimizer=role_cfg.offload_optimizer,
                micro_batch_size=self.d.local_micro_batch_size,
                grad_accum_steps=self.d.grad_accum_steps,
                world_size=self.ctx.world_size,
                bf16=self.job.dtype == torch.bfloat16,
            ),
            lr=role_cfg.optim.lr,
            weight_decay=role_cfg.optim.weight_decay,
            betas=role_cfg.optim.betas,
            compression=self.cfg.compression,
            group=self.ctx.group,
            timeout_s=self.ctx.timeout_s,
            recorder=self.recorder,
            fused=self.job.fused_adamw,
        )
