"""What the config rules read besides the config (:class:`Facts`), and the few derived
facts of a config that both tables (:mod:`verl_ppo.job.rules`, :mod:`verl_ppo.job.switches`)
and the resolver use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PP_KEY = "actor.model_config.hybrid_engine.training_sharding.pipeline_parallel_size"
PIPELINE_ZERO_STAGES = (0, 1)


@dataclass(frozen=True)
class Facts:
    """What the rules read besides the config.

    Attributes:
        actor_stage, critic_stage: the ZeRO stages the job runs (``auto`` resolved).
        cuda: the job runs on CUDA; None = not judged yet (a config being built: the
            device is judged by preflight and the trainer, which know the model too).
        model: :class:`verl_ppo.job.fast_path.ModelFacts` of the policy, or None (not known).
    """

    actor_stage: int
    critic_stage: int
    cuda: bool | None = None
    model: Any = None

    def stage(self, role: str) -> int:
        """The ZeRO stage of ``role`` (``actor`` or ``critic``)."""
        return self.actor_stage if role == "actor" else self.critic_stage


def pipeline_degree(cfg: Any) -> int:
    """``actor.model_config.hybrid_engine.training_sharding.pipeline_parallel_size``."""
    return int(cfg.actor.model_config_.hybrid_engine.training_sharding.pipeline_parallel_size)


def trained_roles(cfg: Any) -> tuple[str, ...]:
    """The roles with an optimizer: the actor, and the critic under GAE."""
    return ("actor", "critic") if cfg.algorithm.adv_estimator == "gae" else ("actor",)


def several_updates(cfg: Any) -> str | None:
    """Why the policy is updated more than once per rollout (None: once, which is what
    ``algorithm.old_log_prob: bypass`` needs; see :func:`verl_ppo.job.fast_path.resolve`)."""
    t = cfg.train
    if t.ppo_epochs == 1 and t.rollout_batch_size == t.ppo_mini_batch_size:
        return None
    return (
        f"ppo_epochs={t.ppo_epochs}, {t.rollout_batch_size // t.ppo_mini_batch_size} mini-batches"
    )
