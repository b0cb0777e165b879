"""Tensor-parallel rollout ranks of the async mode (``rollout.tensor_model_parallel_size > 1``).

The synced shards (:attr:`~verl_ppo.reshard.group_sync.SyncReceiver.live`, Megatron splits
of :func:`~verl_ppo.reshard.specs.shard_for`) are what
:class:`~verl_ppo.rollout.tp_model.TPCausalLM` reads, without a copy; a switch updates them
in place. The TP groups are sub-groups of the rollout world (its default group), built as
the hybrid engine builds its own (:meth:`verl_ppo.reshard.hybrid.HybridEngine.build`).
:class:`SyncedRollout` gives :class:`~verl_ppo.step.experience_maker.ExperienceMaker` the
hybrid-engine interface it drives (``rollout(params)`` as a context, ``last_metrics``) over
weights that are already in the rollout layout, so nothing is resharded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.distributed.context import new_group
from verl_ppo.reshard.layout import ParallelLayout
from verl_ppo.rollout.tp_generate import TPRolloutModel
from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup


def tp_rollout_model(
    model_config: Any, live: dict[str, torch.Tensor], n_ranks: int, tp: int, timeout_s: float
) -> TPRolloutModel:
    """The TP rollout model of this rollout rank (collective over the rollout world: every
    rank creates every TP group, torch's rule).

    Args:
        model_config: the policy's HF config.
        live: this rank's synced shards by HF name.
        n_ranks, tp: ``rollout.n_ranks`` and ``rollout.tensor_model_parallel_size``.
        timeout_s: deadline of the TP groups' collectives (``comm.timeout_s``).
    """
    lay, rank = ParallelLayout(dp=n_ranks // tp, tp=tp), dist.get_rank()
    group = None
    for members in lay.all_tp_groups():
        pg = new_group(sorted(members), timeout_s)
        if rank in members:
            group = TPGroup(pg, tp, members.index(rank), list(members))
    return TPRolloutModel(TPCausalLM(model_config, live, group))


class SyncedRollout:
    """The hybrid-engine interface over already-synced TP weights (see the module docstring).

    Args:
        model: the TP rollout model.
    """

    def __init__(self, model: TPRolloutModel) -> None:
        self.model = model
        self.last_metrics: dict[str, float] = {}

    @contextmanager
    def rollout(self, params: Mapping[str, torch.Tensor]) -> Iterator[TPRolloutModel]:
        """Yield the TP model (``params`` unused: the weights arrive by the sync)."""
        yield self.model


class NoStrategy:
    """What :class:`ExperienceMaker` reads of the actor's strategy with a hybrid engine:
    the training weights, which a rollout rank does not hold."""

    def hf_named_parameters(self) -> dict[str, torch.Tensor]:
        """Nothing: the rollout ranks' weights come from the sync."""
        return {}
