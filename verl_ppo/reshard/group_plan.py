"""Pure plan of a weight sync between two rank groups: training ranks -> rollout ranks.

In the asynchronous (one-step-off-policy) mode the world splits into training ranks (DP,
or PP x DP: every rank holds its stage's full weights; ZeRO-3 and training TP are not
covered) and rollout ranks (TP x DP). After each optimizer step every rollout rank must
receive exactly its own TP shard once. The shard boxes come from the resharding planner's
specs (:func:`~verl_ppo.reshard.specs.shard_for`, Megatron-LM splits), so the rollout
shards are the ones :class:`~verl_ppo.rollout.tp_model.TPCausalLM` reads.

Each (rollout rank, parameter) shard is fetched from one training rank that holds the
parameter, largest shards first, each from the holder that has sent the fewest elements
so far (ties: the holder after the previous choice, round-robin), which spreads the load
over the DP replicas instead of one sender capped by one NIC (the bottleneck reported for
verl's single NCCL sender). All shards one training rank sends to one rollout rank form a
:class:`SyncStream`: their TP-local tensors flattened and concatenated in parameter order,
cut into buckets of ``bucket_elems`` elements. Everything here is pure; nothing is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_ppo.reshard.layout import ParallelLayout
from verl_ppo.reshard.specs import (
    ParamSpec,
    Shard,
    model_dims,
    model_param_specs,
    shard_for,
    validate_layout,
)


@dataclass(frozen=True)
class SyncStream:
    """What one training rank sends one rollout rank at every sync.

    Attributes:
        src, dst: ranks in the sync group (training sender, rollout receiver).
        params: spec indices, ascending; their TP-local shards are concatenated.
        numel: elements of the concatenation.
    """

    src: int
    dst: int
    params: tuple[int, ...]
    numel: int

    def buckets(self, bucket_elems: int) -> list[tuple[int, int]]:
        """``[start, stop)`` element ranges of the buckets (the last may be shorter)."""
        return [(a, min(a + bucket_elems, self.numel)) for a in range(0, self.numel, bucket_elems)]


@dataclass(frozen=True)
class GroupSyncPlan:
    """A static cross-group sync plan.

    Attributes:
        specs: parameter specs (HF names and shapes), indexed by ``SyncStream.params``.
        train, rollout: the two layouts (``train``: TP 1, no ZeRO-3; ``rollout``: PP 1).
        train_ranks, rollout_ranks: sync-group ranks playing layout rank ``i`` of each.
        rollout_shards: ``[rollout layout rank][param] -> Shard | None``.
        streams: every (sender, receiver) stream.
        bucket_elems: elements per bucket.
    """

    specs: tuple[ParamSpec, ...]
    train: ParallelLayout
    rollout: ParallelLayout
    train_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    rollout_shards: tuple[tuple[Shard | None, ...], ...]
    streams: tuple[SyncStream, ...]
    bucket_elems: int

    def sends_of(self, rank: int) -> list[SyncStream]:
        """Streams ``rank`` sends, in plan order (the order every peer uses)."""
        return [s for s in self.streams if s.src == rank]

    def recvs_of(self, rank: int) -> list[SyncStream]:
        """Streams ``rank`` receives, in plan order."""
        return [s for s in self.streams if s.dst == rank]

    def send_elems(self) -> dict[int, int]:
        """Elements each training rank sends per sync (the load spread)."""
        out = dict.fromkeys(self.train_ranks, 0)
        for s in self.streams:
            out[s.src] += s.numel
        return out

    def rollout_shards_of(self, rank: int) -> dict[str, Shard]:
        """``rank``'s rollout shards by HF name (``rank`` must be a rollout rank)."""
        i = self.rollout_ranks.index(rank)
        return {
            self.specs[p].name: sh for p, sh in enumerate(self.rollout_shards[i]) if sh is not None
        }


