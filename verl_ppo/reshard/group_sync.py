"""Asynchronous weight sync from training ranks to rollout ranks (point-to-point, bucketed).

Runs a :class:`~verl_ppo.reshard.group_plan.GroupSyncPlan`. Per sync and per stream the
sender posts, with ``isend`` on the sync group (gloo on CPU, NCCL on GPUs: the transport is
the group's backend), per bucket a header (int64 ``(encoding, changed)``) and then the
bucket's bytes (when it has any), then a trailer (the stream's
:func:`~verl_ppo.reshard.delta.checksum`, two int64). With
``wire="full"`` every bucket is the rollout-dtype values; with ``wire="delta"`` it is the
:mod:`~verl_ppo.reshard.delta` encoding against what the receiver already holds (the first
sync is full). Bytes are counted from the tensors handed to ``isend``/``irecv``.

The rollout side keeps generating with its live weights while a background thread receives
into a staging copy: per stream it posts the first header's receive, and on each header's
arrival that bucket's receive (its size from the header) and the next header's, then the
trailer's; it decodes each bucket into staging once the next header has arrived (the
bucket's bytes came first), checksums it there (buckets of whole 64-bit words; else the
whole stream at the end), and checks the combined checksum against the trailer's (the
staging copy is bit-identical to the trainer's weights cast to the rollout dtype, or a
:class:`WeightSyncError` says which stream differs). :meth:`SyncReceiver.switch` waits only
for what is left and copies staging into the live weights; its duration is the pause of
generation, recorded apart from the transfer time. The thread touches only the sync group,
so the sync group must be used by nothing else (pass a dedicated group, e.g.
``ctx.new_group(all ranks)``). gloo does not report completion of a receive until it is
waited on, hence a thread rather than polling.

Every wait has a deadline (``timeout_s``); a peer that never sends, or dies, raises a
:class:`WeightSyncError` naming this rank, the peer and the phase.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_ppo.reshard.delta import (
    ENCODINGS,
    FULL,
    changed_positions,
    checksum,
    choose_encoding,
    combine_checksums,
    decode_,
    encode,
    encoded_nbytes,
    word_aligned,
)
from verl_ppo.reshard.group_plan import GroupSyncPlan, SyncStream
from verl_ppo.reshard.specs import piece_view

WIRES = ("full", "delta")


class WeightSyncError(RuntimeError):
    """A sync failed: a timeout, a dead peer or a checksum mismatch (rank and phase named)."""


@dataclass
class SyncStats:
    """One sync on one rank (sender or receiver).

    Attributes:
        step: sync counter (0 = the first, always full).
        wire: ``"full"`` or ``"delta"``.
        bytes_sent, bytes_received: all bytes handed to isend / irecv (headers included).
        header_bytes: the headers' and trailers' share of those bytes.
        elems: rollout-dtype elements covered; changed: of them, different from the last sync.
        encodings: buckets per encoding name.
        encode_s: sender, seconds to cast, slice and encode.
        started_at: sender, ``time.time()`` when ``start()`` began.
        wait_s: receiver, seconds from ``start()`` until the first header arrived (the
            senders had not started: training time, not wire time).
        transfer_s: receiver, seconds from the first header's arrival until the last bucket
            was decoded and the checksums checked.
        done_at: receiver, ``time.time()`` when the transfer ended (a clock all processes of
            one host share, for measuring a sync across ranks).
        pause_s: receiver, seconds ``switch()`` blocked (waiting + copying into live weights).
        verified: receiver, every stream's checksum matched the sender's.
    """

    step: int
    wire: str
    bytes_sent: int = 0
    bytes_received: int = 0
    header_bytes: int = 0
    elems: int = 0
    changed: int = 0
    encodings: dict[str, int] = field(default_factory=dict)
    encode_s: float = 0.0
    started_at: float = 0.0
    wait_s: float = 0.0
    transfer_s: float = 0.0
    done_at: float = 0.0
    pause_s: float = 0.0
    verified: bool = False


def registered(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is WORLD or a group of this process's default world (else a
    standalone process group, e.g. the bridge between the training and the rollout worlds
    of :mod:`verl_ppo.asyncrl.world`, called through its own ``send``/``recv``)."""
    if group is None:
        return True
    try:
        dist.get_process_group_ranks(group)
    except KeyError:  # torch's answer for a group it did not register
        return False
    return True


