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
from verl_ppo.reshard.executor import ReshardStats, _sync, _view, copy_many, flat_storage
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
        members = sorted(self.members)
        g = len(members)
        srcs, dtype, device = {}, None, None
        for p, spec in enumerate(plan.specs):
            sh = plan.train_shards[r][p]
            if sh is None:
                continue
            if spec.name not in train_shards:
                raise KeyError(f"training shard {spec.name!r} missing on rank {r}")
            t = train_shards[spec.name]
            dtype, device = dtype or t.dtype, device or t.device
            srcs[p] = flat_storage(t, spec.name, sh.numel, dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        _sync(device)
        t0 = time.perf_counter()
        buckets, cur, cur_b = [], [], 0
        for p, spec in enumerate(plan.specs):
            b = spec.numel * itemsize
            if cur and cur_b + b > self.bucket_bytes:
                buckets.append(cur)
                cur, cur_b = [], 0
            cur.append(p)
            cur_b += b
        if cur:
            buckets.append(cur)
        result, received, sent, peak = {}, 0, 0, 0
        for k, ps in enumerate(buckets):
            if g == 1:  # this rank holds full weights already: nothing to gather
                fulls = {p: srcs[p].view(plan.specs[p].shape) for p in ps}
                self._slice(ps, fulls, result, dtype, device)
                continue
            sizes = [
                sum(box_numel(c) for p in ps for c, _, _ in self.contrib[p][m]) for m in members
            ]
            chunk = max(sizes)
            send = torch.empty(chunk, dtype=dtype, device=device)
            o, dsts, views = 0, [], []
            for p in ps:
                for cell, off, strides in self.contrib[p][r]:
                    k_ = box_numel(cell)
                    dsts.append(send[o : o + k_].view(box_shape(cell)))
                    views.append(_view(srcs[p], cell, off, strides))
                    o += k_
            copy_many(dsts, views)
            t_issue = time.perf_counter()
            mine = sizes[members.index(r)]
            if len(set(sizes)) == 1:  # equal contributions (ZeRO-3): one all-gather
                gathered = torch.empty(chunk * g, dtype=dtype, device=device)
                dist.all_gather_into_tensor(gathered, send, group=self.pg)
                offs = [i * chunk for i in range(g)]
                op = "all_gather"
            else:  # uneven (PP stages): one broadcast per contributing member, exact sizes
                gathered = torch.empty(sum(sizes), dtype=dtype, device=device)
                offs = [sum(sizes[:i]) for i in range(g)]
                for i, m in enumerate(members):
                    seg = gathered[offs[i] : offs[i] + sizes[i]]
                    if m == r:
                        seg.copy_(send[: sizes[i]])
                    if sizes[i]:
                        dist.broadcast(seg, src=self._global(m), group=self.pg)
                op = "broadcast"
            received += (sum(sizes) - mine) * itemsize
            sent += mine * itemsize
            if self.recorder is not None:
                self.recorder.record(
                    CommRecord(
                        op,
                        mine * itemsize,
                        g,
                        time.perf_counter() - t_issue,
                        f"reshard_naive/bucket{k}",
                        t_issue,
                    )
                )
            fulls = {p: torch.empty(plan.specs[p].shape, dtype=dtype, device=device) for p in ps}
            dsts, views = [], []
            for i, m in enumerate(members):
                o = offs[i]
                for p in ps:
                    for cell, _, _ in self.contrib[p][m]:
                        k_ = box_numel(cell)
                        dsts.append(fulls[p][tuple(slice(a, b) for a, b in cell)])
                        views.append(gathered[o : o + k_].view(box_shape(cell)))
                        o += k_
            copy_many(dsts, views)
            bucket_bytes = (send.numel() + gathered.numel()) * itemsize
            bucket_bytes += sum(f.numel() for f in fulls.values()) * itemsize
            peak = max(peak, bucket_bytes)
            self._slice(ps, fulls, result, dtype, device)
            del fulls, gathered, send, dsts, views
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
