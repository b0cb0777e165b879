"""The frozen reference policy (no optimizer, no engine, eval mode)."""

from __future__ import annotations

import torch

from verl_ppo.experience import Experience
from verl_ppo.roles.common import log_prob_fn


class Reference:
    """Frozen copy of the initial policy.

    Args:
        model: a HF causal LM; its parameters are frozen here.
        micro_batch_size: sequences per forward.
        temperature: the rollout temperature.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        micro_batch_size: int,
        temperature: float,
        packing: bool = False,
    ) -> None:
        self.model = model.eval()
        self.lp_fn = log_prob_fn(packing)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature

    @torch.no_grad()
    def compute_log_prob(self, exp: Experience) -> torch.Tensor:
        """Reference log-probs ``(B, R)`` float32 of ``exp``'s responses."""
        parts = [
            self.lp_fn(
                self.model, mb.input_ids, mb.attention_mask, exp.prompt_len, self.temperature
            )[0]
            for mb in exp.split(self.micro_batch_size)
        ]
        return torch.cat(parts, 0)
