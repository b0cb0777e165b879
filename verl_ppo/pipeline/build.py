"""Build the actor, critic and reference on DeepSpeed's pipeline engine for the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_ppo.pipeline.data import gather_pipeline_experience, per_rollout
from verl_ppo.pipeline.roles import PipelineActor, PipelineCritic, PipelineReference, PipeLoss
from verl_ppo.pipeline.strategy import PipelineStrategy
from verl_ppo.pipeline.weights import WeightSource
from verl_ppo.step.experience import Experience


@dataclass
class PipelineRoles:
    """The three roles of a PP x DP run and what the trainer asks of them.

    Attributes:
        actor, critic (None under GRPO), reference: the roles.
        engines: role -> strategy, for checkpoints (the frozen reference is not saved).
        hf_config: the policy's HF config.
        full_param_bytes: bytes of the whole policy (every unique parameter once).
    """

    actor: PipelineActor
    critic: PipelineCritic | None
    reference: PipelineReference
    engines: dict[str, PipelineStrategy]
    hf_config: Any
    full_param_bytes: int
    _source: Any = None

    @property
    def layout(self) -> Any:
        """The actor's training layout (PP x DP, ZeRO stage), as the engine runs it."""
        return self.actor.strategy.layout

    def gather(self, exp: Experience, num_mini_batches: int, pad_token_id: int) -> Experience:
        """This pipeline's training batch from its members' rollouts (see
        :func:`~verl_ppo.pipeline.data.gather_pipeline_experience`); remembers which rank
        generated each row for :meth:`per_rollout`."""
        out, self._source = gather_pipeline_experience(
            exp, self.actor.strategy.pipe_group, num_mini_batches, pad_token_id
        )
        return out

    def per_rollout(self, exp: Experience, fn: Any) -> dict[str, float]:
        """``fn(sub_exp) -> metrics`` on each generating rank's rows of the last gathered batch
        (advantages, see :func:`~verl_ppo.pipeline.data.per_rollout`); the metrics are
        averaged over the sub-batches."""
        parts = per_rollout(exp, self._source, fn)
        return {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}

    def memory_metrics(self, rollout_extra_bytes: float = 0.0) -> dict[str, float]:
        """Parameter bytes this rank holds, per role, and the policy's full size.

        Args:
            rollout_extra_bytes: bytes of the TP rollout shards that do not alias training
                storage (``memory/rollout_extra_param_bytes`` of the hybrid engine).

        Keys ending in ``_max`` are reduced over ranks by maximum (the trainer's rule).
        """
        actor = float(self.actor.strategy.param_bytes())
        m = {
            "memory/policy_full_param_bytes": float(self.full_param_bytes),
            "memory/actor_param_bytes_per_rank_max": actor,
            "memory/actor_param_bytes_generating_max": actor + rollout_extra_bytes,
            "memory/actor_param_vs_full_over_pp_max": actor
            * self.actor.strategy.pp
            / self.full_param_bytes,
            "memory/reference_param_bytes_per_rank_max": float(
                self.reference.strategy.param_bytes()
            ),
        }
        if self.critic is not None:
            m["memory/critic_param_bytes_per_rank_max"] = float(self.critic.strategy.param_bytes())
        return m


def _source(cfg: Any, tokenizer: Any, dtype: torch.dtype) -> WeightSource:
    if cfg.model.tiny is not None:
        from verl_ppo.workers.models import build_policy

        policy = build_policy(cfg.model, tokenizer, dtype, cfg.seed)  # seeded as the DP path
        return WeightSource.from_model(policy, dtype)
    from transformers import AutoConfig

    from verl_ppo.data.model_store import resolve_model_path

    path = resolve_model_path(cfg.model.path)
    return WeightSource(AutoConfig.from_pretrained(path), dtype, folder=path)


def build_pipeline_roles(
    cfg: Any, job: Any, tokenizer: Any, world_size: int, use_critic: bool
) -> PipelineRoles:
    """Every rank builds its stage of the actor, the reference and (GAE) the critic.

    Args:
        cfg: the :class:`~verl_ppo.config.PPOConfig`.
        job: the :class:`~verl_ppo.job.fast_path.ResolvedJob` (PP degree, ZeRO stages, dtype,
            fused AdamW).
        tokenizer: the policy's tokenizer (vocabulary of a ``model.tiny`` model).
        world_size: all ranks; the data-parallel size is ``world_size / PP``.
        use_critic: build the critic (GAE).

    Raises:
        ValueError / ConfigError: layout or batch sizes that do not fit the world.
    """
    from verl_ppo.reshard.specs import model_param_specs
    from verl_ppo.workers.strategy import ds_config

    pp, dtype = job.pipeline_parallel_size, job.dtype
    dp = world_size // pp
    d = cfg.derived(dp)  # per-pipeline training sizes
    source = _source(cfg, tokenizer, dtype)
    hf_config = source.config
    common = dict(
        micro_batch_size=d.local_micro_batch_size,
        grad_accum_steps=d.grad_accum_steps,
        world_size=dp,
        bf16=dtype == torch.bfloat16,
    )
    timeout = cfg.comm.timeout_s
    a = cfg.algorithm
    temp = cfg.rollout.temperature

    def strategy(role_cfg: Any, zero: int, train: bool) -> PipelineStrategy:
        ds = ds_config(
            zero_stage=zero,
            grad_clip=role_cfg.optim.grad_clip,
            offload_optimizer=False,
            **common,
        )
        o = role_cfg.optim
        return PipelineStrategy(
            ds,
            pp,
            timeout,
            o.lr if train else None,
            o.weight_decay,
            tuple(o.betas),
            fused=job.fused_adamw,
        )

    actor_s = strategy(cfg.actor, job.actor_zero_stage, True)
    actor_loss = PipeLoss("policy", a, temp)
    actor_s.init(hf_config, source, "policy", actor_loss)
    ref_s = strategy(cfg.actor, 0, False)
    ref_loss = PipeLoss("policy", a, temp)
    ref_s.init(hf_config, source, "policy", ref_loss)
    mb = d.local_micro_batch_size
    actor = PipelineActor(actor_s, actor_loss, a, mb)
    reference = PipelineReference(ref_s, ref_loss, a, mb)
    engines = {"actor": actor_s}
    critic = None
    if use_critic:
        critic_s = strategy(cfg.critic, job.critic_zero_stage, True)
        critic_loss = PipeLoss("value", a)
        critic_s.init(hf_config, source, "value", critic_loss)
        critic = PipelineCritic(critic_s, critic_loss, a, mb)
        engines["critic"] = critic_s
    source.release()
    itemsize = torch.empty((), dtype=dtype).element_size()
    full = sum(s.numel for s in model_param_specs(hf_config)) * itemsize
    return PipelineRoles(actor, critic, reference, engines, hf_config, full)
