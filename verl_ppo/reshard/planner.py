"""Pure transfer planner: training shards -> rollout shards, no process group.

For every parameter the planner cuts the global tensor into cells along every box
boundary of every training and rollout holding, so each cell lies wholly inside or
outside each holding. A rank's rollout cells that it already holds in training become
local copies; every other cell is fetched once from one of its holders, the largest
cells first, each from the holder that has sent the fewest elements so far (ties: the
nearest rank after the receiver), which spreads the load across replicas. Bytes
received per rank therefore equal the lower bound: the part of the rollout shard the
rank does not already hold (HybridFlow, EuroSys'25, section 5 and Table 2).

The rollout placement (which rank plays which TP/DP slot) is free; :func:`choose_rollout_order`
picks the permutation minimising the largest per-rank lower bound (brute force up to 8
ranks, greedy beyond), which gives the paper's micro-DP grouping for TP4xDP2 -> TP2xDP4.
Plans are cached per layout pair (:func:`make_plan` is an ``lru_cache``).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from verl_ppo.reshard.layout import ParallelLayout
from verl_ppo.reshard.specs import (
    Box,
    ModelDims,
    ParamSpec,
    Piece,
    Shard,
    box_numel,
    box_shape,
    intersect,
    shard_for,
)


@dataclass(frozen=True)
class Transfer:
    """One box of one parameter from ``src``'s training storage to ``dst``'s rollout
    storage (``src == dst``: a local copy). Offsets/strides in elements."""

    param: int
    src: int
    dst: int
    gbox: Box
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements moved."""
        return box_numel(self.gbox)


@dataclass(frozen=True)
class ReshardPlan:
    """A static plan for one (training, rollout) layout pair.

    Attributes:
        train, rollout: the layouts (rollout with its chosen ``rank_order``).
        specs: parameter specs, indexed by ``Transfer.param``.
        train_shards, rollout_shards: ``[rank][param] -> Shard | None``.
        local: copies within a rank.
        transfers: cross-rank transfers (``src != dst``).
        recv_elems, send_elems: per rank, elements over the wire.
        lower_bound_elems: per rank, rollout elements not held in training.
        rollout_elems: per rank, size of the rollout shard (elements).
    """

    train: ParallelLayout
    rollout: ParallelLayout
    specs: tuple[ParamSpec, ...]
    train_shards: tuple[tuple[Shard | None, ...], ...]
    rollout_shards: tuple[tuple[Shard | None, ...], ...]
    local: tuple[Transfer, ...]
    transfers: tuple[Transfer, ...]
    recv_elems: tuple[int, ...]
    send_elems: tuple[int, ...]
    lower_bound_elems: tuple[int, ...]
    rollout_elems: tuple[int, ...]

    @property
    def world_size(self) -> int:
        """Ranks in the plan."""
        return self.train.world_size

    def held(self, rank: int, rollout: bool = False) -> list[tuple[int, ParamSpec, Shard]]:
        """``(param index, spec, shard)`` of each parameter ``rank`` holds in the training
        layout (or the rollout layout), in parameter order."""
        shards = (self.rollout_shards if rollout else self.train_shards)[rank]
        return [(p, s, sh) for p, (s, sh) in enumerate(zip(self.specs, shards)) if sh is not None]


def _holdings(specs, layout: ParallelLayout, dims: ModelDims):
    return tuple(
        tuple(shard_for(s, layout, r, dims) for s in specs) for r in range(layout.world_size)
    )


def _overlap(a: Shard | None, b: Shard | None) -> int:
    if a is None or b is None:
        return 0
    total = 0
    for pa in a.pieces:
        for pb in b.pieces:
            x = intersect(pa.gbox, pb.gbox)
            if x is not None:
                total += box_numel(x)
    return total


def _need(sh: Shard | None) -> int:
    return 0 if sh is None else sum(box_numel(p.gbox) for p in sh.pieces)


