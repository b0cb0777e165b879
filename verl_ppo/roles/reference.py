"""The frozen reference policy (no optimizer, no engine, eval mode)."""

from __future__ import annotations

import torch

from verl_ppo.roles.common import log_prob_fn, log_probs_in_micro_batches
from verl_ppo.step.experience import Experience


class Reference:
    """Frozen copy of the initial policy.

    Args:
        model: a HF causal LM; its parameters are frozen here.
        micro_batch_size: sequences per forward.
        temperature: the rollout temperature.
        packing, fused: packed sequences; the chunked LM head (:mod:`verl_ppo.roles.fused_head`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        micro_batch_size: int,
        temperature: float,
        packing: bool = False,
        fused: bool = False,
    ) -> None:
        self.model = model.eval()
        self.packing = packing
        self.lp_fn = log_prob_fn(packing, fused)
        self.max_tokens = self.max_tokens_no_grad = None  # token budgets (set by the trainer)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature

    @torch.no_grad()
    def compute_log_prob(self, exp: Experience) -> torch.Tensor:
        """Reference log-probs ``(B, R)`` float32 of ``exp``'s responses."""
        return log_probs_in_micro_batches(self, self.model, exp)
