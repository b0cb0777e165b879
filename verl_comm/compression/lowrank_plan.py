"""How a bucket is split for int8 low-rank compression, from tensor shapes only.

Pure (no tensors, no process group): which tensors of a bucket are compressed at low rank
(grouped by matrix shape), which go through the int8 all-reduce, and the bytes and collective
calls one step costs under a :class:`FactorWire`. The algorithm itself is in
:mod:`verl_comm.compression.lowrank`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .int8_allreduce import int8_allreduce_wire_bytes


@dataclass(frozen=True)
class TensorSlot:
    """One tensor inside a flat bucket: elements ``[offset, offset + numel)``, its shape."""

    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class MatrixGroup:
    """Same-shape matrices (n, m) of a bucket compressed together at rank ``rank``."""

    n: int
    m: int
    rank: int
    slots: tuple[TensorSlot, ...]

    @property
    def k(self) -> int:
        """Number of matrices in the group."""
        return len(self.slots)


@dataclass(frozen=True)
class LowRankPlan:
    """How one bucket is split: matrix groups compressed at low rank, the rest sent by int8.

    Built by :func:`plan_lowrank` from shapes only (pure, no process group).
    """

    numel: int
    groups: tuple[MatrixGroup, ...]
    rest: tuple[TensorSlot, ...]

    @property
    def rest_numel(self) -> int:
        """Elements sent uncompressed by low rank (through the int8 all-reduce)."""
        return sum(s.numel for s in self.rest)

    @property
    def p_numel(self) -> int:
        """Elements of all P factors (sum of k n r)."""
        return sum(g.k * g.n * g.rank for g in self.groups)

    @property
    def q_numel(self) -> int:
        """Elements of all Q factors (sum of k m r)."""
        return sum(g.k * g.m * g.rank for g in self.groups)

    def wire_bytes(self, world_size: int, block: int, wire: FactorWire | None = None) -> int:
        """Bytes one rank sends per step for P, Q and the rest under ``wire`` (default: all
        three through the int8 all-reduce)."""
        wire = wire or FactorWire()
        return sum(
            payload_wire_bytes(n, world_size, block, mode)
            for n, mode in (
                (self.p_numel, wire.p),
                (self.q_numel, wire.q),
                (self.rest_numel, wire.rest),
            )
        )

    def collectives(self, wire: FactorWire | None = None) -> int:
        """Collective calls per step under ``wire`` (int8: 2 per payload, else 1)."""
        wire = wire or FactorWire()
        return sum(
            (2 if mode == "int8" else 1)
            for n, mode in (
                (self.p_numel, wire.p),
                (self.q_numel, wire.q),
                (self.rest_numel, wire.rest),
            )
            if n
        )


WIRE_MODES = ("int8", "bf16", "fp32", "exact")
"""How one payload (P, Q or the rest) travels: ``int8`` = the two-step int8 all-reduce (two
collectives), ``bf16`` / ``fp32`` = one all-reduce in that dtype, ``exact`` = one all-reduce
in the payload's own compute dtype (float64 in the reference)."""


@dataclass(frozen=True)
class FactorWire:
    """Wire mode of each payload of a low-rank bucket (see :data:`WIRE_MODES`)."""

    p: str = "int8"
    q: str = "int8"
    rest: str = "int8"

    def __post_init__(self) -> None:
        for name in ("p", "q", "rest"):
            if getattr(self, name) not in WIRE_MODES:
                raise ValueError(f"FactorWire.{name} must be one of {WIRE_MODES}")


def payload_wire_bytes(numel: int, world_size: int, block: int, mode: str) -> int:
    """Bytes one rank sends for ``numel`` elements in wire ``mode`` (0 when W = 1)."""
    if numel == 0 or world_size == 1:
        return 0
    if mode == "int8":
        return int8_allreduce_wire_bytes(numel, world_size, block)
    size = {"bf16": 2, "fp32": 4, "exact": 4}[mode]
    return 2 * (world_size - 1) * numel * size // world_size


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The (n, m) matrix view of a tensor shape (``(s0, prod(rest))``), None below 2 dims."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def plan_lowrank(
    shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float = 2.0
) -> LowRankPlan:
    """Split a bucket of tensors (in bucket order, packed back to back) for low rank.

    Args:
        shapes: the shape of each tensor of the bucket, in buffer order.
        rank: target rank r >= 1.
        min_compression_rate: compress a matrix only if ``n m / (r (n + m))`` is at least this.

    Returns:
        :class:`LowRankPlan`; matrices of equal (n, m) form one group, in first-seen order.

    Raises:
        ValueError: ``rank < 1``.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1 for low rank, got {rank}")
    offset = 0
    by_shape: dict[tuple[int, int], list[TensorSlot]] = {}
    rest: list[TensorSlot] = []
    for shape in shapes:
        shape = tuple(int(s) for s in shape)
        numel = int(math.prod(shape))
        slot = TensorSlot(offset, numel, shape)
        offset += numel
        nm = matrix_shape(shape)
        if nm is not None:
            n, m = nm
            if 2 * rank < min(n, m) and n * m >= min_compression_rate * rank * (n + m):
                by_shape.setdefault(nm, []).append(slot)
                continue
        rest.append(slot)
    groups = tuple(MatrixGroup(n, m, rank, tuple(s)) for (n, m), s in by_shape.items())
    return LowRankPlan(offset, groups, tuple(rest))