def choose_rollout_order(
    train: ParallelLayout, rollout: ParallelLayout, specs: tuple[ParamSpec, ...], dims: ModelDims
) -> ParallelLayout:
    """Return ``rollout`` with the rank placement that minimises the largest per-rank lower
    bound (then the sum), keeping the identity on ties.

    Exhaustive over permutations for up to 8 ranks (40,320 candidates on a precomputed
    overlap matrix); a greedy slot-by-slot assignment beyond.

    Raises:
        ValueError: world sizes differ.
    """
    n = train.world_size
    if rollout.world_size != n:
        raise ValueError(f"training world size {n} != rollout world size {rollout.world_size}")
    canon = rollout.with_rank_order(None)
    held = _holdings(specs, train, dims)
    want = _holdings(specs, canon, dims)  # indexed by slot (identity placement)
    need = [sum(_need(s) for s in want[slot]) for slot in range(n)]
    ov = [
        [sum(_overlap(a, b) for a, b in zip(held[r], want[slot])) for slot in range(n)]
        for r in range(n)
    ]
    cost = [[need[slot] - ov[r][slot] for slot in range(n)] for r in range(n)]

    def score(order):  # order[slot] = rank
        c = [cost[order[s]][s] for s in range(n)]
        return max(c), sum(c)

    best = tuple(range(n))
    best_score = score(best)
    if n <= 8:
        for perm in itertools.permutations(range(n)):
            sc = score(perm)
            if sc < best_score:
                best, best_score = perm, sc
    else:
        free, order = set(range(n)), []
        for slot in range(n):
            r = min(sorted(free), key=lambda r: cost[r][slot])
            order.append(r)
            free.remove(r)
        if score(tuple(order)) < best_score:
            best = tuple(order)
    return rollout.with_rank_order(best)


def _cuts(shards_by_rank, p: int, ndim: int) -> list[list[int]]:
    cuts = [set() for _ in range(ndim)]
    for shards in shards_by_rank:
        sh = shards[p]
        if sh is None:
            continue
        for pc in sh.pieces:
            for d, (a, b) in enumerate(pc.gbox):
                cuts[d].add(a)
                cuts[d].add(b)
    return [sorted(c) for c in cuts]


def _cells(box: Box, cuts: list[list[int]]):
    axes = []
    for (a, b), c in zip(box, cuts):
        i, j = bisect_left(c, a), bisect_right(c, b)
        pts = sorted({a, b, *c[i:j]})
        axes.append(list(zip(pts[:-1], pts[1:])))
    return itertools.product(*axes)


def _find(shard: Shard | None, cell: Box) -> Piece | None:
    if shard is None:
        return None
    for pc in shard.pieces:
        if all(a0 <= c0 and c1 <= a1 for (a0, a1), (c0, c1) in zip(pc.gbox, cell)):
            return pc
    return None


def _at(pc: Piece, cell: Box) -> int:
    return pc.offset + sum((c0 - g0) * s for (c0, _), (g0, _), s in zip(cell, pc.gbox, pc.strides))


@lru_cache(maxsize=32)
def make_plan(
    train: ParallelLayout, rollout: ParallelLayout, specs: tuple[ParamSpec, ...], dims: ModelDims
) -> ReshardPlan:
    """Plan every copy and transfer from ``train`` to ``rollout`` (placement as given).

    Returns:
        a :class:`ReshardPlan`; ``recv_elems == lower_bound_elems`` holds by construction
        and is asserted.

    Raises:
        ValueError: world sizes differ.
    """
    n = train.world_size
    if rollout.world_size != n:
        raise ValueError(f"training world size {n} != rollout world size {rollout.world_size}")
    held = _holdings(specs, train, dims)
    want = _holdings(specs, rollout, dims)
    local: list[Transfer] = []
    remote: list[tuple[int, int, int, Box, Piece, list[tuple[int, Piece]]]] = []
    lower = [0] * n
    for p, spec in enumerate(specs):
        cuts = _cuts(held + want, p, len(spec.shape))
        for dst in range(n):
            dsh = want[dst][p]
            if dsh is None:
                continue
            for dpc in dsh.pieces:
                for cell in _cells(dpc.gbox, cuts):
                    own = _find(held[dst][p], cell)
                    if own is not None:
                        local.append(
                            Transfer(
                                p,
                                dst,
                                dst,
                                cell,
                                _at(own, cell),
                                own.strides,
                                _at(dpc, cell),
                                dpc.strides,
                            )
                        )
                        continue
                    holders = [
                        (s, pc) for s in range(n) if (pc := _find(held[s][p], cell)) is not None
                    ]
                    if not holders:
                        raise RuntimeError(f"no training rank holds {cell} of {spec.name}")
                    remote.append((p, dst, box_numel(cell), cell, dpc, holders))
    for r in range(n):
        lower[r] = sum(_need(w) - _overlap(h, w) for h, w in zip(held[r], want[r]))
    send, recv = [0] * n, [0] * n
    order = sorted(range(len(remote)), key=lambda i: (-remote[i][2], i))
    chosen: dict[int, Transfer] = {}
    for i in order:
        p, dst, size, cell, dpc, holders = remote[i]
        s, spc = min(holders, key=lambda h: (send[h[0]], (h[0] - dst) % n))
        send[s] += size
        recv[dst] += size
        chosen[i] = Transfer(
            p, s, dst, cell, _at(spc, cell), spc.strides, _at(dpc, cell), dpc.strides
        )
    transfers = [chosen[i] for i in range(len(remote))]
    assert recv == lower, "planner invariant: received elements == lower bound"
    roll_elems = tuple(sum(_need(s) for s in want[r]) for r in range(n))
    return ReshardPlan(
        train,
        rollout,
        specs,
        held,
        want,
        tuple(local),
        tuple(transfers),
        tuple(recv),
        tuple(send),
        tuple(lower),
        roll_elems,
    )


