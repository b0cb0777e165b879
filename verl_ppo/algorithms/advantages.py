"""Advantage estimators, registered by name: ``gae`` and ``grpo``.

Sources: Schulman et al. 2016 (GAE); Shao et al. 2024 (DeepSeekMath, GRPO's
group-normalised outcome advantage); verl's ``core_algos.py`` for the interface.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_ppo.algorithms.losses import masked_whiten
from verl_ppo.algorithms.registry import registrar

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
register_adv_estimator = registrar(ADV_ESTIMATORS)
"""Decorator: registers an advantage estimator under ``name``."""


@register_adv_estimator("gae")
@torch.no_grad()
def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``;
    the value after the last valid token is 0 and padded positions are skipped (the
    recursion carries over them unchanged), so right padding never leaks into returns.

    Args:
        token_level_rewards: ``(B, T)`` float.
        values: ``(B, T)`` float, critic values at each response position.
        response_mask: ``(B, T)`` float, 1 on valid tokens.
        whiten: normalise advantages over the batch (masked).

    Returns:
        ``(advantages, returns)``, both ``(B, T)``, zero on padding; returns are computed
        before whitening (``returns = A + V``).
    """
    B, T = token_level_rewards.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(token_level_rewards)
    for t in reversed(range(T)):
        m = response_mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        adv[:, t] = gae * m
        last_gae = torch.where(m > 0, gae, last_gae)
        next_value = torch.where(m > 0, values[:, t], next_value)
    returns = (adv + values) * response_mask
    if whiten:
        adv = masked_whiten(adv, response_mask)
    return adv, returns


@register_adv_estimator("grpo")
@torch.no_grad()
def compute_grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised outcome advantage (GRPO).

    Each sequence's score is the sum of its token rewards; within each group of samples of
    the same prompt, ``A = (s - mean_group) / (std_group + eps)`` (or without the division
    when ``norm_by_std`` is False, Dr. GRPO style), broadcast to every valid token.

    Args:
        token_level_rewards, response_mask: ``(B, T)`` float.
        group_index: ``(B,)`` int64, samples of one prompt share an index.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``; returns equal advantages (no critic).

    Raises:
        ValueError: a group has a single sample (its std is undefined).
    """
    scores = (token_level_rewards * response_mask).sum(-1)
    out = torch.zeros_like(scores)
    for g in torch.unique(group_index):
        sel = group_index == g
        if int(sel.sum()) < 2:
            raise ValueError(
                "grpo needs at least 2 samples per prompt (algorithm.n_samples >= 2); "
                f"group {int(g)} has {int(sel.sum())}"
            )
        s = scores[sel]
        centred = s - s.mean()
        out[sel] = centred / (s.std() + epsilon) if norm_by_std else centred
    adv = out[:, None] * response_mask
    return adv, adv
