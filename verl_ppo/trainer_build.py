"""Building the PPO job's parts: the actor, reference and (GAE) critic with their
DeepSpeed strategies (data-parallel or pipeline layout), the token budget of
``train.max_tokens_per_micro_batch: auto`` and the reward model.

:class:`TrainerBuildMixin` is one part of :class:`verl_ppo.trainer.PPOTrainer`; its methods
read the attributes that :meth:`~verl_ppo.trainer.PPOTrainer.setup` sets (``config``,
``ctx``, ``group``, ``device``, ``dtype``, ``d``, ``tokenizer``, ``task``, ``recorder``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from verl_ppo.fast_path import with_token_budget
from verl_ppo.models import (
    build_policy,
    build_value_model,
    check_uniform_dtype,
)
from verl_ppo.perf import ModelFlops, device_peaks
from verl_ppo.pipeline.build import build_pipeline_roles
from verl_ppo.reward import build_reward_model
from verl_ppo.reward.base import RewardModel
from verl_ppo.reward.cache import CachedReward
from verl_ppo.reward.rule import RuleReward
from verl_ppo.roles import Actor, Critic, Reference
from verl_ppo.strategy import DeepSpeedStrategy, ds_config


class TrainerBuildMixin:
    """The roles, engines and reward of :class:`~verl_ppo.trainer.PPOTrainer` (collective
    where they build DeepSpeed engines)."""

    def _build_roles(self) -> None:
        """Actor, reference and (for GAE) critic; each trained role's strategy owns its
        DeepSpeed engine and gradient communication (collective)."""
        cfg = self.config
        policy = build_policy(cfg.model, self.tokenizer, self.dtype, cfg.seed).to(self.device)
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        ref_model = copy.deepcopy(policy)
        check_uniform_dtype(policy, self.dtype, "actor")
        self.policy_config = policy.config
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        # copied before the actor engine exists: ZeRO-3 partitions the policy's parameters
        # in place, and a copy made afterwards holds empty (numel 0) tensors
        value_model = None
        if self.use_critic:
            value_model = build_value_model(policy, self.dtype).to(self.device)
        if self.job.torch_compile:  # after every copy: the compiled wrappers are not copied
            from verl_ppo.compiled import compile_decoder_layers

            for m in (policy, ref_model, value_model):
                if m is not None:
                    compile_decoder_layers(m)
        engines_cfg = dict(
            micro_batch_size=self.d.local_micro_batch_size,
            grad_accum_steps=self.d.grad_accum_steps,
            world_size=self.world,
            bf16=self.dtype == torch.bfloat16,
        )
        actor_strategy = self._strategy(cfg.actor, self.job.actor_zero_stage, engines_cfg)
        actor_strategy.init(policy)
        packing, fused = self.job.sequence_packing, self.job.fused_log_probs
        budget = cfg.train.max_tokens_per_micro_batch
        budget = None if budget == "auto" else budget  # sized below, once the engines exist
        self.actor = Actor(
            actor_strategy,
            cfg.algorithm,
            self.d.local_micro_batch_size,
            cfg.rollout.temperature,
            group=self.group,
            packing=packing,
            max_tokens_per_micro_batch=budget,
            fused=fused,
        )
        self.reference = Reference(
            ref_model,
            self.d.local_micro_batch_size,
            cfg.rollout.temperature,
            packing=packing,
            fused=fused,
        )
        self.engines: dict[str, DeepSpeedStrategy] = {"actor": actor_strategy}
        self.critic: Critic | None = None
        if value_model is not None:
            critic_strategy = self._strategy(cfg.critic, self.job.critic_zero_stage, engines_cfg)
            critic_strategy.init(value_model)
            self.critic = Critic(
                critic_strategy,
                cfg.algorithm,
                self.d.local_micro_batch_size,
                group=self.group,
                packing=packing,
                max_tokens_per_micro_batch=budget,
            )
            self.engines["critic"] = critic_strategy
        self._size_token_budget(policy.config)
        self.model_flops = ModelFlops.of(policy.config)
        self.peaks = device_peaks(self.device)
        if self.rank == 0:
            for name, strategy in self.engines.items():
                self.log.info("%s engine: %s", name, strategy.describe())
            for line in self.job.lines():
                self.log.info("fast path: %s", line)
            if self.peaks is None:
                self.log.info(
                    "fast path: no MFU metrics (no peak FLOP/s known for %s)", self.device
                )

    def _build_pipeline_roles(self) -> None:
        """Actor, reference and (GAE) critic as DeepSpeed pipeline engines: this rank builds
        and holds its stage only (:mod:`verl_ppo.pipeline`)."""
        cfg = self.config
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        roles = build_pipeline_roles(cfg, self.job, self.tokenizer, self.world, self.use_critic)
        self.pipeline = roles
        self.policy_config = roles.hf_config
        self.actor, self.critic, self.reference = roles.actor, roles.critic, roles.reference
        self.engines = dict(roles.engines)
        self.model_flops = ModelFlops.of(roles.hf_config)
        self.peaks = device_peaks(self.device)
        if self.rank == 0:
            self.log.info(
                "pipeline: %s, stage params per role %s",
                roles.layout.describe(),
                roles.memory_metrics(),
            )

    def _size_token_budget(self, model_config: Any) -> None:
        """``train.max_tokens_per_micro_batch: auto``: on CUDA, from the memory free now
        (engines built; the smallest over ranks), resolved by
        :func:`verl_ppo.fast_path.with_token_budget`."""
        free = None
        if self.cuda:
            free = torch.cuda.mem_get_info(self.device)[0]
            if self.world > 1:
                t = torch.tensor([float(free)], dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
                free = int(t.item())
        self.job = with_token_budget(
            self.job, self.config, self.d.local_mini_batch_size, free, model_config
        )
        for role in (self.actor, self.critic, self.reference):
            if role is not None:
                role.max_tokens = self.job.max_tokens_per_micro_batch
                role.max_tokens_no_grad = self.job.max_tokens_no_grad

    def _strategy(
        self, role_cfg: Any, zero_stage: int, engines_cfg: dict[str, Any]
    ) -> DeepSpeedStrategy:
        """The DeepSpeed strategy of one role (``actor`` or ``critic`` config section), with
        the job's compression, data-parallel group and deadline."""
        return DeepSpeedStrategy(
            ds_config(
                zero_stage=zero_stage,
                grad_clip=role_cfg.optim.grad_clip,
                offload_optimizer=role_cfg.offload_optimizer,
                **engines_cfg,
            ),
            lr=role_cfg.optim.lr,
            weight_decay=role_cfg.optim.weight_decay,
            betas=role_cfg.optim.betas,
            compression=self.config.compression,
            group=self.group,
            timeout_s=self.ctx.timeout_s,
            recorder=self.recorder,
            fused=self.job.fused_adamw,
        )

    def _build_reward(self) -> RewardModel:
        """The reward model of ``reward.model`` (rule scorer of the task by default), wrapped in
        the exact-key LRU cache when ``reward.cache_entries`` > 0; a remote reward's calls
        are capped at ``comm.timeout_s``."""
        rc = self.config.reward
        if rc.model == "rule":
            model: Any = RuleReward(score_fn=self.task.score)
        else:
            model = build_reward_model(
                rc.model, device=str(self.device), deadline_s=self.ctx.timeout_s
            )
        if rc.cache_entries:
            model = CachedReward(model, rc.cache_entries)
        return model
