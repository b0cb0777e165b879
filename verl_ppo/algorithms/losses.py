"""Masked statistics, PPO clipped policy loss (with dual clip), clipped value loss, entropy.

Sources: Schulman et al. 2017 (PPO); dual clip: Ye et al. 2020 ("Mastering Complex Control
in MOBA Games with Deep RL"); value clipping and loss aggregation modes as in verl's
``core_algos.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_ppo.algorithms.registry import registrar

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask`` (all elements, or along ``dim``)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1; 0 where the mask is empty."""
    if dim is None:
        return masked_sum(x, mask) / mask.sum().clamp_min(1.0)
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp_min(1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over masked positions (Bessel-corrected when ``unbiased``)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean / unit variance over masked positions; padding -> 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        out = out + mean
    return out * mask


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    global_tokens: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss ``(batch, response_len)`` into a scalar.

    Args:
        loss_mat: per-token losses, float, ``(B, T)``.
        mask: response mask, float, ``(B, T)``.
        mode: ``token-mean`` (every token of the global batch weighs the same),
            ``seq-mean-token-mean`` (mean per sequence, then mean over sequences) or
            ``seq-mean-token-sum``.
        global_tokens: divisor for ``token-mean`` when a mini-batch is split into
            micro-batches and data-parallel ranks: the valid-token count of the whole
            mini-batch over all ranks divided by the number of ranks, so that summing the
            micro-batch losses and averaging gradients across ranks gives the global token
            mean (invariant to the number of ranks). ``None``: this micro-batch's own count.

    Raises:
        ValueError: unknown mode.
    """
    if mode == "token-mean":
        denom = mask.sum().clamp_min(1.0) if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / denom
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, mask, dim=-1).mean()
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {LOSS_AGG_MODES}")


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
register_policy_loss = registrar(POLICY_LOSSES)
"""Decorator: registers a policy loss under ``name`` (``algorithm.policy_loss`` selects
    it). A policy loss takes ``(old_log_prob, log_prob, advantages, response_mask, *,
    clip_ratio, clip_ratio_high, clip_ratio_c, loss_agg_mode, global_tokens)`` and returns
    ``(scalar loss, detached scalar metrics)``; verl's ``core_algos.py`` registers its policy
    losses the same way."""


@register_policy_loss("vanilla")
def policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss with dual clip.

    ``ratio = exp(log_prob - old_log_prob)``; per token
    ``l = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))`` and, for ``A < 0``,
    ``l = min(l, -A * clip_ratio_c)`` (dual clip bounds the loss of very large ratios).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` float.
        clip_ratio: eps_low (and eps_high unless ``clip_ratio_high``).
        clip_ratio_c: dual-clip constant, must be > 1.

    Returns:
        ``(loss, metrics)`` with metrics ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
        (mean of ``old_log_prob - log_prob``), all detached scalars.

    Raises:
        ValueError: ``clip_ratio_c <= 1``.
    """
    per_token, metrics = clipped_surrogate(
        old_log_prob, log_prob, advantages, response_mask, clip_ratio, clip_ratio_high, clip_ratio_c
    )
    return agg_loss(per_token, response_mask, loss_agg_mode, global_tokens), metrics


def clipped_surrogate(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token dual-clip PPO loss ``(B, T)`` (see :func:`policy_loss_vanilla`) and its
    detached metrics; shared by the registered policy losses.

    Raises:
        ValueError: ``clip_ratio_c <= 1``.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    neg_kl = log_prob - old_log_prob
    ratio = torch.exp(neg_kl.clamp(-20.0, 20.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + eps_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, loss3)
    per_token = torch.where(advantages < 0, dual, clipped)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask),
            "pg_clipfrac_lower": masked_mean(
                ((clipped > loss3) & (advantages < 0)).float(), response_mask
            ),
            "ppo_kl": masked_mean(-neg_kl, response_mask),
        }
    return per_token, metrics


def value_loss_clipped(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)``.

    Args:
        values, old_values, returns, response_mask: ``(B, T)`` float.

    Returns:
        ``(loss, {"vf_clipfrac": ...})``.
    """
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    l1 = (values - returns) ** 2
    l2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), response_mask, loss_agg_mode, global_tokens)
    with torch.no_grad():
        clipfrac = masked_mean((l2 > l1).float(), response_mask)
    return loss, {"vf_clipfrac": clipfrac}


@torch.no_grad()
def explained_variance(
    returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``1 - Var[returns - values] / (Var[returns] + 1e-8)`` over masked positions (the
    critic's fit; 1 = perfect, <= 0 = no better than the mean). Inputs ``(B, T)`` float;
    returns a 0-d tensor. Biased (population) variances, as in verl's ``compute_data_metrics``.
    """
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    resid = returns - values
    var_e = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    return 1.0 - var_e / (var_r + 1e-8)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``(B, T)`` of the categorical distribution of ``logits (B, T, V)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
