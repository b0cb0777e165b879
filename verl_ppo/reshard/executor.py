"""Executor: runs a :class:`~verl_ppo.reshard.planner.ReshardPlan` on one rank.

Buckets (the same on every rank, :func:`~verl_ppo.reshard.planner.make_buckets`) go over
the wire with ``all_to_all_single`` (uneven splits) or batched ``isend/irecv``. Two
buffers alternate (double buffering): bucket ``k + 1`` is packed while bucket ``k`` is
in flight, and bucket ``k`` is unpacked while ``k + 1`` is in flight. Each buffer holds
one bucket's sends and receives, at most ``bucket_bytes``, so the extra memory is at
most two buckets plus the rollout shard itself. Local copies go first and never touch
the wire. ``bytes_sent``/``bytes_received`` are the plan's transfer sizes; the
``counted_*`` fields are what a :class:`~verl_ppo.reshard.wire.WireCounter` saw handed to
the backend, per peer, so a test or benchmark can compare the two (and, across ranks,
each send with its receive: :func:`~verl_ppo.reshard.wire.pairwise_mismatches`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_comm.telemetry import CommRecord, CommRecorder
from verl_ppo.reshard.planner import ReshardPlan, Transfer, make_buckets
from verl_ppo.reshard.specs import box_shape
from verl_ppo.reshard.wire import WireCounter

TRANSPORTS = ("all_to_all", "p2p")


@dataclass
class ReshardStats:
    """What one reshard did on this rank.

    Attributes:
        time_s: wall time (seconds), including local copies, after a device sync.
        bytes_sent, bytes_received: payload bytes over the wire (this rank), summed from
            the plan's transfers of this rank's buckets.
        lower_bound_bytes: rollout bytes this rank did not hold in training.
        rollout_bytes: size of this rank's rollout shard (bytes).
        peak_extra_bytes: transient buffers (both bucket buffers) plus the rollout shard
            (less what is aliased to training storage).
        buckets: number of buckets run.
        pack_s: seconds spent copying training slices into the send buffers, summed over
            buckets (the copies run one after another, so the sum is at most ``time_s``).
        wire_s: seconds during which at least one bucket was on the wire, from its issue to
            the observed end of its wait (the union of the buckets' in-flight intervals:
            at most ``time_s`` although consecutive buckets overlap).
        unpack_s: seconds spent copying received data into the rollout shards, summed.
        local_s: seconds of the local (rank-to-itself) copies.
        counted_sent, counted_received: bytes this rank handed to the backend to send to /
            receive from other ranks, counted at the calls (:class:`WireCounter`).
        counted_sent_per_peer, counted_received_per_peer: the same per peer (group index).
        None where a method does not measure them. On CUDA all four times come from CUDA
        events on the current stream, read after the final synchronisation.
    """

    time_s: float
    bytes_sent: int
    bytes_received: int
    lower_bound_bytes: int
    rollout_bytes: int
    peak_extra_bytes: int
    buckets: int
    pack_s: float | None = None
    wire_s: float | None = None
    unpack_s: float | None = None
    local_s: float | None = None
    counted_sent: int | None = None
    counted_received: int | None = None
    counted_sent_per_peer: list[int] | None = None
    counted_received_per_peer: list[int] | None = None


class _Clock:
    """Time stamps on the host (CPU) or as CUDA events on the current stream (CUDA), turned
    into seconds since the first stamp once the device is synchronised."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t0 = self.stamp()

    def stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, stamp) -> float:
        """Seconds from the first stamp to ``stamp`` (after a device sync on CUDA)."""
        if self.cuda:
            return self.t0.elapsed_time(stamp) / 1e3
        return stamp - self.t0


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[start, end]`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def flat_storage(t: torch.Tensor, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """1-D view of a training shard, checked against the plan.

    Raises:
        ValueError: wrong element count, dtype, or a non-contiguous tensor.
    """
    if t.numel() != numel:
        raise ValueError(
            f"training shard {name!r} has {t.numel()} elements, the plan expects {numel} "
            f"(shape {tuple(t.shape)}); was it built for another layout?"
        )
    if t.dtype != dtype:
        raise ValueError(
            f"training shard {name!r} has dtype {t.dtype}, expected {dtype} like the others"
        )
    if not t.is_contiguous():
        raise ValueError(f"training shard {name!r} is not contiguous; pass tensor.contiguous()")
    return t.reshape(-1)


def training_sources(
    plan: ReshardPlan, rank: int, train_shards: dict[str, torch.Tensor]
) -> tuple[dict[int, torch.Tensor], torch.dtype, torch.device]:
    """This rank's training shards as 1-D storage by parameter index, checked against the
    plan, with their common dtype and device.

    Raises:
        KeyError: a shard the plan places on ``rank`` is missing.
        ValueError: ``rank`` holds no shard, or see :func:`flat_storage`.
    """
    srcs: dict[int, torch.Tensor] = {}
    dtype = device = None
    for p, spec, sh in plan.held(rank):
        if spec.name not in train_shards:
            raise KeyError(
                f"training shard {spec.name!r} missing on rank {rank} "
                f"({plan.train.describe()} rank {rank} holds it)"
            )
        t = train_shards[spec.name]
        dtype, device = dtype or t.dtype, device or t.device
        srcs[p] = flat_storage(t, spec.name, sh.numel, dtype)
    if dtype is None:
        raise ValueError(f"rank {rank} holds no training shard; nothing to reshard from")
    return srcs, dtype, device


def _view(flat: torch.Tensor, gbox, offset: int, strides) -> torch.Tensor:
    return flat.as_strided(box_shape(gbox), strides, flat.storage_offset() + offset)


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair; contiguous pairs go through one ``torch._foreach_copy_``
    (a fused multi-tensor launch on CUDA), strided ones one by one."""
    fast_d, fast_s = [], []
    for d, s in zip(dsts, srcs):
        if d.is_contiguous() and s.is_contiguous():
            fast_d.append(d)
            fast_s.append(s)
        else:
            d.copy_(s)
    if fast_d:
        torch._foreach_copy_(fast_d, fast_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ReshardExecutor:
    """Runs ``plan`` for ``rank`` of ``group`` (None = WORLD).

    Args:
        plan: a static plan; every rank must hold the same one.
        rank: this rank's index in ``group``.
        group: process group the layouts' ranks index; None = WORLD.
        bucket_bytes: cap on one bucket's sends + receives per rank (bytes).
        transport: ``"all_to_all"`` (``all_to_all_single``) or ``"p2p"``
            (``batch_isend_irecv``).
        recorder: optional :class:`CommRecorder`; one record per bucket.
        alias: where a rank's rollout shard of a parameter is exactly its training storage
            (TP 1 rollout from full weights, replicated norms), return the training tensor
            itself instead of a copy (read-only use, no extra memory).

    Raises:
        ValueError: unknown transport or a bucket smaller than one element.
    """

    def __init__(
        self,
        plan: ReshardPlan,
        rank: int,
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = 64 << 20,
        transport: str = "all_to_all",
        recorder: CommRecorder | None = None,
        alias: bool = False,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.plan, self.rank, self.group = plan, rank, group
        self.bucket_bytes, self.transport, self.recorder = int(bucket_bytes), transport, recorder
        local = [t for t in plan.local if t.dst == rank]
        self.aliased: set[int] = set()
        if alias:
            count: dict[int, list[Transfer]] = {}
            for t in local:
                count.setdefault(t.param, []).append(t)
            for p, ts in count.items():
                t, tsh, rsh = ts[0], plan.train_shards[rank][p], plan.rollout_shards[rank][p]
                if (
                    len(ts) == 1
                    and t.src_offset == t.dst_offset == 0
                    and t.src_strides == t.dst_strides
                    and t.numel == tsh.numel == rsh.numel
                ):
                    self.aliased.add(p)
        self.local = [t for t in local if t.param not in self.aliased]
        self._schedule: dict[int, tuple[list, int]] = {}
        self.wire = WireCounter(plan.world_size, rank, group)

    def schedule(self, itemsize: int) -> tuple[list[tuple[list[Transfer], list[Transfer]]], int]:
        """This rank's ``(sends, receives)`` per bucket and the buffer size (elements) for
        ``itemsize``-byte elements; computed once per element size."""
        if itemsize not in self._schedule:
            mine = []
            for b in make_buckets(self.plan, max(1, self.bucket_bytes // itemsize)):
                sends = sorted((t for t in b if t.src == self.rank), key=lambda t: t.dst)  # stable
                recvs = sorted((t for t in b if t.dst == self.rank), key=lambda t: t.src)
                mine.append((sends, recvs))
            slot = max(
                (sum(t.numel for t in s) + sum(t.numel for t in v) for s, v in mine), default=0
            )
            self._schedule[itemsize] = (mine, slot)
        return self._schedule[itemsize]

    def run(
        self, train_shards: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], ReshardStats]:
        """Reshard this rank's training shards into its rollout shards.

        Args:
            train_shards: parameter name -> what this rank holds in the training layout
                (local TP/PP slice of shape ``Shard.local_shape``, or a 1-D ZeRO-3
                partition of ``Shard.numel`` elements); one dtype and device for all.

        Returns:
            (rollout shards: name -> tensor of the rollout ``local_shape``, stats).

        Raises:
            KeyError: a shard the plan needs is missing.
            ValueError: see :func:`flat_storage`.
        """
        plan, r = self.plan, self.rank
        srcs, dtype, device = training_sources(plan, r, train_shards)
        itemsize = torch.empty((), dtype=dtype).element_size()
        _sync(device)
        self.wire.reset()
        t0 = time.perf_counter()
        self._clock = _Clock(device)
        self._t_start = time.perf_counter()
        self._marks: dict[str, list] = {
            "pack": [],
            "unpack": [],
            "local": [],
            "wire": [],
            "wire_info": [],
        }
        outs: dict[int, torch.Tensor] = {}
        for p, _spec in enumerate(plan.specs):
            sh = plan.rollout_shards[r][p]
            if p in self.aliased:
                outs[p] = srcs[p]
            elif sh is not None:
                outs[p] = torch.empty(sh.numel, dtype=dtype, device=device)
        mine, slot_elems = self.schedule(itemsize)
        slots = [
            torch.empty(slot_elems, dtype=dtype, device=device)
            for _ in range(2 if len(mine) > 1 else len(mine))
        ]
        sent, received = self._pipeline(mine, slots, srcs, outs, itemsize)
        _sync(device)
        elapsed = time.perf_counter() - t0
        timing = self._timings(elapsed)
        result = {}
        for p, flat in outs.items():
            result[plan.specs[p].name] = flat.view(plan.rollout_shards[r][p].local_shape)
        roll_bytes = plan.rollout_elems[r] * itemsize
        fresh = roll_bytes - sum(outs[p].numel() for p in self.aliased) * itemsize
        stats = ReshardStats(
            time_s=elapsed,
            bytes_sent=sent,
            bytes_received=received,
            lower_bound_bytes=plan.lower_bound_elems[r] * itemsize,
            rollout_bytes=roll_bytes,
            peak_extra_bytes=len(slots) * slot_elems * itemsize + fresh,
            buckets=len(mine),
            **timing,
            counted_sent=self.wire.wire_sent(),
            counted_received=self.wire.wire_received(),
            counted_sent_per_peer=list(self.wire.sent),
            counted_received_per_peer=list(self.wire.received),
        )
        return result, stats

    def _pipeline(
        self,
        mine: list[tuple[list[Transfer], list[Transfer]]],
        slots: list[torch.Tensor],
        srcs: dict[int, torch.Tensor],
        outs: dict[int, torch.Tensor],
        itemsize: int,
    ) -> tuple[int, int]:
        """The buckets through the two buffers: pack bucket ``k`` and put it on the wire,
        then unpack bucket ``k - 1``; the local copies overlap the first bucket. Returns the
        bytes sent and received."""
        clock, n = self._clock, self.plan.world_size
        sent = received = 0
        pending = None
        for k, (sends, recvs) in enumerate(mine):
            buf = slots[k % 2]
            a = clock.stamp()
            ssz, rsz = self._pack(sends, recvs, srcs, buf, n)
            self._marks["pack"].append((a, clock.stamp()))
            send_n, recv_n = sum(ssz), sum(rsz)
            t_issue = clock.stamp()
            work = self._launch(buf[:send_n], buf[send_n : send_n + recv_n], ssz, rsz)
            sent += send_n * itemsize
            received += recv_n * itemsize
            if k == 0:  # local copies overlap the first bucket on the wire
                self._local_copies(srcs, outs)
            if pending is not None:
                self._finish(*pending, outs, itemsize, n)
            pending = (work, recvs, buf[send_n : send_n + recv_n], send_n, k, t_issue)
        if pending is not None:
            self._finish(*pending, outs, itemsize, n)
        else:
            self._local_copies(srcs, outs)
        return sent, received

    def _timings(self, elapsed: float) -> dict[str, float]:
        """Pack/wire/unpack/local seconds from this run's stamps (device synchronised);
        records one CommRecord per bucket whose ``duration_s`` is the bucket's share of the
        wire time (its in-flight interval less the part already covered by the previous
        bucket), so the records sum to ``wire_s``, never more than the wall time."""
        clock, marks = self._clock, self._marks

        def spans(name: str) -> list[tuple[float, float]]:
            return [(clock.seconds(a), clock.seconds(b)) for a, b in marks[name]]

        wire = spans("wire")
        if self.recorder is not None:
            covered = float("-inf")
            for (a, b), (_, k, send_n, recv_bytes, itemsize, n) in zip(wire, marks["wire_info"]):
                share = max(0.0, b - max(a, covered))
                covered = max(covered, b)
                self.recorder.record(
                    CommRecord(
                        op=self.transport,
                        nbytes=send_n * itemsize,
                        group_size=n,
                        duration_s=share,
                        tag=f"reshard/bucket{k}",
                        start_s=self._t_start + a,
                        extra={"recv_bytes": recv_bytes, "in_flight_s": b - a},
                    )
                )
        out = {
            "pack_s": sum(b - a for a, b in spans("pack")),
            "wire_s": union_length(wire),
            "unpack_s": sum(b - a for a, b in spans("unpack")),
            "local_s": sum(b - a for a, b in spans("local")),
        }
        # CUDA event and host clocks differ by microseconds: keep each within the wall time
        return {k: min(v, elapsed) for k, v in out.items()}

    def _local_copies(self, srcs, outs) -> None:
        a = self._clock.stamp()
        copy_many(
            [_view(outs[t.param], t.gbox, t.dst_offset, t.dst_strides) for t in self.local],
            [_view(srcs[t.param], t.gbox, t.src_offset, t.src_strides) for t in self.local],
        )
        self._marks["local"].append((a, self._clock.stamp()))

    def _pack(self, sends: list[Transfer], recvs: list[Transfer], srcs, buf: torch.Tensor, n: int):
        ssz, rsz = [0] * n, [0] * n
        o, dsts, views = 0, [], []
        for t in sends:
            k = t.numel
            dsts.append(buf[o : o + k].view(box_shape(t.gbox)))
            views.append(_view(srcs[t.param], t.gbox, t.src_offset, t.src_strides))
            ssz[t.dst] += k
            o += k
        copy_many(dsts, views)
        for t in recvs:
            rsz[t.src] += t.numel
        return ssz, rsz

    def _launch(self, send: torch.Tensor, recv: torch.Tensor, ssz: list[int], rsz: list[int]):
        if self.transport == "all_to_all":
            return self.wire.all_to_all_single(recv, send, rsz, ssz)
        ops, so, ro = [], 0, 0
        for peer in range(len(ssz)):
            if ssz[peer]:
                ops.append(("send", send[so : so + ssz[peer]], peer))
            if rsz[peer]:
                ops.append(("recv", recv[ro : ro + rsz[peer]], peer))
            so += ssz[peer]
            ro += rsz[peer]
        return self.wire.batch_isend_irecv(ops)

    def _finish(self, work, recvs, rbuf, send_n, k, t_issue, outs, itemsize, n) -> None:
        for w in work if isinstance(work, list) else [work]:
            w.wait()
        clock = self._clock
        done = clock.stamp()
        self._marks["wire"].append((t_issue, done))
        info = (None, k, send_n, float(rbuf.numel() * itemsize), itemsize, n)
        self._marks["wire_info"].append(info)
        o, dsts, views = 0, [], []
        for t in recvs:
            k_ = t.numel
            dsts.append(_view(outs[t.param], t.gbox, t.dst_offset, t.dst_strides))
            views.append(rbuf[o : o + k_].view(box_shape(t.gbox)))
            o += k_
        copy_many(dsts, views)
        self._marks["unpack"].append((done, clock.stamp()))
