"""Pure PPO maths, registered by name (verl's core_algos is the model).

Shapes: ``(batch, response_len)`` for per-token tensors, ``(batch,)`` for per-sequence ones;
``response_mask`` is 1.0 on real response tokens and 0.0 on padding, so padding never
counts in any estimator, loss or metric.
"""

from verl_ppo.algorithms.advantages import ADV_ESTIMATORS, compute_gae, compute_grpo
from verl_ppo.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
)
from verl_ppo.algorithms.losses import (
    agg_loss,
    entropy_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss_vanilla,
    value_loss_clipped,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "compute_gae",
    "compute_grpo",
    "entropy_from_logits",
    "kl_penalty",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss_vanilla",
    "value_loss_clipped",
]