def split_transfer(t: Transfer, max_elems: int) -> list[Transfer]:
    """Split ``t`` into transfers of at most ``max_elems`` elements along its outermost
    dims (sub-boxes keep their strides, offsets shift).

    Raises:
        ValueError: ``max_elems < 1``.
    """
    if max_elems < 1:
        raise ValueError(f"max_elems must be >= 1, got {max_elems}")
    if t.numel <= max_elems:
        return [t]
    shape = box_shape(t.gbox)
    d = next(i for i, s in enumerate(shape) if s > 1)
    inner = math.prod(shape[d + 1 :])
    rows = max(1, max_elems // inner)
    out = []
    for r0 in range(0, shape[d], rows):
        r1 = min(r0 + rows, shape[d])
        g = list(t.gbox)
        g[d] = (t.gbox[d][0] + r0, t.gbox[d][0] + r1)
        sub = Transfer(
            t.param,
            t.src,
            t.dst,
            tuple(g),
            t.src_offset + r0 * t.src_strides[d],
            t.src_strides,
            t.dst_offset + r0 * t.dst_strides[d],
            t.dst_strides,
        )
        out += split_transfer(sub, max_elems)
    return out


@lru_cache(maxsize=32)
def make_buckets(plan: ReshardPlan, bucket_elems: int) -> tuple[tuple[Transfer, ...], ...]:
    """Group the plan's cross-rank transfers into buckets, the same on every rank.

    In each bucket every rank sends plus receives at most ``bucket_elems`` elements, so one
    send+receive buffer of ``bucket_elems`` per in-flight bucket suffices. Transfers larger
    than that are split (:func:`split_transfer`). Order: parameter order within each
    (src, dst) pair, pairs interleaved by bytes scheduled so far, so each bucket loads every
    link in both directions.

    Raises:
        ValueError: ``bucket_elems < 1``.
    """
    if bucket_elems < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_elems}")
    n = plan.world_size
    queues: dict[tuple[int, int], deque] = {}
    for t in sorted(plan.transfers, key=lambda t: (t.param, t.dst, t.gbox)):
        queues.setdefault((t.src, t.dst), deque()).extend(split_transfer(t, bucket_elems))
    # interleave (src, dst) pairs, least-scheduled first, so every bucket carries traffic in
    # both directions of each link (full duplex) instead of one stage's layers at a time
    pieces, scheduled = [], dict.fromkeys(queues, 0)
    while queues:
        pair = min(queues, key=lambda k: (scheduled[k], k))
        t = queues[pair].popleft()
        pieces.append(t)
        scheduled[pair] += t.numel
        if not queues[pair]:
            del queues[pair]
    buckets, cur, load = [], [], [0] * n
    for t in pieces:
        k = t.numel
        if cur and (load[t.src] + k > bucket_elems or load[t.dst] + k > bucket_elems):
            buckets.append(tuple(cur))
            cur, load = [], [0] * n
        cur.append(t)
        load[t.src] += k
        load[t.dst] += k
    if cur:
        buckets.append(tuple(cur))
    return tuple(buckets)
