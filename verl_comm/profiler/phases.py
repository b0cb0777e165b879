"""Named phases of a training step: the one phase timer of the project.

A :class:`Phase` times one block once (``time.perf_counter``; on CUDA, when asked, the
device is synchronised at both ends so that the time includes device work) and, when a
:class:`~verl_comm.profiler.VerlProfiler` is profiling the step, records it there (depth,
start and end in its timebase, memory at the boundaries and the peak, a
``record_function("phase::<name>")`` range in the Chrome trace).

Two users, one implementation: :meth:`VerlProfiler.phase` (a phase only while profiling,
else one shared no-op context) and :class:`PhaseTimer`, the per-step wall times of every
step (``timing_s/<phase>``) that also feed the profiler when it is active, so one block is
never timed or synchronised twice.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch


class _NullPhase(AbstractContextManager):
    """The shared no-op phase of a profiler that is not profiling."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL_PHASE = _NullPhase()


class Phase(AbstractContextManager):
    """One timed block.

    Args:
        name: the phase's name (``gen``, ``reward``, ...).
        profiler: the :class:`~verl_comm.profiler.VerlProfiler` to record into (only while
            it is active), or None. Typed ``Any``: core.py imports this module, not the
            reverse.
        sync_cuda: synchronise CUDA at entry and exit and keep the peak allocated CUDA
            memory of the block (:attr:`peak_bytes`); the profiler's own ``cuda_sync``
            and ``record_memory`` settings ask for the same when it records.

    Attributes (after exit):
        seconds: wall time of the block, excluding the profiler's bookkeeping.
        peak_bytes: peak allocated CUDA memory during the block (None unless ``sync_cuda``).
    """

    def __init__(self, name: str, profiler: Any = None, sync_cuda: bool = False) -> None:
        self.name = name
        self.prof = profiler if profiler is not None and profiler.active else None
        self.sync = sync_cuda or (self.prof is not None and self.prof._cuda_sync)
        self.want_peak = sync_cuda
        self.seconds = 0.0
        self.peak_bytes: int | None = None
        self._rf: Any = None

    def __enter__(self) -> Phase:
        p = self.prof
        t_in = time.perf_counter()
        if self.sync:
            torch.cuda.synchronize()
        reset_peak = self.want_peak
        if p is not None:
            self.depth = len(p._stack)
            p._stack.append(self)
            self.mem0 = p._mem_sample() if p.record_memory else None
            reset_peak = reset_peak or (p.record_memory and p._cuda and self.depth == 0)
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        if p is not None and p._torch_prof is not None:
            self._rf = torch.profiler.record_function(f"phase::{self.name}")
            self._rf.__enter__()
        self.t0 = time.perf_counter()
        if p is not None:
            p._overhead_s += self.t0 - t_in
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sync:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        self.seconds = t1 - self.t0
        if self.want_peak:
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
        p, self.prof = self.prof, None  # recorded once (``stop()`` closes open phases)
        if p is None:
            return
        if self._rf is not None:
            self._rf.__exit__(None, None, None)
        p._stack.pop()
        rec: dict[str, Any] = {
            "name": self.name,
            "step": p._step,
            "depth": self.depth,
            "t0": self.t0,
            "t1": t1,
        }
        if p.record_memory:
            mem1 = p._mem_sample()
            rec["mem_start"], rec["mem_end"] = self.mem0, mem1
            peak = max(self.mem0["allocated"], mem1["allocated"])
            if p._cuda and self.depth == 0:
                peak = max(peak, torch.cuda.max_memory_allocated())
            rec["mem_peak"] = peak
            p._memory.append({"t": t1, **mem1})
        p._phases.append(rec)
        p._overhead_s += time.perf_counter() - t1


class PhaseTimer:
    """Wall time per named phase of a step, reported as ``timing_s/<phase>``.

    Args:
        profiler: a :class:`~verl_comm.profiler.VerlProfiler` (or None); while it profiles
            a step, each phase is also recorded there (the same measurement).
        sync_cuda: synchronise CUDA at phase boundaries and keep each phase's peak
            allocated CUDA memory (``memory/peak_gib/<phase>``).
    """

    def __init__(self, profiler: Any = None, sync_cuda: bool = False) -> None:
        self.times: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.profiler = profiler
        self.sync_cuda = sync_cuda

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as phase ``name`` (accumulates if entered twice)."""
        ph = Phase(name, self.profiler, self.sync_cuda)
        with ph:
            yield
        if ph.peak_bytes is not None:
            self.peaks[name] = max(self.peaks.get(name, 0.0), ph.peak_bytes / 2**30)
        self.times[name] = self.times.get(name, 0.0) + ph.seconds

    def metrics(self) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}``, ``timing_s/step`` (their sum) and
        ``{"memory/peak_gib/<phase>": GiB}`` when CUDA peaks are kept."""
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        out["timing_s/step"] = sum(self.times.values())
        out.update({f"memory/peak_gib/{k}": v for k, v in self.peaks.items()})
        return out