def is_gloo(group: Any) -> bool:
    """Whether ``group`` (None = WORLD, a registered or a standalone group) runs on gloo."""
    if group is None or registered(group):
        return dist.get_backend(group) == "gloo"
    return isinstance(group, dist.ProcessGroupGloo)


class _HostStaged:
    """A gloo receive into host memory standing for one into a CUDA tensor: ``wait`` copies
    the host buffer into the tensor once the receive completed."""

    def __init__(self, work: dist.Work, host: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.host, self.dst = work, host, dst

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: timedelta | None = None) -> bool:
        done = self.work.wait(timeout) if timeout is not None else self.work.wait()
        self.dst.copy_(self.host)
        return done


class _Peer:
    """Point-to-point calls on the sync group with byte counting and deadlines. CUDA
    tensors on a gloo group (a training and a rollout rank sharing a GPU,
    :func:`verl_ppo.asyncrl.world.placement`) are staged through host memory."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, cuda: bool) -> None:
        self.group, self.rank = group, rank
        self.standalone = not registered(group)
        self.stage = cuda and is_gloo(group)
        self.cuda = cuda and not self.stage  # NCCL work: polled

    def _glob(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def isend(self, t: torch.Tensor, dst: int, stats: SyncStats) -> dist.Work:
        stats.bytes_sent += t.numel() * t.element_size()
        t = t.cpu() if self.stage else t  # gloo's work keeps the host copy alive
        if self.standalone:
            return self.group.send([t], dst, 0)
        return dist.isend(t, self._glob(dst), group=self.group)

    def irecv(self, t: torch.Tensor, src: int, stats: SyncStats) -> dist.Work:
        stats.bytes_received += t.numel() * t.element_size()
        if self.stage:
            host = torch.empty(t.shape, dtype=t.dtype)
            return _HostStaged(self._irecv(host, src), host, t)
        return self._irecv(t, src)

    def _irecv(self, t: torch.Tensor, src: int) -> dist.Work:
        if self.standalone:
            return self.group.recv([t], src, 0)
        return dist.irecv(t, self._glob(src), group=self.group)

    def wait(self, work: dist.Work, deadline: float, peer: int, phase: str) -> None:
        """Wait for ``work`` until ``deadline`` (``time.monotonic()``).

        Raises:
            WeightSyncError: the deadline passed or the transport failed (peer died).
        """
        wait_work(
            work, deadline, self.cuda, f"rank {self.rank}: weight sync {phase} with rank {peer}"
        )


def wait_work(
    work: dist.Work,
    deadline: float,
    cuda: bool,
    what: str,
    error: type[Exception] = WeightSyncError,
) -> None:
    """Wait for a point-to-point ``work`` until ``deadline`` (``time.monotonic()``).

    Args:
        cuda: NCCL work (polled: completion is observable without blocking); else gloo
            (``wait(timeout)`` raises at the deadline).
        what: who waits for what from whom, the start of the error message.
        error: the exception raised.

    Raises:
        error: the deadline passed (``"<what> timed out"``) or the transport failed, e.g.
            the peer died (``"<what> failed: <cause>"``).
    """
    try:
        if cuda:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(1e-4)
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
    except TimeoutError:
        raise error(f"{what} timed out (timeout_s exceeded)") from None
    except RuntimeError as e:
        kind = "timed out" if "Timed out" in str(e) else "failed"
        raise error(f"{what} {kind}: {e}") from e


def _check_wire(wire: str) -> None:
    if wire not in WIRES:
        raise ValueError(f"sync wire {wire!r} is not one of {WIRES}")


def _dtype_ok(dtype: torch.dtype, wire: str) -> None:
    size = torch.empty((), dtype=dtype).element_size()
    if not dtype.is_floating_point or size not in (2, 4) or (wire == "delta" and size != 2):
        raise ValueError(
            f"rollout dtype must be bf16 or fp16 (fp32 too with the full wire), got {dtype} "
            f"with wire {wire!r}"
        )


def _endpoint(
    end: Any,
    plan: GroupSyncPlan,
    rank: int,
    side: str,
    group: dist.ProcessGroup | None,
    wire: str,
    dtype: torch.dtype,
    device: torch.device | str,
    timeout_s: float,
) -> None:
    """Check and set what a :class:`SyncSender` or :class:`SyncReceiver` holds in common.

    Raises:
        ValueError: unknown wire, a dtype the wire cannot carry, or ``rank`` not on ``side``
            (``training`` or ``rollout``) of the plan.
    """
    _check_wire(wire)
    _dtype_ok(dtype, wire)
    ranks = plan.train_ranks if side == "training" else plan.rollout_ranks
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not a {side} rank {list(ranks)}")
    end.plan, end.rank, end.wire, end.dtype = plan, rank, wire, dtype
    end.device, end.timeout_s = torch.device(device), timeout_s
    end.peer = _Peer(group, rank, end.device.type == "cuda")


class SyncSender:
    """Training side: cast, slice, encode and post this rank's streams.

    Args:
        plan: the sync plan (same on every rank).
        rank: this rank in the sync group (a training rank of the plan).
        group: the sync group (None = WORLD; a registered group, or a standalone process
            group spanning two worlds, see :func:`registered`), used by nothing else.
        wire: ``"full"`` or ``"delta"``.
        dtype: rollout dtype (bf16 or fp16; fp32 with ``wire="full"``).
        device: where the weights live (``cuda`` with NCCL, ``cpu`` with gloo).
        timeout_s: deadline of :meth:`finish` (seconds).

    Raises:
        ValueError: unknown wire, a dtype that is not 16-bit floating point, or ``rank``
            not a training rank of the plan.
    """

    def __init__(
        self,
        plan: GroupSyncPlan,
        rank: int,
        group: dist.ProcessGroup | None = None,
        wire: str = "delta",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
    ) -> None:
        _endpoint(self, plan, rank, "training", group, wire, dtype, device, timeout_s)
        self.streams = plan.sends_of(rank)
        self._ref: dict[int, torch.Tensor] = {}  # stream index -> what its receiver holds
        # stream index -> a host buffer to cast the next sync into (a new zeroed one costs a
        # write of every element, and page faults); CUDA's caching allocator recycles them
        self._spare: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[dist.Work, int, str, torch.Tensor]] = []
        self.step = 0
        self.last_stats: SyncStats | None = None

    def _flat(
        self, s: SyncStream, params: Mapping[str, torch.Tensor], flat: torch.Tensor | None
    ) -> torch.Tensor:
        """The stream's rollout-dtype elements: each shard's pieces copied (and cast) from
        the full weights straight into one buffer, one pass over the bytes sent. ``flat``:
        a buffer of an earlier sync of this stream to reuse (what no piece covers, e.g.
        ZeRO-3 padding, stays zero from its allocation), or None for a new one."""
        j = self.plan.rollout_ranks.index(s.dst)
        if flat is None:
            flat = torch.zeros(s.numel, dtype=self.dtype, device=self.device)
        off = 0
        for p in s.params:
            spec, sh = self.plan.specs[p], self.plan.rollout_shards[j][p]
            if spec.name not in params:
                raise KeyError(f"rank {self.rank} must send {spec.name!r} but does not hold it")
            t = params[spec.name].detach()
            if tuple(t.shape) != spec.shape:
                raise ValueError(
                    f"{spec.name}: rank {self.rank} holds shape {tuple(t.shape)}, the sync "
                    f"plan needs the full {spec.shape}"
                )
            seg = flat[off : off + sh.numel]
            for piece in sh.pieces:
                piece_view(seg, piece).copy_(t[tuple(slice(a, b) for a, b in piece.gbox)])
            off += sh.numel
        return flat

    def _post_small(self, values: list[int], dst: int, phase: str, stats: SyncStats) -> None:
        """isend a header or trailer (int64 values) to ``dst``, counted as header bytes."""
        h = torch.tensor(values, dtype=torch.int64, device=self.device)
        stats.header_bytes += h.numel() * h.element_size()
        self._pending.append((self.peer.isend(h, dst, stats), dst, phase, h))

    def _bucket(self, i: int, k: int, new: torch.Tensor, stats: SyncStats) -> None:
        """Compare bucket ``k`` of stream ``i`` with what its receiver holds, then post its
        header ``(encoding, changed)`` and its payload (when it has bytes)."""
        s = self.streams[i]
        buckets = s.buckets(self.plan.bucket_elems)
        a, b = buckets[k]
        ref = self._ref.get(i) if self.wire == "delta" else None
        isz = new.element_size()
        if ref is None:
            kind, changed, pos = FULL, b - a, None
        else:
            pos = changed_positions(ref[a:b], new[a:b])
            kind, changed = choose_encoding(b - a, pos.numel(), isz), pos.numel()
        stats.changed += changed
        stats.encodings[ENCODINGS[kind]] = stats.encodings.get(ENCODINGS[kind], 0) + 1
        of = f"{k + 1}/{len(buckets)}"
        self._post_small([kind, changed], s.dst, f"header send {of}", stats)
        if encoded_nbytes(kind, b - a, changed, isz):
            t = (
                new[a:b].view(torch.uint8)
                if kind == FULL
                else encode(ref[a:b], new[a:b], pos).payload
            )
            self._pending.append((self.peer.isend(t, s.dst, stats), s.dst, f"bucket send {of}", t))

    def start(self, params: Mapping[str, torch.Tensor]) -> SyncStats:
        """Post this rank's streams for the current weights; returns without waiting.

        Per stream and bucket a header (encoding and changed count) then the payload, so a
        bucket goes out as soon as it is compared and encoded: each stream's first bucket
        right after the stream is cast, the other buckets round-robin over the streams,
        so the wire carries bucket ``k`` while bucket ``k + 1`` is compared. A header for
        a whole stream held the first byte back by a compare over the stream, and the
        checksum in it by one more pass; the checksum now goes last, in a trailer
        computed while the buckets are on the wire.

        Args:
            params: full (per-stage) training weights by HF name, any float dtype.

        Returns:
            the stats of this sync (bytes counted as posted).

        Raises:
            WeightSyncError: the previous sync's sends did not finish within ``timeout_s``.
            KeyError, ValueError: a parameter the plan needs is missing or has another shape.
        """
        self.finish()
        stats = SyncStats(self.step, self.wire, started_at=time.time())
        t0 = time.perf_counter()
        counts = [len(s.buckets(self.plan.bucket_elems)) for s in self.streams]
        news = []
        for i, s in enumerate(self.streams):  # the wire starts after one bucket's work
            news.append(self._flat(s, params, self._spare.pop(i, None)))
            if counts[i]:
                self._bucket(i, 0, news[i], stats)
        for k in range(1, max(counts, default=0)):
            for i in range(len(self.streams)):
                if k < counts[i]:
                    self._bucket(i, k, news[i], stats)
        for s, new in zip(self.streams, news):
            self._post_small([*checksum(new)], s.dst, "checksum send", stats)
        spare = self._ref if self.wire == "delta" else dict(enumerate(news))
        if self.wire == "delta":
            self._ref = dict(enumerate(news))
        if self.device.type == "cpu":  # written again after finish() saw their sends done
            self._spare = spare
        stats.elems = sum(s.numel for s in self.streams)
        stats.encode_s = time.perf_counter() - t0
        self.step, self.last_stats = self.step + 1, stats
        return stats

    def finish(self) -> None:
        """Wait until every posted send completed (their buffers are then free).

        Raises:
            WeightSyncError: a receiver did not take its data within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        pending, self._pending = self._pending, []
        for work, dst, phase, _ in pending:
            self.peer.wait(work, deadline, dst, phase)


