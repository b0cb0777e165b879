"""Actor, critic and reference on DeepSpeed's pipeline engine.

Same interface as :mod:`verl_ppo.roles` (``compute_log_prob``, ``compute_values``,
``update``), but the forward passes run stage by stage:

- the PPO policy loss and the clipped value loss are the pipeline's loss function
  (:class:`PipeLoss`, called by the last stage as ``loss_fn(outputs, labels)``); the per-token
  tensors the loss needs (responses, mask, old log-probs, advantages, returns, values)
  are the micro-batch's labels, which DeepSpeed hands to the last stage with its inputs;
- log-prob and value forwards use ``PipelineEngine.eval_batch``; the last stage returns the
  per-token values of each micro-batch and broadcasts them to its pipeline, so every stage
  holds the same ``Experience``;
- a PPO mini-batch is one ``train_batch`` call; its micro-batches are the pipeline's
  micro-batches (gradient accumulation steps of the engine).

DeepSpeed divides the last stage's loss by the gradient accumulation steps before
backward (``DeepSpeedEngine.backward``), where the data-parallel path sums micro-batch
losses unscaled: the ``token-mean`` loss is multiplied back so both layouts compute the same
gradient (tests/verl_ppo/test_pipeline.py compares them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from verl_ppo.algorithms import masked_mean
from verl_ppo.pipeline.strategy import PipelineStrategy
from verl_ppo.roles.actor import actor_loss
from verl_ppo.roles.common import global_token_divisor, response_log_probs
from verl_ppo.roles.critic import critic_loss
from verl_ppo.step.experience import Experience


class PipeLoss:
    """The ``loss_fn`` of a ``PipelineModule``; :attr:`mode` is set before each engine call.

    Modes (``labels`` per micro-batch, all ``(B, R)``):

    - ``"log_prob"`` (policy): labels ``(responses,)``; returns log-probs ``(B, R)``.
    - ``"values"`` (value): labels ``(response_mask,)``; returns values ``(B, R)`` x mask.
    - ``"train"`` (policy): labels ``(responses, mask, old_log_prob, advantages, ref)``;
      (value): labels ``(mask, values, returns)``; returns the scalar loss and appends the
      micro-batch's metrics to :attr:`metrics`.
    """

    def __init__(self, kind: str, algo: Any, temperature: float = 1.0) -> None:
        self.kind, self.algo, self.temperature = kind, algo, temperature
        self.mode = "log_prob" if kind == "policy" else "values"
        self.divisor, self.scale = 1.0, 1.0
        self.on_policy = False
        self.metrics: list[dict[str, float]] = []

    def __call__(self, outputs: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.kind == "policy":
            responses = labels[0]
            with_ent = self.mode == "train"
            logp, ent = response_log_probs(outputs, responses, self.temperature, with_ent)
            if self.mode == "log_prob":
                return logp
            _, mask, old, adv, ref = labels
            rollout_old = old
            if self.on_policy:  # algorithm.old_log_prob bypass: ratio 1, as the DP actor
                old = logp.detach()
            loss, m = actor_loss(logp, ent, mask, old, adv, ref, self.algo, self.divisor)
            if self.on_policy:
                m["rollout_log_prob_kl"] = float(masked_mean(rollout_old - logp.detach(), mask))
        else:
            mask = labels[0]
            r = mask.shape[1]
            v = outputs[:, outputs.shape[1] - r - 1 : -1]
            if self.mode == "values":
                return v * mask
            _, values, returns = labels
            loss, m = critic_loss(v, values, returns, mask, self.algo, self.divisor)
        self.metrics.append(m)
        return loss * self.scale


def _inputs(mb: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    return mb.input_ids, mb.attention_mask.long()


class _PipelineRole:
    """What the three roles share: the strategy, the loss and the batched forward."""

    prefix = ""

    def __init__(
        self, strategy: PipelineStrategy, loss: PipeLoss, algo: Any, micro_batch_size: int
    ) -> None:
        self.strategy, self.loss, self.algo = strategy, loss, algo
        self.micro_batch_size = micro_batch_size
        self.grad_comm = None  # verl_comm hooks are refused with PP (see verl_ppo.job.rules)

    @property
    def module(self) -> torch.nn.Module:
        """This rank's stage (a ``PipelineModule``)."""
        return self.strategy.module

    def _forward(self, exp: Experience, mode: str, labels) -> torch.Tensor:
        self.loss.mode = mode
        micros = exp.split(self.micro_batch_size)
        outs = self.strategy.eval_batch([(_inputs(mb), labels(mb)) for mb in micros])
        full = torch.cat(outs, 0) if outs is not None else None
        return self.strategy.broadcast_from_last(full, tuple(exp.response_mask.shape)).to(
            exp.response_mask.device
        )

    def _update(self, exp: Experience, num_mini_batches: int, ppo_epochs: int, labels):
        self.loss.mode = "train"
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        mini = max(exp.batch_size // num_mini_batches, 1)
        token_mean = self.algo.loss_agg_mode == "token-mean"
        gas = self.strategy.engine.gradient_accumulation_steps()
        grad_norms = []
        for _ in range(ppo_epochs):
            for mb_exp in exp.split(mini):
                self.loss.divisor = global_token_divisor(
                    mb_exp.response_mask, self.strategy.dp_group
                )
                self.loss.scale = float(gas) if token_mean else 1.0
                micros = mb_exp.split(self.micro_batch_size)
                self.strategy.train_batch([(_inputs(mb), labels(mb)) for mb in micros])
                gn = self.strategy.engine.get_global_grad_norm()
                if gn is not None:
                    grad_norms.append(float(gn))
        for m in self.loss.metrics:
            for k, v in m.items():
                sums[f"{self.prefix}/{k}"] += v
                counts[f"{self.prefix}/{k}"] += 1
        self.loss.metrics = []
        out = {k: sums[k] / counts[k] for k in sums}
        if grad_norms:
            out[f"{self.prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms)
        # only the last stage computed the loss: share its metrics with the pipeline
        box = [out if self.strategy.is_last_stage else None]
        if self.strategy.pp > 1:
            dist.broadcast_object_list(
                box, src=self.strategy.pipe_ranks[-1], group=self.strategy.pipe_group
            )
        return box[0]


class PipelineActor(_PipelineRole):
    """The policy on the pipeline engine (see the module docstring).

    Args:
        strategy: a :class:`PipelineStrategy` built with ``role="policy"`` and ``loss``.
        loss: its :class:`PipeLoss` (``kind="policy"``).
        algo: ``PPOConfig.algorithm``.
        micro_batch_size: sequences per pipeline micro-batch.
    """

    prefix = "actor"

    @torch.no_grad()
    def compute_log_prob(self, exp: Experience) -> torch.Tensor:
        """Log-probs ``(B, R)`` float32 of the responses under the current policy."""
        return self._forward(exp, "log_prob", lambda mb: (mb.responses,))

    def update(
        self, exp: Experience, num_mini_batches: int, ppo_epochs: int, on_policy: bool = False
    ) -> dict[str, float]:
        """PPO epochs; ``on_policy`` and metrics as :meth:`verl_ppo.roles.Actor.update`.

        Raises:
            ValueError: ``algorithm.kl.use_kl_loss`` without ``exp.ref_log_prob`` (as the
                data-parallel actor; the pipeline's labels would otherwise carry zeros).
        """
        if self.algo.kl.use_kl_loss and exp.ref_log_prob is None:
            raise ValueError(
                "algorithm.kl.use_kl_loss needs the reference log-probs: exp.ref_log_prob is None"
            )
        self.loss.on_policy = on_policy

        def labels(mb: Experience):
            ref = (  # unused by the loss without use_kl_loss: a placeholder label
                mb.ref_log_prob
                if mb.ref_log_prob is not None
                else torch.zeros_like(mb.old_log_prob)
            )
            return (mb.responses, mb.response_mask.float(), mb.old_log_prob, mb.advantages, ref)

        return self._update(exp, num_mini_batches, ppo_epochs, labels)


class PipelineReference(_PipelineRole):
    """The frozen reference policy as a pipeline (its stage only, no optimizer)."""

    @torch.no_grad()
    def compute_log_prob(self, exp: Experience) -> torch.Tensor:
        """Reference log-probs ``(B, R)`` float32."""
        return self._forward(exp, "log_prob", lambda mb: (mb.responses,))


class PipelineCritic(_PipelineRole):
    """The value model on the pipeline engine."""

    prefix = "critic"

    @torch.no_grad()
    def compute_values(self, exp: Experience) -> torch.Tensor:
        """Values ``(B, R)`` of the states before each response token, 0 on padding."""
        return self._forward(exp, "values", lambda mb: (mb.response_mask.float(),))

    def update(self, exp: Experience, num_mini_batches: int, ppo_epochs: int) -> dict[str, float]:
        """Clipped value-loss epochs; metrics as :meth:`verl_ppo.roles.Critic.update`."""
        return self._update(
            exp,
            num_mini_batches,
            ppo_epochs,
            lambda mb: (mb.response_mask.float(), mb.values, mb.returns),
        )
