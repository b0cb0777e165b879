"""Pure PPO maths, registered by name (verl's core_algos is the model).

Registries (name -> function; the config names the entry):

- :data:`ADV_ESTIMATORS` (``algorithm.adv_estimator``): ``gae``, ``grpo``;
- :data:`REWARD_SHAPERS` (``algorithm.reward_shaping``): ``last_token``;
- :data:`POLICY_LOSSES` (``algorithm.policy_loss``): ``vanilla``, ``decoupled`` (off-policy
  correction with a truncated importance weight, :mod:`~verl_ppo.algorithms.off_policy`);
- :data:`KL_ESTIMATORS` (``algorithm.kl.estimator``): ``k1``, ``k2``, ``k3``.

Shapes: ``(batch, response_len)`` for per-token tensors, ``(batch,)`` for per-sequence ones;
``response_mask`` is 1.0 on real response tokens and 0.0 on padding, so padding never
counts in any estimator, loss or metric.
"""

from verl_ppo.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_gae,
    compute_grpo,
    register_adv_estimator,
)
from verl_ppo.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
    register_kl_estimator,
)
from verl_ppo.algorithms.losses import (
    POLICY_LOSSES,
    agg_loss,
    entropy_from_logits,
    explained_variance,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss_vanilla,
    register_policy_loss,
    value_loss_clipped,
)
from verl_ppo.algorithms.off_policy import policy_loss_decoupled, truncated_is_weight
from verl_ppo.algorithms.rewards import (
    REWARD_SHAPERS,
    last_token_rewards,
    register_reward_shaper,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REWARD_SHAPERS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "compute_gae",
    "compute_grpo",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "last_token_rewards",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss_decoupled",
    "policy_loss_vanilla",
    "register_adv_estimator",
    "register_kl_estimator",
    "register_policy_loss",
    "register_reward_shaper",
    "truncated_is_weight",
    "value_loss_clipped",
]