def _check_groups(
    train: ParallelLayout,
    rollout: ParallelLayout,
    train_ranks: tuple[int, ...],
    rollout_ranks: tuple[int, ...],
) -> None:
    if not train_ranks or not rollout_ranks:
        raise ValueError(
            f"weight sync needs training and rollout ranks; got {len(train_ranks)} training "
            f"and {len(rollout_ranks)} rollout ranks (a group is empty)"
        )
    both = set(train_ranks) & set(rollout_ranks)
    if (
        both
        or len(set(train_ranks)) < len(train_ranks)
        or len(set(rollout_ranks)) < len(rollout_ranks)
    ):
        raise ValueError(
            f"training ranks {list(train_ranks)} and rollout ranks {list(rollout_ranks)} must be "
            "distinct and disjoint" + (f" (both hold {sorted(both)})" if both else "")
        )
    if train.tp != 1 or train.zero_stage == 3:
        raise ValueError(
            f"cross-group sync reads full per-stage weights on every training rank; training "
            f"layout {train.describe()} (tp={train.tp}, zero_stage={train.zero_stage}) is not "
            "covered: use tensor_parallel_size 1 and zero_stage <= 2 for training"
        )
    if rollout.pp != 1:
        raise ValueError(
            f"rollout layout {rollout.describe()} has pipeline_parallel_size {rollout.pp}; "
            "rollout ranks are TP x DP only"
        )


def plan_group_sync(
    model_config: Any,
    train: ParallelLayout,
    rollout: ParallelLayout,
    train_ranks: list[int] | tuple[int, ...],
    rollout_ranks: list[int] | tuple[int, ...],
    bucket_elems: int = 1 << 22,
) -> GroupSyncPlan:
    """Plan the sync of ``model_config``'s weights from ``train`` to ``rollout`` ranks.

    Args:
        model_config: HF config (Llama family or GPT-2, see :mod:`~verl_ppo.reshard.specs`).
        train: layout of the training ranks (PP x DP, ``tp == 1``, ZeRO stage 0-2).
        rollout: layout of the rollout ranks (TP x DP, ``pp == 1``).
        train_ranks, rollout_ranks: sync-group ranks playing ``train``'s (``rollout``'s)
            layout rank 0, 1, ...; disjoint.
        bucket_elems: elements per bucket (>= 1).

    Returns:
        a :class:`GroupSyncPlan`, identical on every rank for the same arguments.

    Raises:
        ValueError: an empty or overlapping group, layouts that do not match the group
            sizes or the model (TP not dividing heads, ...), or a layout this sync does
            not cover; all before any communication.
    """
    train_ranks, rollout_ranks = tuple(train_ranks), tuple(rollout_ranks)
    _check_groups(train, rollout, train_ranks, rollout_ranks)
    if bucket_elems < 1:
        raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems}")
    dims = model_dims(model_config)
    validate_layout(dims, train, len(train_ranks), "actor")
    validate_layout(dims, rollout, len(rollout_ranks), "rollout")
    specs = model_param_specs(model_config)
    holders = [
        [train_ranks[i] for i in range(train.world_size) if shard_for(s, train, i, dims)]
        for s in specs
    ]
    shards = tuple(
        tuple(shard_for(s, rollout, j, dims) for s in specs) for j in range(rollout.world_size)
    )
    jobs = [
        (sh.numel, j, p)
        for j in range(rollout.world_size)
        for p, sh in enumerate(shards[j])
        if sh is not None
    ]
    jobs.sort(key=lambda x: (-x[0], x[1], x[2]))
    load = dict.fromkeys(train_ranks, 0)
    last = -1
    chosen: dict[tuple[int, int], list[int]] = {}
    for numel, j, p in jobs:
        cands = holders[p]
        start = (cands.index(last) + 1) if last in cands else 0
        order = cands[start:] + cands[:start]  # round-robin on ties
        src = min(order, key=lambda r: load[r])
        load[src] += numel
        last = src
        chosen.setdefault((src, rollout_ranks[j]), []).append(p)
    streams = []
    for (src, dst), ps in sorted(chosen.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        j = rollout_ranks.index(dst)
        ps = tuple(sorted(ps))
        streams.append(SyncStream(src, dst, ps, sum(shards[j][p].numel for p in ps)))
    return GroupSyncPlan(
        specs, train, rollout, train_ranks, rollout_ranks, shards, tuple(streams), bucket_elems
    )
