"""ReshardEngine: validate layouts, choose the rollout placement, plan, execute.

Usage (every rank of ``group``)::

    eng = ReshardEngine(hf_config, ParallelLayout(pp=2, dp=2), ParallelLayout(tp=4))
    rollout_shards = eng.reshard(train_shards)     # dict name -> local TP shard
    eng.last_stats                                  # ReshardStats of that call

Validation runs in the constructor, before any traffic: degrees against the world size
and the model (heads, KV heads, intermediate size, vocabulary, layer count).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_comm.telemetry import CommRecorder
from verl_ppo.reshard.executor import ReshardExecutor, ReshardStats
from verl_ppo.reshard.layout import ParallelLayout
from verl_ppo.reshard.naive import NaiveAllGather
from verl_ppo.reshard.planner import ReshardPlan, choose_rollout_order, make_plan
from verl_ppo.reshard.specs import model_dims, model_param_specs, validate_layout

METHODS = ("engine", "naive_allgather")


def build_plan(
    model_config: Any,
    train: ParallelLayout,
    rollout: ParallelLayout,
    world_size: int,
    choose_placement: bool = True,
) -> ReshardPlan:
    """Validate both layouts and return the (cached) plan; pure, no process group.

    Args:
        model_config: HF config (or an object with the same attributes).
        train, rollout: layouts; ``rollout.rank_order`` is replaced by the best placement
            when ``choose_placement``.
        world_size: ranks in the group the engine will run on.

    Raises:
        ValueError: a layout that does not fit the world size or the model; the rollout
            layout has PP > 1 or ZeRO-3 (rollout is tensor parallel only).
    """
    dims = model_dims(model_config)
    validate_layout(dims, train, world_size, "training_sharding")
    validate_layout(dims, rollout, world_size, "rollout_sharding")
    if rollout.pp != 1 or rollout.zero_stage == 3:
        raise ValueError(
            f"rollout_sharding must be tensor parallel x data parallel, got {rollout.describe()}"
        )
    specs = model_param_specs(model_config)
    if choose_placement:
        rollout = choose_rollout_order(train, rollout, specs, dims)
    return make_plan(train, rollout, specs, dims)


class ReshardEngine:
    """Moves this rank's training shards into its rollout shards.

    Args:
        model_config: HF config of the actor.
        train, rollout: layouts over the ranks of ``group``.
        group: process group (None = WORLD); its size must equal the layouts' world size.
        bucket_bytes: bucket cap (bytes of sends + receives per rank per bucket).
        method: ``"engine"`` (planned minimal traffic) or ``"naive_allgather"``.
        transport: ``"all_to_all"`` or ``"p2p"`` (engine only).
        recorder: optional :class:`CommRecorder`.
        choose_placement: let the planner pick the rollout rank placement.
        alias: engine only; see :class:`ReshardExecutor` (rollout shards may be the
            training tensors themselves where they coincide).
        ctx: the job's :class:`verl_comm.distributed.DistContext`; the naive method's gather
            groups are created with ``ctx.new_group`` (the job's ``comm.timeout_s``).

    Raises:
        ValueError: bad layout or method, before any communication (the naive method's
            ``new_group`` calls come after validation).
    """

    def __init__(
        self,
        model_config: Any,
        train: ParallelLayout,
        rollout: ParallelLayout,
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = 64 << 20,
        method: str = "engine",
        transport: str = "all_to_all",
        recorder: CommRecorder | None = None,
        choose_placement: bool = True,
        alias: bool = False,
        ctx: Any = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.plan = build_plan(model_config, train, rollout, world, choose_placement)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.group, self.method = group, method
        if method == "engine":
            self._runner = ReshardExecutor(
                self.plan, self.rank, group, bucket_bytes, transport, recorder, alias
            )
        else:
            self._runner = NaiveAllGather(self.plan, self.rank, group, bucket_bytes, recorder, ctx)
        self.last_stats: ReshardStats | None = None

    @property
    def rollout_layout(self) -> ParallelLayout:
        """The rollout layout with the placement actually used."""
        return self.plan.rollout

    def reshard(self, train_shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """See :meth:`ReshardExecutor.run`; stats in :attr:`last_stats`."""
        out, self.last_stats = self._runner.run(train_shards)
        return out
