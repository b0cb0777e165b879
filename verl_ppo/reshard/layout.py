"""Parallel layouts: PP x DP x TP degrees, rank <-> coordinate arithmetic, groups.

A :class:`ParallelLayout` is a pure, hashable dataclass; nothing here touches a
process group. Canonical slot order follows Megatron-LM / torchtitan: TP varies
fastest, then DP, then PP::

    slot = pp * (dp_size * tp_size) + dp * tp_size + tp

``rank_order[slot]`` is the rank (index in the process group the engine runs on)
that plays that slot. The identity is the usual placement; the planner may pick
another permutation for the rollout layout so that each rank's rollout shard
overlaps what it already holds in training (HybridFlow's 3D-HybridEngine groups,
EuroSys'25 section 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of pipeline (pp), data (dp) and tensor (tp) parallelism plus ZeRO stage.

    Args:
        pp: pipeline-parallel degree (contiguous layer ranges per stage).
        dp: data-parallel degree (replicas; with ``zero_stage == 3`` the DP group
            partitions each parameter's flat storage).
        tp: tensor-parallel degree (Megatron column/row/vocab splits).
        zero_stage: DeepSpeed ZeRO stage, 0-3; only stage 3 changes what a rank holds.
        rank_order: optional permutation, ``rank_order[slot] = rank``; None = identity.

    Raises:
        ValueError: a degree < 1, a ZeRO stage outside 0-3, or a rank_order that is not
            a permutation of ``range(pp * dp * tp)``.
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    zero_stage: int = 0
    rank_order: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelLayout.{name} must be an integer >= 1, got {v!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(
                f"ParallelLayout.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}"
            )
        if self.rank_order is not None:
            ro = tuple(int(r) for r in self.rank_order)
            if sorted(ro) == list(range(self.world_size)) and ro == tuple(range(self.world_size)):
                object.__setattr__(self, "rank_order", None)
            elif sorted(ro) != list(range(self.world_size)):
                raise ValueError(
                    f"ParallelLayout.rank_order must be a permutation of range({self.world_size}), "
                    f"got {ro}"
                )
            else:
                object.__setattr__(self, "rank_order", ro)

    @property
    def world_size(self) -> int:
        """Number of ranks the layout spans: ``pp * dp * tp``."""
        return self.pp * self.dp * self.tp

    def describe(self) -> str:
        """Short human-readable name, e.g. ``"PP2xDP2"``, ``"ZeRO3-DP4"``, ``"TP2xDP2"``."""
        parts = []
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.tp > 1:
            parts.append(f"TP{self.tp}")
        if self.dp > 1 or not parts:
            parts.append(f"DP{self.dp}")
        name = "x".join(parts)
        if self.zero_stage == 3:
            name = f"ZeRO3-{name}"
        return name

    # ---- rank <-> coordinates -------------------------------------------------------
    def slot_of(self, pp: int, dp: int, tp: int) -> int:
        """Canonical slot index of coordinates ``(pp, dp, tp)``."""
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise ValueError(f"coordinates (pp={pp}, dp={dp}, tp={tp}) outside {self}")
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        """Rank that holds coordinates ``(pp, dp, tp)``."""
        slot = self.slot_of(pp, dp, tp)
        return slot if self.rank_order is None else self.rank_order[slot]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp, dp, tp)`` coordinates of ``rank``.

        Raises:
            ValueError: rank outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size}) for {self.describe()}")
        slot = rank if self.rank_order is None else self.rank_order.index(rank)
        tp = slot % self.tp
        dp = (slot // self.tp) % self.dp
        pp = slot // (self.tp * self.dp)
        return pp, dp, tp

    # ---- groups ------------------------------------------------------------------------
    def tp_group(self, rank: int) -> list[int]:
        """Ranks of ``rank``'s TP group, ordered by TP index."""
        pp, dp, _ = self.coords(rank)
        return [self.rank_of(pp, dp, t) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        """Ranks of ``rank``'s DP group, ordered by DP index."""
        pp, _, tp = self.coords(rank)
        return [self.rank_of(pp, d, tp) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        """Ranks of ``rank``'s PP group, ordered by stage."""
        _, dp, tp = self.coords(rank)
        return [self.rank_of(p, dp, tp) for p in range(self.pp)]

    def all_tp_groups(self) -> list[list[int]]:
        """Every TP group, in (pp, dp) order; each rank appears in exactly one."""
        return [
            [self.rank_of(p, d, t) for t in range(self.tp)]
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def model_parallel_group(self, rank: int) -> list[int]:
        """Ranks holding one full copy together with ``rank`` (same DP index), unless ZeRO-3,
        where the DP group partitions the weights too, so the group is every rank."""
        if self.zero_stage == 3:
            return list(range(self.world_size))
        _, dp, _ = self.coords(rank)
        return [self.rank_of(p, dp, t) for p in range(self.pp) for t in range(self.tp)]

    def with_rank_order(self, rank_order: tuple[int, ...] | None) -> ParallelLayout:
        """Same degrees, another placement of slots on ranks."""
        return ParallelLayout(self.pp, self.dp, self.tp, self.zero_stage, rank_order)


def stage_layer_range(num_layers: int, pp: int, stage: int) -> range:
    """Contiguous decoder layers owned by pipeline ``stage`` of ``pp``.

    Layers are split as evenly as possible, earlier stages taking the remainder
    (DeepSpeed ``partition_method="uniform"``), e.g. 30 layers over 4 stages ->
    8, 8, 7, 7.

    Raises:
        ValueError: ``pp > num_layers`` or stage outside ``[0, pp)``.
    """
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers; "
            f"use pipeline_parallel_size <= {num_layers}"
        )
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside [0, {pp})")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