class SyncReceiver:
    """Rollout side: receive into staging in a background thread, switch on demand.

    Args:
        plan, rank, group, wire, dtype, device: as for :class:`SyncSender` (``rank`` a
            rollout rank).
        timeout_s: a sync must complete within this many seconds of :meth:`start`.

    Attributes:
        live: this rank's rollout shards by HF name (``dtype``, TP-local shapes), what the
            rollout model reads (e.g. ``TPCausalLM(config, receiver.live, tp)``); zeros until
            the first :meth:`switch`, then updated in place at every switch.

    Raises:
        ValueError: as for :class:`SyncSender`.
    """

    def __init__(
        self,
        plan: GroupSyncPlan,
        rank: int,
        group: dist.ProcessGroup | None = None,
        wire: str = "delta",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
    ) -> None:
        _endpoint(self, plan, rank, "rollout", group, wire, dtype, device, timeout_s)
        self.streams = plan.recvs_of(rank)
        shards = plan.rollout_shards_of(rank)
        self.live = {
            n: torch.zeros(sh.local_shape, dtype=dtype, device=self.device)
            for n, sh in shards.items()
        }
        self._staging = [
            torch.zeros(s.numel, dtype=dtype, device=self.device) for s in self.streams
        ]
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._event = None
        self.step = 0
        self.last_stats: SyncStats | None = None

    def start(self) -> None:
        """Begin receiving the next sync in the background; generation may continue on
        :attr:`live`.

        Raises:
            RuntimeError: the previous sync was not switched in yet.
        """
        if self._thread is not None:
            raise RuntimeError(f"rank {self.rank}: start() called twice without switch()")
        self._stats = SyncStats(self.step, self.wire)
        self._deadline = time.monotonic() + self.timeout_s
        self._t0 = time.perf_counter()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="weight-sync-recv", daemon=True)
        self._thread.start()

    def ready(self) -> bool:
        """Whether every bucket has arrived (``switch()`` would then only copy)."""
        return self._thread is not None and not self._thread.is_alive()

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    self._receive()
                self._event = stream.record_event()
            else:
                self._receive()
            self._stats.transfer_s = time.perf_counter() - self._t0 - self._stats.wait_s
            self._stats.done_at = time.time()
        except BaseException as e:  # re-raised by switch() in the caller's thread
            self._error = e

    def _receive(self) -> None:
        st, peer, dl = self._stats, self.peer, self._deadline
        bucket_lists = [s.buckets(self.plan.bucket_elems) for s in self.streams]
        n_streams = len(self.streams)
        isz = torch.empty((), dtype=self.dtype).element_size()
        # checksum each bucket once it is decoded (buckets of whole 64-bit words), so
        # only the last bucket's is left when the last bytes arrive
        by_bucket = word_aligned(self.plan.bucket_elems, isz)
        sums: list[list[tuple[int, tuple[int, int]]]] = [[] for _ in range(n_streams)]
        queued: list[list[tuple]] = [[] for _ in range(n_streams)]

        def small(n: int, src: int) -> tuple[torch.Tensor, dist.Work]:
            h = torch.empty(n, dtype=torch.int64, device=self.device)
            st.header_bytes += h.numel() * h.element_size()
            return h, peer.irecv(h, src, st)

        def settle(i: int) -> None:
            """Wait for, decode and checksum stream ``i``'s buckets posted so far."""
            for k, nb, a, b, kind, changed, buf, work in queued[i]:
                stage = self._staging[i]
                if work is not None:
                    peer.wait(work, dl, self.streams[i].src, f"bucket receive {k + 1}/{nb}")
                if kind != FULL and buf is not None:  # None: nothing changed, no bytes
                    decode_(stage[a:b], kind, changed, buf)
                if by_bucket:
                    sums[i].append((a * isz // 8, checksum(stage[a:b])))
            queued[i].clear()

        # one peer's messages are matched in the order posted (gloo per tag, NCCL per
        # pair): per stream header 1, bucket 1, header 2, ..., bucket K, trailer. A
        # bucket's receive needs its size, so header k + 1 is posted after bucket k's;
        # bucket k's bytes precede header k + 1's, so it is decoded once that arrives.
        heads = [small(2, s.src) if bl else None for s, bl in zip(self.streams, bucket_lists)]
        trailers = [None if bl else small(2, s.src) for s, bl in zip(self.streams, bucket_lists)]
        for k in range(max(map(len, bucket_lists), default=0)):
            for i in range(n_streams):
                s, bl, stage = self.streams[i], bucket_lists[i], self._staging[i]
                if k >= len(bl):
                    continue
                h, work = heads[i]
                peer.wait(work, dl, s.src, f"header receive {k + 1}/{len(bl)}")
                if k == i == 0:
                    st.wait_s = time.perf_counter() - self._t0
                kind, changed = h.tolist()
                (a, b), name = bl[k], ENCODINGS[kind]
                st.changed += changed
                st.encodings[name] = st.encodings.get(name, 0) + 1
                n = encoded_nbytes(kind, b - a, changed, isz)
                work = buf = None
                if n:
                    buf = (
                        stage[a:b].view(torch.uint8)
                        if kind == FULL
                        else torch.empty(n, dtype=torch.uint8, device=self.device)
                    )
                    work = peer.irecv(buf, s.src, st)
                if k + 1 < len(bl):
                    heads[i] = small(2, s.src)
                else:
                    trailers[i] = small(2, s.src)
                settle(i)  # bucket k - 1: its bytes came before header k
                queued[i].append((k, len(bl), a, b, kind, changed, buf, work))
        st.elems = sum(s.numel for s in self.streams)
        for i in range(n_streams):
            settle(i)
        for i, (s, (h, work), stage) in enumerate(zip(self.streams, trailers, self._staging)):
            peer.wait(work, dl, s.src, "checksum receive")
            want = tuple(h.tolist())
            got = combine_checksums(sums[i]) if by_bucket else checksum(stage)
            if want != got:
                raise WeightSyncError(
                    f"rank {self.rank}: weight sync checksum from rank {s.src} differs "
                    f"(sent {want}, received {got}): the rollout shard is not the trainer's"
                )
        st.verified = True

    def switch(self) -> SyncStats:
        """Wait for what is left of the sync started last, then copy it into :attr:`live`.

        Returns:
            this sync's stats (``pause_s``: the time this call blocked).

        Raises:
            RuntimeError: no sync started.
            WeightSyncError: a timeout, a dead sender or a checksum mismatch (rank, peer
                and phase named); :attr:`live` then still holds the previous weights.
        """
        if self._thread is None:
            raise RuntimeError(f"rank {self.rank}: switch() without start()")
        t0 = time.perf_counter()
        self._thread.join(max(self._deadline - time.monotonic(), 0.0) + 5.0)
        if self._thread.is_alive():  # the thread's own waits have the same deadline
            raise WeightSyncError(f"rank {self.rank}: weight sync switch timed out")
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        for s, stage in zip(self.streams, self._staging):
            off = 0
            for p in s.params:
                dst = self.live[self.plan.specs[p].name]
                dst.view(-1).copy_(stage[off : off + dst.numel()])
                off += dst.numel()
        st = self._stats
        st.pause_s = time.perf_counter() - t0
        self.step, self.last_stats = self.step + 1, st
        return st
