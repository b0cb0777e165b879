"""Naive baseline: all-gather every parameter in full, then slice the rollout shard.

What DeepSpeed-Chat's hybrid engine and verl's FSDP path do: the ranks that together
hold one copy of the weights (the training model-parallel group: same DP index; every
rank under ZeRO-3) all-gather each parameter in full, and every rank slices its rollout
shard out of it. Received bytes per rank: ``(g - 1) / g x M`` for a group of ``g``
ranks (HybridFlow, Table 2). Parameters go bucket by bucket (full-size bytes up to
``bucket_bytes``, at least one parameter), so the peak is the largest bucket of full
parameters plus the gather buffer, not the whole model.

Within a group, each cell of a parameter is contributed by its lowest-ranked holder;
equal contributions (ZeRO-3 partitions) go through one ``all_gather_into_tensor``,
unequal ones (pipeline stages) through one ``broadcast`` per contributing member, so no
padding is sent and the received bytes are exactly the other members' parts.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.telemetry import CommRecord, CommRecorder
from verl_ppo.reshard.executor import ReshardStats, _sync, _view, copy_many, training_sources
from verl_ppo.reshard.planner import ReshardPlan, _cells, _cuts, _find
from verl_ppo.reshard.specs import box_numel, box_shape


def gather_groups(plan: ReshardPlan) -> list[list[int]]:
    """The distinct model-parallel groups of the training layout (pure)."""
    seen, out = set(), []
    for r in range(plan.world_size):
        g = tuple(plan.train.model_parallel_group(r))
        if g not in seen:
            seen.add(g)
            out.append(sorted(g))
    return out


def contributions(plan: ReshardPlan, members: list[int]):
    """Per parameter, per member: the cells it contributes (lowest-ranked holder wins).

    Returns:
        ``list[param] -> dict[member -> list[(cell box, src offset, src strides)]]``.

    Raises:
        RuntimeError: some element of a parameter is held by no member.
    """
    out = []
    held = plan.train_shards
    for p, spec in enumerate(plan.specs):
        sub = [held[m] for m in members]
        cuts = _cuts(sub, p, len(spec.shape))
        per: dict[int, list] = {m: [] for m in members}
        full = tuple((0, s) for s in spec.shape)
        for cell in _cells(full, cuts):
            for m in members:
                pc = _find(held[m][p], cell)
                if pc is not None:
                    off = pc.offset + sum(
                        (c0 - g0) * s for (c0, _), (g0, _), s in zip(cell, pc.gbox, pc.strides)
                    )
                    per[m].append((cell, off, pc.strides))
                    break
            else:
                raise RuntimeError(f"no member of {members} holds {cell} of {spec.name}")
        out.append(per)
    return out


class NaiveAllGather:
    """All-gather-then-slice for ``rank``; builds its gather groups collectively.

    Args:
        plan: the same plan the engine uses (only its shards are read).
        rank: this rank's index in ``group``.
        group: process group the layouts index (None = WORLD); every rank must construct
            this object (``dist.new_group`` is collective).
        bucket_bytes: full-parameter bytes gathered per step.
        recorder: optional :class:`CommRecorder`, one record per bucket.
        ctx: the job's :class:`verl_comm.distributed.DistContext` (``new_group`` with the
            job's timeout); needed when a gather group is a strict sub-group.

    Raises:
        ValueError: a sub-group is needed and ``ctx`` is None.
    """

    def __init__(
        self,
        plan: ReshardPlan,
        rank: int,
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = 64 << 20,
        recorder: CommRecorder | None = None,
        ctx: Any = None,
    ) -> None:
        self.plan, self.rank, self.group = plan, rank, group
        self.bucket_bytes, self.recorder = int(bucket_bytes), recorder
        self.members = plan.train.model_parallel_group(rank)
        self.pg = None
        groups = gather_groups(plan)
        n = plan.world_size
        for g in groups:
            if len(g) == n:
                pg = group
            elif len(g) == 1:
                pg = None
            else:
                if ctx is None:
                    raise ValueError(
                        f"the naive all-gather of {plan.train.describe()} needs sub-groups "
                        f"{groups}: pass ctx (the DistContext) so they get the job's timeout"
                    )
                glob = g if group is None else [dist.get_global_rank(group, x) for x in g]
                pg = ctx.new_group(glob)
            if sorted(self.members) == g:
                self.pg = pg
        self.contrib = contributions(plan, sorted(self.members))

    def _slice(self, ps, fulls, result, dtype, device) -> None:
        plan, r = self.plan, self.rank
        dsts, views = [], []
        for p in ps:
            sh = plan.rollout_shards[r][p]
            out = torch.empty(sh.numel, dtype=dtype, device=device)
            for pc in sh.pieces:
                dsts.append(_view(out, pc.gbox, pc.offset, pc.strides))
                views.append(fulls[p][tuple(slice(a, b) for a, b in pc.gbox)])
            result[plan.specs[p].name] = out.view(sh.local_shape)
        copy_many(dsts, views)

    def _global(self, m: int) -> int:
        return m if self.group is None else dist.get_global_rank(self.group, m)

    def run(
        self, train_shards: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], ReshardStats]:
        """Same contract as :meth:`ReshardExecutor.run`."""
        plan, r = self.plan, self.rank
        srcs, dtype, device = training_sources(plan, r, train_shards)
        itemsize = torch.empty((), dtype=dtype).element_size()
        _sync(device)
        t0 = time.perf_counter()
        buckets = self._buckets(itemsize)
        result, received, sent, peak = {}, 0, 0, 0
        for k, ps in enumerate(buckets):
            if len(self.members) == 1:  # this rank holds full weights already: nothing to gather
                fulls = {p: srcs[p].view(plan.specs[p].shape) for p in ps}
                self._slice(ps, fulls, result, dtype, device)
                continue
            fulls, b_sent, b_received, b_bytes = self._gather(k, ps, srcs, itemsize)
            received += b_received
            sent += b_sent
            peak = max(peak, b_bytes)
            self._slice(ps, fulls, result, dtype, device)
            del fulls
        _sync(device)
        roll_bytes = plan.rollout_elems[r] * itemsize
        stats = ReshardStats(
            time_s=time.perf_counter() - t0,
            bytes_sent=sent,
            bytes_received=received,
            lower_bound_bytes=plan.lower_bound_elems[r] * itemsize,
            rollout_bytes=roll_bytes,
            peak_extra_bytes=peak + roll_bytes,
            buckets=len(buckets),
        )
        return result, stats

    def _buckets(self, itemsize: int) -> list[list[int]]:
        """Parameter indices in buckets of full-size bytes up to ``bucket_bytes`` (at least
        one parameter each), in parameter order."""
        buckets, cur, cur_b = [], [], 0
        for p, spec in enumerate(self.plan.specs):
            b = spec.numel * itemsize
            if cur and cur_b + b > self.bucket_bytes:
                buckets.append(cur)
                cur, cur_b = [], 0
            cur.append(p)
            cur_b += b
        if cur:
            buckets.append(cur)
        return buckets

    def _gather(
        self, k: int, ps: list[int], srcs: dict[int, torch.Tensor], itemsize: int
    ) -> tuple[dict[int, torch.Tensor], int, int, int]:
        """Bucket ``k`` (parameters ``ps``) gathered in full over the group.

        Returns:
            (full parameters by index, bytes sent, bytes received, transient bytes).
        """
        r = self.rank
        members = sorted(self.members)
        sizes = [sum(box_numel(c) for p in ps for c, _, _ in self.contrib[p][m]) for m in members]
        send = self._pack(ps, srcs, max(sizes))
        t_issue = time.perf_counter()
        mine = sizes[members.index(r)]
        gathered, offs, op = self._exchange(send, sizes)
        if self.recorder is not None:
            self.recorder.record(
                CommRecord(
                    op,
                    mine * itemsize,
                    len(members),
                    time.perf_counter() - t_issue,
                    f"reshard_naive/bucket{k}",
                    t_issue,
                )
            )
        fulls = self._unpack(ps, gathered, offs)
        bucket_bytes = (send.numel() + gathered.numel()) * itemsize
        bucket_bytes += sum(f.numel() for f in fulls.values()) * itemsize
        return fulls, mine * itemsize, (sum(sizes) - mine) * itemsize, bucket_bytes

    def _pack(self, ps: list[int], srcs: dict[int, torch.Tensor], chunk: int) -> torch.Tensor:
        """This rank's contribution to the bucket, ``chunk`` elements (the tail unused when
        it contributes less)."""
        src0 = srcs[next(iter(srcs))]
        send = torch.empty(chunk, dtype=src0.dtype, device=src0.device)
        o, dsts, views = 0, [], []
        for p in ps:
            for cell, off, strides in self.contrib[p][self.rank]:
                k_ = box_numel(cell)
                dsts.append(send[o : o + k_].view(box_shape(cell)))
                views.append(_view(srcs[p], cell, off, strides))
                o += k_
        copy_many(dsts, views)
        return send

    def _exchange(
        self, send: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, list[int], str]:
        """Every member's contribution: one all-gather when all are equal (ZeRO-3), else one
        broadcast per contributing member with exact sizes (PP stages). Returns the gathered
        buffer, each member's offset in it and the collective's name."""
        members, g, chunk = sorted(self.members), len(self.members), max(sizes)
        if len(set(sizes)) == 1:  # equal contributions (ZeRO-3): one all-gather
            gathered = torch.empty(chunk * g, dtype=send.dtype, device=send.device)
            dist.all_gather_into_tensor(gathered, send, group=self.pg)
            return gathered, [i * chunk for i in range(g)], "all_gather"
        gathered = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
        offs = [sum(sizes[:i]) for i in range(g)]
        for i, m in enumerate(members):
            seg = gathered[offs[i] : offs[i] + sizes[i]]
            if m == self.rank:
                seg.copy_(send[: sizes[i]])
            if sizes[i]:
                dist.broadcast(seg, src=self._global(m), group=self.pg)
        return gathered, offs, "broadcast"

    def _unpack(
        self, ps: list[int], gathered: torch.Tensor, offs: list[int]
    ) -> dict[int, torch.Tensor]:
        """The full parameters ``ps`` assembled from the members' contributions."""
        specs = self.plan.specs
        fulls = {
            p: torch.empty(specs[p].shape, dtype=gathered.dtype, device=gathered.device) for p in ps
        }
        dsts, views = [], []
        for i, m in enumerate(sorted(self.members)):
            o = offs[i]
            for p in ps:
                for cell, _, _ in self.contrib[p][m]:
                    k_ = box_numel(cell)
                    dsts.append(fulls[p][tuple(slice(a, b) for a, b in cell)])
                    views.append(gathered[o : o + k_].view(box_shape(cell)))
                    o += k_
        copy_many(dsts, views)
        return fulls
