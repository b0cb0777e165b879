"""State of the verl_comm DDP communication hooks.

One :class:`CommHookState` serves every hook of :mod:`verl_comm.hooks` (as torch's
``PowerSGDState`` serves ``powerSGD_hook``): the process group (None = WORLD), the tunables
(a :class:`~verl_comm.compression.CompressionConfig`), per-bucket error-feedback residuals
and low-rank Q factors keyed by ``bucket.index()``, the iteration counter, the RNG of the
low-rank start vectors, the adaptive policy's link model and decisions, and per-bucket
statistics. ``state_dict()`` / ``load_state_dict()`` round-trip it without the group; the
object pickles without the group too (it is re-bound to WORLD on unpickling).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.compression.collective import Collective, LocalCollective, ProcessGroupCollective
from verl_comm.compression.config import CompressionConfig
from verl_comm.compression.lowrank import LowRankBucketState
from verl_comm.compression.lowrank_plan import FactorWire, LowRankPlan
from verl_comm.compression.policy import LinkModel, PolicyDecision, describe_choices
from verl_comm.telemetry import CommRecorder

from . import trial
from .bucket import describe_change
from .stats import BucketRecord, BucketStats, comm_record, pack_scalars, resolve_records, summarize

logger = logging.getLogger("verl_comm.hooks")

_ERROR_KEYS = ("comm/rel_error", "comm/residual_norm")

STATE_FORMAT = 1
"""Version of the :meth:`CommHookState.state_dict` layout."""


class NonFiniteGradientError(RuntimeError):
    """A reduced gradient bucket held NaN/Inf (raised on every rank, ``nonfinite='raise'``).

    Attributes:
        bucket_indices: the offending ``bucket.index()`` values.
        iteration: the hook iteration (number of completed reductions) of the failure.
    """

    def __init__(self, bucket_indices: list[int], iteration: int) -> None:
        self.bucket_indices = bucket_indices
        self.iteration = iteration
        super().__init__(
            f"non-finite (NaN/Inf) gradient in bucket(s) {bucket_indices} at comm-hook "
            f"iteration {iteration}: at least one rank produced NaN/Inf; fix the loss scale "
            "or learning rate, or set nonfinite='skip' to drop the update of such buckets"
        )


@dataclass
class BucketState:
    """Per-bucket compressor state (this rank's; residuals differ between ranks).

    Attributes:
        signature: ``(numel, dtype, param shapes)`` of the bucket the state was built for.
        meta: ``(method, rank, block, residual dtype, error feedback)`` it was built with.
        residual: int8 path error-feedback residual ``(numel,)``.
        lowrank: low-rank residuals and Q factors. plan: the low-rank split of the bucket.
        decision: the adaptive policy's decision for this bucket, if taken.
        graph, graph_seen, graph_captures: the bucket's CUDA graph, the inputs of its last
            eager run, and how often it was captured (see :mod:`verl_comm.hooks.graphs`).
    """

    signature: tuple
    meta: tuple
    residual: torch.Tensor | None = None
    lowrank: LowRankBucketState = field(default_factory=LowRankBucketState)
    plan: LowRankPlan | None = None
    decision: PolicyDecision | None = None
    wire: FactorWire | None = None
    graph: Any = None  # hooks.graphs.BucketGraph (CUDA); never saved
    graph_seen: tuple | None = None
    graph_captures: int = 0
    params: tuple[int, ...] | None = None  # indices in ddp_model.parameters(), if known

    def _tensors(self) -> list[torch.Tensor]:
        lr = self.lowrank
        ts = [self.residual, lr.rest_residual, *lr.qs, *lr.residuals]
        return [t for t in ts if t is not None]

    def zero_if_nonfinite(self, finite: torch.Tensor) -> None:
        """Zero every residual and Q on the device where ``finite`` (0-dim bool) is False,
        without reading the flag on the host (the CUDA path resolves flags a step later)."""
        for t in self._tensors():
            t.mul_(finite.to(t.dtype))
            t.nan_to_num_(0.0, 0.0, 0.0)

    def reset(self) -> None:
        """Drop residuals and Q factors (a fresh start for this bucket)."""
        self.residual = None
        self.lowrank = LowRankBucketState()

    def tensors_to(self, device: torch.device) -> None:
        """Move the state's tensors to ``device`` (after loading from another device)."""
        if self.residual is not None:
            self.residual = self.residual.to(device)
        lr = self.lowrank
        lr.qs = [None if q is None else q.to(device) for q in lr.qs]
        lr.residuals = [None if r is None else r.to(device) for r in lr.residuals]
        if lr.rest_residual is not None:
            lr.rest_residual = lr.rest_residual.to(device)

    def nbytes(self) -> int:
        """Bytes of tensors held (error-feedback residuals and Q factors)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


class CommHookState:
    """State object passed as ``state`` to every hook of :mod:`verl_comm.hooks`.

    Args:
        process_group: group the gradients are averaged over; None = WORLD. Must be the
            group DDP uses.
        config: tunables; default ``CompressionConfig()`` (the single source of defaults).
        recorder: optional :class:`~verl_comm.telemetry.CommRecorder`; one
            :class:`~verl_comm.telemetry.CommRecord` per bucket and step is appended.
        seed: seed of the CPU generator drawing low-rank start vectors (must be equal on
            all ranks, so that Q starts identical everywhere).
        collective: a :class:`~verl_comm.compression.Collective` to use instead of
            ``process_group`` (custom transports, one-process simulations); not saved.
        timeout_s: seconds the hook of the last bucket, :meth:`flush` and
            :meth:`state_dict` wait for buckets in flight on the worker before
            ``TimeoutError``; collectives themselves time out by the process group's
            timeout.

    Stats timing: on CPU a step's :attr:`last_stats` (and a ``nonfinite='raise'`` error,
    raised by the hook of the step's last bucket) are final when backward returns. On CUDA
    they are read without a host sync: at the end of a later step, once the device has
    copied them (normally one step later), or at :meth:`flush`. So with
    ``nonfinite='raise'`` the error of step k surfaces from the hook of the last bucket of
    step k+1 (or from :meth:`flush`), after step k's update was applied; ``'skip'`` zeroes
    the bucket's update and its error-feedback state on the device in step k itself.

    Attributes:
        iteration: completed reductions (incremented on ``bucket.is_last()``).
        last_stats: ``{bucket index: BucketStats}`` of the latest completed step.
        nonfinite_events: ``(iteration, bucket index)`` of every non-finite bucket seen.
        link: the adaptive policy's :class:`~verl_comm.compression.LinkModel` once measured.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        config: CompressionConfig | None = None,
        *,
        recorder: CommRecorder | None = None,
        seed: int = 0,
        collective: Collective | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.process_group = process_group
        self.config = config if config is not None else CompressionConfig()
        self.recorder = recorder
        self.seed = seed
        self.iteration = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.buckets: dict[int, BucketState] = {}
        self.last_stats: dict[int, BucketStats] = {}
        self.nonfinite_events: list[tuple[int, int]] = []
        self.link: LinkModel | None = None
        self._coll: Collective | None = collective
        self._host_layout: list[list[int]] | None = None  # hooks.hierarchy; [] = flat
        self._pending: list[BucketRecord] = []
        self._streams: dict[torch.device, Any] = {}
        self._deferred: dict[str, Any] | None = None
        self._resume_until = 0  # after a load: first iteration DDP has surely rebuilt by
        self.timeout_s = float(timeout_s)
        self._worker: Any = None
        self._submitted_iter = 0
        self._graphs_off = False  # a capture failed: every bucket runs eagerly
        self._graph_pools: dict[torch.device, Any] = {}
        self._inflight: list[tuple[Any, torch.Tensor, list[BucketRecord], int]] = []
        self._marks: dict[int, tuple[float, Any]] = {}
        self._prev_marks: dict[int, tuple[float, Any]] = {}
        self._link_free_s = float("-inf")
        self._measure_at = self.config.start_iter  # policy auto: see verl_comm.hooks.measure
        self._gate: Any = None  # threading.Event of the measurement step (worker path)
        self._trial: Any = None  # hooks.trial.Trial: policy auto's trial steps (CPU hosts)
        self._trial_round: int | None = None  # the _measure_at whose trial was started
        self._trial_seen = -1  # the _submitted_iter whose first hook call has been seen
        self._last_end_s: float | None = None  # perf_counter at the last end_step
        self._held_measure: list = []  # buckets held inline on the measurement step
        self.param_keys: dict[int, int] = {}  # parameter data_ptr -> index in the DDP module
        self._held: Any = None  # hooks.resume.Held: the first step after a load
        self._error_metrics: dict[str, float] = {}  # latest comm/rel_error, residual_norm
        # buckets of the gloo direct path (hooks.direct) in flight, and whether the step's
        # last bucket has been handed over: the step ends when both say so
        self._direct_lock = threading.Lock()
        self._direct_open = 0
        self._direct_last = False

    # -- execution -------------------------------------------------------------------
    def mark_ready(self, index: int, is_last: bool, device: torch.device) -> None:
        """Note when bucket ``index`` was handed over on the measurement step of policy
        ``auto`` (:mod:`verl_comm.hooks.measure`): host time, and on CUDA an event on the
        caller's stream."""
        if self.config.policy != "auto" or self.iteration != self._measure_at:
            return
        ev = None
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(device))
        self._marks[index] = (time.perf_counter(), ev)
        if is_last:
            self._prev_marks, self._marks = self._marks, {}
            self._last_index = index

    def shadow_of(self, index: int) -> float:
        """Seconds of backward left after bucket ``index`` was ready, on the measurement
        step (0 if unknown; the last bucket's shadow is 0). Reading CUDA
        events waits for them: a one-time sync while the policy decides."""
        marks = self._prev_marks
        last = getattr(self, "_last_index", None)
        if index not in marks or last not in marks:
            return 0.0
        (t_b, ev_b), (t_last, ev_last) = marks[index], marks[last]
        if ev_b is not None and ev_last is not None:
            ev_last.synchronize()
            return max(ev_b.elapsed_time(ev_last), 0.0) / 1e3
        return max(t_last - t_b, 0.0)

    def worker(self) -> Any:
        """The communication worker of the gloo path (started on first use)."""
        if self._worker is None:
            from .worker import CommWorker

            self._worker = CommWorker()
        return self._worker

    def flush(self) -> None:
        """Wait for every bucket in flight and resolve all pending statistics (one host
        sync on CUDA); raises a pending :class:`NonFiniteGradientError`.

        Raises:
            TimeoutError: buckets still in flight on the worker after ``timeout_s``.
        """
        self._drain_worker()
        self._resolve(block=True)

    def _drain_worker(self) -> None:
        """Wait for the worker's jobs; on policy auto's measurement step first release the
        jobs held for the step's last bucket (a flush or state_dict inside backward would
        otherwise wait for a hook that comes only after it; that step's shadows then include
        transfers)."""
        if self._worker is None:
            return
        if self._gate is not None:
            self._gate.set()
        self._worker.drain(self.timeout_s)

    def close(self) -> None:
        """Stop the worker thread (idempotent); the state can still be saved."""
        if self._worker is not None:
            self._drain_worker()
            self._worker.close()
            self._worker = None

    # -- transport -------------------------------------------------------------------
    @property
    def collective(self) -> Collective:
        """The blocking collective over ``process_group`` (W = 1 without torch.distributed)."""
        if self._coll is None:
            if dist.is_available() and dist.is_initialized():
                self._coll = ProcessGroupCollective(self.process_group)
            else:
                self._coll = LocalCollective()
        return self._coll

    @property
    def world_size(self) -> int:
        """Number of ranks W the gradients are averaged over."""
        return self.collective.world_size

    def recalibrate(self) -> None:
        """Make ``policy: auto`` re-measure: the next step is a measurement step (plain
        all-reduces, see :mod:`verl_comm.hooks.measure`); the link and every bucket are
        measured and decided again at the step after it."""
        self._measure_at = self.iteration
        self.link = None
        for b in self.buckets.values():
            b.decision = None
            b.wire = None

    @property
    def auto_settling(self) -> bool:
        """Whether ``policy: auto`` is still measuring, deciding or running its trial steps
        (:mod:`verl_comm.hooks.trial`): its paths may change at the next step."""
        return trial.settling(self)

    def auto_note(self) -> str | None:
        """What ``policy: auto`` chose per bucket and why (the model's predictions), and
        its trial steps; None before any decision."""
        parts = [describe_choices(self.buckets), trial.describe(self._trial)]
        return " | ".join(p for p in parts if p) or None

    def ef_state_nbytes(self) -> int:
        """Bytes of error-feedback residuals and Q factors held by this rank."""
        return sum(b.nbytes() for b in self.buckets.values())

    @property
    def collect_stats(self) -> bool:
        """Whether the reduction of the current iteration computes error statistics
        (``rel_error``, ``residual_norm``): every ``config.stats_every`` iterations, never
        when it is 0 (the default). They cost two passes over each bucket, and on CUDA the
        bucket runs eagerly instead of as its CUDA graph that step."""
        every = self.config.stats_every
        return every > 0 and self.iteration % every == 0

    def metrics(self) -> dict[str, float]:
        """Namespaced metrics of the latest completed step (for the trainer's logger).

        Keys: ``comm/wire_bytes`` and ``comm/plain_bytes`` (bytes this rank sent / would send
        uncompressed, summed over buckets), ``comm/compression_ratio``, ``comm/hook_time_s``
        (seconds, summed; device time on CUDA), ``comm/nonfinite_buckets`` (count),
        ``comm/ef_state_bytes``; with ``config.stats_every > 0`` also ``comm/rel_error``
        (mean over buckets) and ``comm/residual_norm`` (L2 over buckets) of the latest step
        that computed them, so the keys do not change from step to step (ranks reduce the
        metrics key by key). Empty before the first step.
        """
        st = list(self.last_stats.values())
        if not st:
            return {}
        return {
            **summarize(st),
            **self._error_metrics,
            "comm/ef_state_bytes": float(self.ef_state_nbytes()),
        }

    # -- bucket state ----------------------------------------------------------------
    def resuming(self, index: int, signature: tuple, meta: tuple) -> bool:
        """True while bucket ``index`` must not compress because a state was just loaded.

        A fresh DDP reduces its first step in the initial bucket order and rebuilds its
        buckets afterwards (torch ``Reducer::rebuild_buckets``), which is what
        ``start_iter`` waits for. After :meth:`load_state_dict` the loaded iteration is
        usually past ``start_iter``, so the wait is counted again from the load: for
        ``start_iter`` steps a bucket compresses only if the loaded state was built for
        exactly this layout and method (then resuming is bit-identical); the others run a
        plain all-reduce and keep their loaded state.
        """
        if self.iteration >= self._resume_until:
            return False
        bs = self.buckets.get(index)
        return bs is None or bs.signature != signature or bs.meta != meta

    def bucket_state(self, index: int, signature: tuple, meta: tuple) -> BucketState:
        """The state of bucket ``index``; a changed layout or method resets it (warning
        naming what changed)."""
        bs = self.buckets.get(index)
        if bs is not None and (bs.signature != signature or bs.meta != meta):
            if bs.nbytes() or bs.decision is not None:
                warnings.warn(
                    f"comm hook: bucket {index} changed ("
                    f"{describe_change(bs.signature, signature, bs.meta, meta)}); its "
                    "error-feedback state is reset",
                    RuntimeWarning,
                    stacklevel=3,
                )
            bs = None
        if bs is None:
            bs = BucketState(signature, meta)
            self.buckets[index] = bs
        return bs

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-identically, without the process group.

        Returns:
            dict with ``format``, ``world_size``, ``iteration``, ``seed``, ``generator``
            (uint8 RNG state), ``config`` (dict), ``link`` and ``buckets`` (per index:
            signature, meta, tensors cloned on their device, decision). Save it per rank
            (residuals differ between ranks). Buckets in flight are waited for first
            (worker drained, side streams joined; no host sync on CUDA).
        """
        self._quiesce()
        buckets = {}
        for idx, b in self.buckets.items():
            buckets[idx] = {
                "signature": b.signature,
                "meta": b.meta,
                "residual": _clone(b.residual),
                "qs": [_clone(q) for q in b.lowrank.qs],
                "residuals": [_clone(r) for r in b.lowrank.residuals],
                "rest_residual": _clone(b.lowrank.rest_residual),
                "decision": None if b.decision is None else b.decision.to_dict(),
                "params": b.params,
            }
        return {
            "format": STATE_FORMAT,
            "world_size": self.world_size,
            "iteration": self.iteration,
            "seed": self.seed,
            "generator": self.generator.get_state(),
            "config": self.config.model_dump(),
            "link": None if self.link is None else asdict(self.link),
            "buckets": buckets,
            "auto_trial": trial.saved(self._trial),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        The iteration and RNG are always restored. Per-bucket state is dropped (with a
        RuntimeWarning) when the world size or the compression settings changed; a bucket
        whose layout changed is reset when it is next seen. Shapes are never forced. For
        ``config.start_iter`` steps after the load a bucket compresses only if its loaded
        state matches its layout (see :meth:`resuming`).

        Raises:
            ValueError: unknown ``format``.
        """
        self._quiesce()
        if sd.get("format") != STATE_FORMAT:
            raise ValueError(
                f"state_dict format {sd.get('format')!r} is not {STATE_FORMAT}; it was written "
                "by another version of verl_comm.hooks"
            )
        self.iteration = int(sd["iteration"])
        self._submitted_iter = self.iteration
        self.seed = int(sd["seed"])
        self.generator.set_state(sd["generator"])
        self.buckets = {}
        self.link = None
        self._trial = self._trial_round = None
        self._resume_until = self.iteration + self.config.start_iter
        self._measure_at = self._resume_until  # buckets loaded undecided measure then
        if sd["world_size"] != self.world_size:
            warnings.warn(
                f"comm hook state was saved with world size {sd['world_size']}, now "
                f"{self.world_size}: error-feedback residuals and Q factors are reset; "
                f"iterations {self.iteration}-{self._resume_until - 1} use a plain "
                "all-reduce while DDP rebuilds its buckets",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if sd["link"] is not None:
            self.link = LinkModel(**sd["link"])
        self._trial = trial.restored(sd.get("auto_trial"), self._measure_at)
        self._trial_round = None if self._trial is None else self._measure_at
        for idx, b in sd["buckets"].items():
            lr = LowRankBucketState(
                qs=[_clone(q) for q in b["qs"]],
                residuals=[_clone(r) for r in b["residuals"]],
                rest_residual=_clone(b["rest_residual"]),
            )
            dec = None if b["decision"] is None else PolicyDecision(**b["decision"])
            self.buckets[int(idx)] = BucketState(
                tuple(b["signature"]), tuple(b["meta"]), _clone(b["residual"]), lr, None, dec
            )
            pids = b.get("params")
            self.buckets[int(idx)].params = None if pids is None else tuple(pids)

    def __getstate__(self) -> dict[str, Any]:
        # picklable without the process group, the recorder's lock or CUDA streams
        return {"config": self.config.model_dump(), "state": self.state_dict()}

    def __setstate__(self, d: dict[str, Any]) -> None:
        with warnings.catch_warnings():  # the config was validated (and warned) before
            warnings.simplefilter("ignore")
            config = CompressionConfig(**d["config"])
        self.__init__(None, config)  # type: ignore[misc]
        self._deferred = d["state"]  # loaded when a hook first runs (the group exists then)

    def apply_deferred(self) -> None:
        """Load a state unpickled before the process group existed (called by the hooks)."""
        sd, self._deferred = self._deferred, None
        if sd is not None:
            self.load_state_dict(sd)

    # -- end of step -----------------------------------------------------------------
    def _quiesce(self) -> None:
        """No bucket in flight: drain the worker, order the current stream after the side
        streams (device-side wait, no host sync)."""
        self._drain_worker()
        for dev, stream in self._streams.items():
            torch.cuda.current_stream(dev).wait_stream(stream)

    def _add_pending(self, item: BucketRecord) -> None:
        self._pending.append(item)

    def direct_opened(self) -> None:
        """A bucket of the direct path (:mod:`verl_comm.hooks.direct`) started."""
        with self._direct_lock:
            self._direct_open += 1

    def direct_finished(self, is_last: bool) -> bool:
        """A bucket of the direct path finished (its record added); True exactly once per
        step: for the bucket that finishes last once the step's last bucket has started.
        gloo completes the buckets on its own threads, not necessarily in order."""
        with self._direct_lock:
            self._direct_open -= 1
            self._direct_last = self._direct_last or is_last
            if self._direct_last and self._direct_open == 0:
                self._direct_last = False
                return True
            return False

    def end_step(self) -> None:
        """Close the step: advance ``iteration``; hand its per-bucket flags and stats to the
        resolver (at once on CPU; on CUDA after a non-blocking copy to pinned memory, read
        once it has landed). Called by the hooks on ``bucket.is_last()``.

        Raises:
            NonFiniteGradientError: ``nonfinite='raise'`` and a resolved bucket was
                non-finite.
        """
        pending, self._pending = self._pending, []
        it = self.iteration
        self.iteration += 1
        trial.on_step_end(self, it)
        if not pending:
            return
        vals = pack_scalars(pending)
        if vals.is_cuda:
            host = torch.empty(vals.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(vals, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._inflight.append((ev, host, pending, it))
            self._resolve(block=False)
        else:
            self._apply(vals, pending, it)

    def _resolve(self, block: bool) -> None:
        """Apply in-flight CUDA stats in step order; without ``block`` only those whose copy
        has completed (``Event.query``, no host sync)."""
        while self._inflight:
            ev, host, pending, it = self._inflight[0]
            if not block and not ev.query():
                return
            if block:
                ev.synchronize()
            self._inflight.pop(0)
            self._apply(host, pending, it)

    def _apply(self, vals: torch.Tensor, pending: list[BucketRecord], it: int) -> None:
        skip = self.config.nonfinite == "skip"
        stats = resolve_records(vals, pending, it, skip)
        bad: list[int] = []
        for r, st in zip(pending, stats):
            if not st.finite:
                bad.append(r.index)
                self.nonfinite_events.append((it, r.index))
                bs = self.buckets.get(r.index)
                if bs is not None and not r.finite.is_cuda:
                    bs.reset()  # residuals / Q hold NaN now (CUDA: zeroed on the device)
            if self.recorder is not None:
                self.recorder.record(comm_record(r, st))
        self.last_stats = {st.index: st for st in stats}
        errs = {k: v for k, v in summarize(stats).items() if k in _ERROR_KEYS}
        if errs:
            self._error_metrics = errs
        if bad:
            if self.config.nonfinite == "raise":
                raise NonFiniteGradientError(bad, it)
            logger.warning(
                "comm hook: non-finite gradient in bucket(s) %s at iteration %d; their "
                "update was zeroed (nonfinite='skip')",
                bad,
                it,
            )
