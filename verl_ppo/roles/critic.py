"""The value model: the policy's backbone with a scalar head, in its own DeepSpeed engine."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from verl_ppo.algorithms import masked_mean, value_loss_clipped
from verl_ppo.roles.common import forward_in_micro_batches, position_ids_from, run_update
from verl_ppo.step.experience import Experience
from verl_ppo.workers.strategy import DeepSpeedStrategy


class ValueModel(nn.Module):
    """``backbone`` (a HF base model returning ``last_hidden_state``) + ``Linear(hidden, 1)``.

    The head starts at zero so initial values are 0 (no random value bias).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values ``(B, L)`` float32 at every position."""
        h = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from(attention_mask),
            use_cache=False,
        ).last_hidden_state
        return self.value_head(h).squeeze(-1).float()


class Critic:
    """Value estimates and the clipped value-loss update.

    Args:
        strategy: a :class:`DeepSpeedStrategy` wrapping a :class:`ValueModel`.
        algo: ``PPOConfig.algorithm``.
        micro_batch_size: sequences per forward/backward on this rank.
        group: data-parallel process group (None = WORLD); the strategy owns the gradient
            communication (``strategy.grad_comm``).
    """

    def __init__(
        self,
        strategy: DeepSpeedStrategy,
        algo: Any,
        micro_batch_size: int,
        group: Any = None,
        packing: bool = False,
        max_tokens_per_micro_batch: int | None = None,
    ) -> None:
        self.strategy = strategy
        self.packing = packing
        self.max_tokens = max_tokens_per_micro_batch
        self.max_tokens_no_grad = max_tokens_per_micro_batch
        self.algo = algo
        self.micro_batch_size = micro_batch_size
        self.group = group

    @property
    def module(self) -> nn.Module:
        """The wrapped :class:`ValueModel`."""
        return self.strategy.module

    def _values(self, exp: Experience) -> torch.Tensor:
        if self.packing:
            from verl_ppo.step.packing import packed_values

            return packed_values(self.module, exp.input_ids, exp.attention_mask, exp.prompt_len)
        v = self.module(exp.input_ids, exp.attention_mask)
        return v[:, exp.prompt_len - 1 : -1]

    @torch.no_grad()
    def compute_values(self, exp: Experience) -> torch.Tensor:
        """Values ``(B, R)`` of the states before each response token, 0 on padding."""
        self.module.eval()
        return forward_in_micro_batches(
            exp,
            lambda mb: self._values(mb) * mb.response_mask,
            self.micro_batch_size,
            self.max_tokens_no_grad,
            self.packing,
        )

    def update(self, exp: Experience, num_mini_batches: int, ppo_epochs: int) -> dict[str, float]:
        """Clipped value-loss epochs; metrics ``critic/vf_loss``, ``critic/vf_clipfrac``,
        ``critic/vpred_mean``, ``critic/grad_norm``."""
        a = self.algo

        def loss_fn(micro: Experience, divisor: float):
            v = self._values(micro)
            return critic_loss(v, micro.values, micro.returns, micro.response_mask, a, divisor)

        return run_update(self, exp, num_mini_batches, ppo_epochs, "critic", loss_fn)


def critic_loss(
    v: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    algo: Any,
    divisor: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's micro-batch loss ``vf_coef x`` clipped value loss.

    Args:
        v: ``(B, R)`` float32 current values; values, returns, mask: ``(B, R)`` float32.
        algo: ``PPOConfig.algorithm``. divisor: the ``token-mean`` divisor.

    Returns:
        ``(loss, metrics)``: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``.
    """
    loss, m = value_loss_clipped(
        v,
        values,
        returns,
        mask,
        cliprange_value=algo.cliprange_value,
        loss_agg_mode=algo.loss_agg_mode,
        global_tokens=divisor,
    )
    metrics = {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(m["vf_clipfrac"]),
        "vpred_mean": float(masked_mean(v.detach(), mask)),
    }
    return algo.vf_coef * loss, metrics
