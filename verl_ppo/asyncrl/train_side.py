"""The training ranks' experience source in the async mode.

:class:`AsyncExperience` stands where :class:`~verl_ppo.step.experience_maker.ExperienceMaker`
stands in the colocated mode (:class:`~verl_ppo.step.ppo_step.PPOStep` calls
``make_experience(step, timer)`` and ``greedy_scores``). ``make_experience(k)`` first
publishes the current weights (version ``k``: ``k`` optimizer steps) to the rollout ranks,
then receives batch ``k`` from this rank's rollout rank, which generated it with version
``max(k - rollout.max_staleness, first step)`` while this rank trained on batch ``k - 1``.
The staleness ``k - version`` of every trained batch is checked against the bound (an
error, never a silent drift) and logged (``async/staleness``, ``async/staleness_max``).
Greedy evaluation stays on the training ranks' own policy (the local experience maker).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from verl_ppo.asyncrl.channel import ExperienceChannel, RolloutLinkError
from verl_ppo.asyncrl.weights import WeightPublisher
from verl_ppo.asyncrl.world import START_KEY, AsyncWorld
from verl_ppo.observe.metrics import PhaseTimer
from verl_ppo.step.experience import Experience
from verl_ppo.step.experience_maker import ExperienceMaker


class StalenessError(RolloutLinkError):
    """A batch generated with weights older than ``rollout.max_staleness`` steps (or newer
    than the trained ones)."""


class AsyncExperience:
    """Training side of the async mode (see the module docstring).

    Args:
        world: the async world (this rank a training rank).
        local: this rank's colocated experience maker (prompt order, evaluation).
        publisher: posts the weights (:class:`~verl_ppo.asyncrl.weights.WeightPublisher`).
        params: returns the actor's full weights by HF name (the engine's real holdings).
        max_staleness: ``rollout.max_staleness``.
        device: where the experience tensors go.
    """

    def __init__(
        self,
        world: AsyncWorld,
        local: ExperienceMaker,
        publisher: WeightPublisher,
        params: Callable[[], Mapping[str, torch.Tensor]],
        max_staleness: int,
        device: torch.device,
    ) -> None:
        self.world, self.local, self.publisher, self.params = world, local, publisher, params
        self.max_staleness, self.device = max_staleness, device
        self.channel = ExperienceChannel(
            world.experience, world.rank, world.wire_device, world.timeout_s
        )
        self.server = world.server_of(world.rank)
        self.first: int | None = None

    def begin(self, step: int) -> None:
        """Announce the run's first step (0 or the resumed one) to the rollout ranks."""
        self.first = step
        if self.world.rank == 0:
            self.world.store.set(START_KEY, str(step))

    def make_experience(self, step: int, timer: PhaseTimer) -> tuple[Experience, dict[str, float]]:
        """Publish version ``step``, then receive batch ``step``; phases ``weight_sync`` and
        ``rollout_wait``.

        Raises:
            RolloutLinkError, WeightSyncError: a dead or late rollout rank (named, with the
                phase), or a batch of other prompts.
            StalenessError: the batch's weights are outside ``[step - max_staleness, step]``.
        """
        if self.first is None:
            raise RuntimeError("AsyncExperience.begin(first step) was not called")
        with timer.phase("weight_sync"):
            m = self.publisher.publish(self.params())
        texts, entries, groups = self.local.prompts(step)
        with timer.phase("rollout_wait"):
            exp, version, rollout_stats = self.channel.recv(self.server, step, (entries, groups))
        m.update(rollout_stats)
        exp = _to_device(exp, self.device)  # from host memory when the bridge is gloo
        staleness = step - version
        if not 0 <= staleness <= self.max_staleness or version < self.first:
            raise StalenessError(
                f"rank {self.world.rank}: batch {step} from rollout rank {self.server} was "
                f"generated with weights version {version}: staleness {staleness} outside "
                f"0..rollout.max_staleness={self.max_staleness}"
            )
        m.update(
            {
                "async/staleness": float(staleness),
                "async/staleness_max": float(staleness),
                "async/weights_version": float(version),
            }
        )
        return exp, m

    def greedy_scores(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Greedy held-out scores on this rank's own policy
        (:meth:`~verl_ppo.step.experience_maker.ExperienceMaker.greedy_scores`)."""
        return self.local.greedy_scores(*args, **kwargs)

    def close(self) -> None:
        """Wait for the last sync to be taken (a failure is logged: close also runs after
        the error that stopped the job, which must stay the one reported), then close the
        local maker."""
        try:
            self.publisher.close()
        except RuntimeError as e:
            logging.getLogger(__name__).warning("closing the weight sync: %s", e)
        finally:
            self.local.close()


def _to_device(exp: Experience, device: torch.device) -> Experience:
    """``exp`` with its tensors on ``device`` (itself when they are there already)."""
    if exp.input_ids.device == device:
        return exp
    moved = {
        f.name: getattr(exp, f.name).to(device)
        for f in dataclasses.fields(exp)
        if isinstance(getattr(exp, f.name), torch.Tensor)
    }
    moved["responses"] = moved["input_ids"][:, exp.prompt_len :]  # a view, as received
    return dataclasses.replace(exp, **moved)


def async_experience(
    cfg: Any,
    world: AsyncWorld,
    local: ExperienceMaker,
    actor_strategy: Any,
    model_config: Any,
    actor_zero_stage: int,
    device: torch.device,
) -> AsyncExperience:
    """The training rank's :class:`AsyncExperience`: the sync plan, the weight publisher
    reading ``actor_strategy.hf_named_parameters()`` (what the engine really holds)."""
    from verl_ppo.asyncrl.weights import sync_plan

    plan = sync_plan(cfg, model_config, actor_zero_stage)
    publisher = WeightPublisher(plan, world, cfg, device)
    return AsyncExperience(
        world, local, publisher, actor_strategy.hf_named_parameters,
        cfg.rollout.max_staleness, device,
    )  # fmt: skip
