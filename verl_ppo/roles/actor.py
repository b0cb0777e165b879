"""The policy: a DeepSpeed engine that generates, scores its own log-probs and updates."""

from __future__ import annotations

from typing import Any

import torch

from verl_ppo.algorithms import POLICY_LOSSES, agg_loss, kl_penalty, masked_mean
from verl_ppo.roles.common import log_prob_fn, log_probs_in_micro_batches, run_update
from verl_ppo.step.experience import Experience
from verl_ppo.workers.strategy import DeepSpeedStrategy


class Actor:
    """The trained policy.

    Args:
        strategy: a :class:`DeepSpeedStrategy` whose engine wraps the policy.
        algo: ``PPOConfig.algorithm``.
        micro_batch_size: sequences per forward/backward on this rank.
        temperature: rollout temperature (log-probs are of the sampled distribution).
        group: data-parallel process group (None = WORLD); the strategy owns the gradient
            communication (``strategy.grad_comm``).
        packing: packed sequences (:mod:`verl_ppo.step.packing`).
        max_tokens_per_micro_batch: token budget of the update's micro-batches (None =
            ``micro_batch_size``); ``max_tokens_no_grad`` (attribute) that of no-grad forwards.
        fused: the chunked LM head (:mod:`verl_ppo.roles.fused_head`).
    """

    def __init__(
        self,
        strategy: DeepSpeedStrategy,
        algo: Any,
        micro_batch_size: int,
        temperature: float,
        group: Any = None,
        packing: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        fused: bool = False,
    ) -> None:
        self.strategy = strategy
        self.packing = packing
        self.max_tokens = max_tokens_per_micro_batch
        self.max_tokens_no_grad = max_tokens_per_micro_batch
        self.lp_fn = log_prob_fn(packing, fused)
        self.algo = algo
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature
        self.group = group

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model."""
        return self.strategy.module

    @torch.no_grad()
    def compute_log_prob(self, exp: Experience) -> torch.Tensor:
        """Log-probs ``(B, R)`` of the responses under the current policy (no grad)."""
        self.module.eval()
        return log_probs_in_micro_batches(self, self.module, exp)

    def update(
        self, exp: Experience, num_mini_batches: int, ppo_epochs: int, on_policy: bool = False
    ) -> dict[str, float]:
        """PPO epochs over ``exp`` split into mini-batches; returns averaged metrics.

        ``on_policy`` (one epoch, one mini-batch; ``algorithm.old_log_prob`` bypass): the
        ratio's old log-probs are the forward's own, detached (ratio 1, exactly PPO's first
        step); ``exp.old_log_prob`` (the rollout's) then only feeds ``actor/ppo_kl``.

        Metrics: ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/pg_clipfrac_lower``,
        ``actor/ppo_kl``, ``actor/entropy``, ``actor/grad_norm`` and ``actor/kl_loss``
        when the KL is a loss term.
        """
        a = self.algo

        def loss_fn(micro: Experience, divisor: float):
            logp, ent = self.lp_fn(
                self.module,
                micro.input_ids,
                micro.attention_mask,
                exp.prompt_len,
                self.temperature,
                with_entropy=True,
            )
            mask = micro.response_mask
            old = logp.detach() if on_policy else micro.old_log_prob
            loss, metrics = actor_loss(
                logp, ent, mask, old, micro.advantages, micro.ref_log_prob, a, divisor,
                rollout_log_prob=micro.rollout_log_prob,
            )  # fmt: skip
            if on_policy:  # how far the rollout's log-probs are from the training forward's
                metrics["rollout_log_prob_kl"] = float(
                    masked_mean(micro.old_log_prob - logp.detach(), mask)
                )
            return loss, metrics

        return run_update(self, exp, num_mini_batches, ppo_epochs, "actor", loss_fn)


def actor_loss(
    logp: torch.Tensor,
    ent: torch.Tensor,
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    ref_log_prob: torch.Tensor | None,
    algo: Any,
    divisor: float,
    rollout_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's micro-batch loss: ``algo.policy_loss``, entropy bonus, optional KL loss.

    Shared by the data-parallel actor and the pipeline's loss function.

    Args:
        logp, ent: ``(B, R)`` float32 log-probs and entropies under the current policy.
        mask, old_log_prob, advantages, ref_log_prob: ``(B, R)`` float32 (ref only with
            ``algo.kl.use_kl_loss``).
        algo: ``PPOConfig.algorithm``.
        divisor: the ``token-mean`` divisor (:func:`~verl_ppo.roles.common.global_token_divisor`).
        rollout_log_prob: ``(B, R)`` the behaviour policy's log-probs, read by the
            ``decoupled`` loss only (the asynchronous mode's off-policy correction,
            :mod:`verl_ppo.algorithms.off_policy`).

    Returns:
        ``(loss, metrics)``: metrics ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``,
        ``ppo_kl``, ``entropy`` and ``kl_loss`` with the KL loss term.
    """
    a = algo
    behaviour = {"rollout_log_prob": rollout_log_prob} if a.policy_loss == "decoupled" else {}
    pg_loss, m = POLICY_LOSSES[a.policy_loss](
        old_log_prob,
        logp,
        advantages,
        mask,
        clip_ratio=a.clip_ratio,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        global_tokens=divisor,
        **behaviour,
    )
    metrics = {k: float(v) for k, v in m.items()}
    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["entropy"] = float(masked_mean(ent.detach(), mask))
    loss = pg_loss
    if a.entropy_coeff > 0:
        loss = loss - a.entropy_coeff * agg_loss(ent, mask, a.loss_agg_mode, divisor)
    if a.kl.use_kl_loss:
        kl = kl_penalty(logp, ref_log_prob, a.kl.estimator)
        kl_loss = agg_loss(kl, mask, a.loss_agg_mode, divisor)
        loss = loss + a.kl.kl_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())
    return loss, metrics
