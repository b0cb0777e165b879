"""Reward shaping, registered by name: sequence scores -> per-token rewards ``(B, T)``.

``last_token`` places each response's score on its last valid token and, when the KL is
part of the reward, subtracts ``kl_coef * KL(pi_old || pi_ref)`` at every token. Sources:
Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", eq. 2) and
Ouyang et al. 2022 (InstructGPT, the per-token KL penalty); verl's ``ray_trainer.py``
``apply_kl_penalty`` for the interface.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_ppo.algorithms.kl import kl_penalty
from verl_ppo.algorithms.registry import registrar

REWARD_SHAPERS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
register_reward_shaper = registrar(REWARD_SHAPERS)
"""Decorator: registers a reward shaper under ``name`` (``algorithm.reward_shaping``
    selects it). A shaper returns ``(token_level_rewards, kl)``, both ``(B, T)``."""


@register_reward_shaper("last_token")
@torch.no_grad()
def last_token_rewards(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
    use_kl_in_reward: bool = True,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome reward at the last response token, minus the per-token KL penalty.

    Args:
        scores: ``(B,)`` float, one score per response.
        response_mask: ``(B, T)`` float, 1 on valid response tokens (contiguous from 0).
        old_log_prob, ref_log_prob: ``(B, T)`` float32 log-probs of the sampled tokens under
            the rollout policy and the reference.
        kl_coef: the KL controller's current coefficient (beta).
        kl_estimator: a name in :data:`verl_ppo.algorithms.KL_ESTIMATORS`.
        use_kl_in_reward: subtract ``kl_coef * kl`` from the rewards (else the KL is only
            returned, e.g. for a KL loss term or the ``actor/kl`` metric).

    Returns:
        ``(token_level_rewards, kl)``, both ``(B, T)`` float32 and zero on padding (an
        empty response gets its score at position 0).

    Raises:
        ValueError: unknown ``kl_estimator``.
    """
    mask = response_mask
    scores_tok = torch.zeros_like(mask)
    last = (mask.sum(-1).long() - 1).clamp_min(0)
    scores_tok[torch.arange(mask.shape[0], device=mask.device), last] = scores.float()
    kl = kl_penalty(old_log_prob, ref_log_prob, kl_estimator) * mask
    rewards = scores_tok - kl_coef * kl if use_kl_in_reward else scores_tok
    return rewards, kl
