"""KL estimators k1/k2/k3 and KL controllers (fixed, adaptive).

Sources: Schulman, "Approximating KL divergence" (2020) for k1/k2/k3; Ziegler et al. 2019
("Fine-Tuning Language Models from Human Preferences") for the adaptive controller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl_ppo.algorithms.registry import registrar

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
register_kl_estimator = registrar(KL_ESTIMATORS)
"""Decorator: registers a per-token KL estimator ``fn(log_prob, ref_log_prob)`` under
    ``name`` (``algorithm.kl.estimator`` selects it)."""


@register_kl_estimator("k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k1 = log p - log q`` (unbiased, high variance, can be negative); ``(B, T)``."""
    return log_prob - ref_log_prob


@register_kl_estimator("k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 (log p - log q)^2`` (biased, low variance, non-negative); ``(B, T)``."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k3 = exp(log q - log p) - (log q - log p) - 1`` (unbiased, non-negative); the
    log-ratio is clamped to [-20, 20] and the result to [-10, 10] for stability; ``(B, T)``."""
    r = (-(log_prob - ref_log_prob)).clamp(-20.0, 20.0)
    return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)


def kl_penalty(
    log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs ``(B, T)``, by the
    estimator registered as ``kind`` in :data:`KL_ESTIMATORS` (``p`` = policy, ``q`` =
    reference).

    Raises:
        ValueError: unknown estimator.
    """
    fn = KL_ESTIMATORS.get(kind)
    if fn is None:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return fn(log_prob, ref_log_prob)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict:
        """Serializable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError("adaptive KL controller needs target_kl > 0 and horizon > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping ``current_kl`` at the target."""
        err = max(-0.2, min(0.2, current_kl / self.target - 1.0))
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        """Serializable state."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`."""
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10_000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named ``kind`` (``fixed`` or ``adaptive``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive'")
