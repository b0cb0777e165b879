"""``VerlProfiler``: named phase ranges, communication and memory records over training steps.

Built on ``torch.profiler`` (CPU and, when present, CUDA activities). What it records per
rank, in the ``time.perf_counter`` timebase (seconds):

- steps: one window per ``step()`` call (from ``start()`` or the previous ``step()``);
- phases: ``with prof.phase("gen"): ...`` ranges, or the phases of a
  :class:`~verl_comm.profiler.phases.PhaseTimer` given this profiler (also
  ``record_function("phase::gen")`` in the Chrome trace), with memory at entry/exit and the
  phase's peak; on CUDA the device is synchronised at phase boundaries so that phase times
  include device work (:mod:`~verl_comm.profiler.phases` times and records them);
- communication: the records of :attr:`VerlProfiler.recorder` (a
  :class:`~verl_comm.telemetry.CommRecorder` the trainer hands to the comm hooks, the
  reducer and the resharding executor) plus torch's own records from the profiler:
  ``gloo:*`` work events on CPU and NCCL kernels on CUDA
  (:mod:`~verl_comm.profiler.torch_events`);
- device kernels (CUDA) for exposed communication and idle gaps; rollout latencies;
- the profiler's own bookkeeping time (reported as overhead).

On ``stop()`` each rank writes ``OUTPUT_DIR/profile_rank{r}.json`` (read by
``verl-comm profile report OUTPUT_DIR``) and ``OUTPUT_DIR/trace_rank{r}.json`` (Chrome trace,
open in chrome://tracing or Perfetto); with ``record_memory`` on CUDA also
``memory_snapshot_rank{r}.pickle`` (``torch.cuda.memory`` snapshot, open at
pytorch.org/memory_viz).

Disabled (``enabled=False`` or a step outside ``steps``), ``phase()`` returns one shared
no-op context manager and ``step()`` only counts: no timing, no allocation, no sync.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from verl_comm.profiler.phases import NULL_PHASE, Phase
from verl_comm.profiler.torch_events import ANCHOR, torch_events
from verl_comm.telemetry import CommRecorder, rss_bytes

FORMAT_VERSION = 1


def check_output_dir(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot hold profiler output (None when it can): it must be a writable
    folder, or not exist yet below a writable folder."""
    p = Path(path).expanduser().absolute()
    if p.exists():
        if not p.is_dir():
            return f"{p} exists and is not a folder"
        return None if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable"
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"{p} cannot be created: {parent} is not a writable folder"
    return None


class VerlProfiler:
    """Profiler of a training loop made of named phases.

    Args:
        record_memory: sample allocated/reserved memory (CUDA; RSS on CPU) at phase
            boundaries and keep each phase's peak; on CUDA also record the allocator
            history and dump a ``torch.cuda.memory`` snapshot at ``stop()``.
        record_communication: keep the records of :attr:`recorder` and torch's own
            communication events.
        output_dir: folder for ``profile_rank{r}.json`` and ``trace_rank{r}.json``.
        enabled: False makes every method a no-op (zero overhead).
        steps: step indices (0-based, counted by ``step()``) to profile; None or empty =
            every step.
        recorder: a :class:`CommRecorder` to read; None creates one (enabled iff
            ``record_communication``); pass :attr:`recorder` to hooks/reducer/reshard.
        torch_profiler: run ``torch.profiler`` (Chrome trace, torch's comm and kernel
            events); False keeps only phases, steps, memory and the recorder.
        cuda_sync: synchronise CUDA at phase boundaries (exact phase times on GPU).
        sync_ranks: when distributed, align ranks with a one-element all_reduce when
            profiling (re)starts, so per-rank start-up skew is not measured as a wait.
        rank, world_size: default from ``torch.distributed`` when initialised, else 0/1.
        record_shapes: torch.profiler's ``record_shapes`` (None: on without CUDA, where it
            gives the bytes of gloo's collectives; NCCL kernels carry theirs anyway).
        keep_kernels: write every device kernel into ``profile_rank{r}.json``; by default
            only their summary (idle gaps by phase, exposed communication, busy time, top
            kernels; see :func:`~verl_comm.profiler.analysis.device_summary`) is kept, since
            a PPO step launches ~10^5 kernels. The Chrome trace keeps them all anyway.

    Raises:
        ValueError: on a negative step index, or an ``output_dir`` that cannot be written
            (checked when enabled).
    """

    def __init__(
        self,
        record_memory: bool = True,
        record_communication: bool = True,
        output_dir: str | os.PathLike = "./profile_logs",
        *,
        enabled: bool = True,
        steps: Iterable[int] | None = None,
        recorder: CommRecorder | None = None,
        torch_profiler: bool = True,
        cuda_sync: bool = True,
        sync_ranks: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        keep_kernels: bool = False,
        record_shapes: bool | None = None,
    ) -> None:
        self.enabled = bool(enabled)
        self.record_memory = bool(record_memory)
        self.record_communication = bool(record_communication)
        self.output_dir = Path(output_dir)
        self.steps = sorted({int(s) for s in steps}) if steps else None  # None/[] = all
        if self.steps is not None and any(s < 0 for s in self.steps):
            raise ValueError(f"profiler steps must be >= 0, got {self.steps}")
        problem = check_output_dir(self.output_dir) if self.enabled else None
        if problem:
            raise ValueError(f"profiler output_dir: {problem}; pass a writable folder")
        self.recorder = (
            recorder
            if recorder is not None
            else CommRecorder(enabled=self.enabled and self.record_communication)
        )
        self.use_torch_profiler = torch_profiler
        self._cuda = torch.cuda.is_available()
        self._cuda_sync_opt = cuda_sync
        self.sync_ranks = sync_ranks
        self._rank, self._world = rank, world_size
        self.keep_kernels = bool(keep_kernels)
        self.record_shapes = record_shapes
        self._wall: list[dict] = []  # every step's wall time, profiled or not
        self._step = 0
        self._started = self._stopped = False
        self._active = False
        self._torch_prof: Any = None
        self._stack: list[Phase] = []
        self._phases: list[dict] = []
        self._steps: list[dict] = []
        self._memory: list[dict] = []
        self._rollouts: list[dict] = []
        self._step_t0 = 0.0
        self._overhead_s = 0.0
        self._anchor_offset: float | None = None
        self._torch_events: dict[str, list] = {"comm": [], "kernels": []}
        self._trace_written = False
        self._anchor_t = 0.0
        self._rec_start = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls, cfg: Any, *, recorder: CommRecorder | None = None, rank: int | None = None
    ) -> VerlProfiler:
        """Build from a config section (mapping or object) with ``enable``, ``steps``,
        ``output_dir`` and optionally ``record_memory``, ``record_communication``,
        ``torch_profiler``, ``cuda_sync``. None gives a disabled profiler."""
        if cfg is None:
            return cls(enabled=False)

        def get(key: str, default: Any) -> Any:
            if isinstance(cfg, Mapping):
                return cfg.get(key, default)
            return getattr(cfg, key, default)

        return cls(
            record_memory=get("record_memory", True),
            record_communication=get("record_communication", True),
            output_dir=get("output_dir", "./profile_logs"),
            enabled=bool(get("enable", get("enabled", False))),
            steps=get("steps", None),
            recorder=recorder,
            torch_profiler=get("torch_profiler", True),
            cuda_sync=get("cuda_sync", True),
            sync_ranks=get("sync_ranks", True),
            keep_kernels=get("keep_kernels", False),
            record_shapes=get("record_shapes", None),
            rank=rank,
        )

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """True while the current step is being profiled."""
        return self._active

    @property
    def step_index(self) -> int:
        """Index of the current step (number of ``step()`` calls since ``start()``)."""
        return self._step

    @property
    def _cuda_sync(self) -> bool:
        return self._cuda and self._cuda_sync_opt

    def _want(self, step: int) -> bool:
        return self.enabled and (self.steps is None or step in self.steps)

    def _mem_sample(self) -> dict[str, int]:
        if self._cuda:
            return {
                "allocated": int(torch.cuda.memory_allocated()),
                "reserved": int(torch.cuda.memory_reserved()),
            }
        rss = rss_bytes()
        return {"allocated": rss, "reserved": rss}

    # ------------------------------------------------------------------ lifecycle
    def start(self, first_step: int = 0) -> VerlProfiler:
        """Begin step ``first_step`` (profiling it if it is wanted). Idempotent.

        ``first_step`` numbers the steps as the caller's log does: the trainer passes its
        next step number, so ``steps`` and the report speak of the same steps, also after
        a resume.

        Raises:
            ValueError: a negative ``first_step``.
        """
        if not self.enabled or self._started:
            return self
        if first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {first_step}")
        self._started = True
        self._step = int(first_step)
        dist = torch.distributed
        ready = dist.is_available() and dist.is_initialized()
        if self._rank is None:
            self._rank = dist.get_rank() if ready else 0
        if self._world is None:
            self._world = dist.get_world_size() if ready else 1
        self._rec_start = len(self.recorder.records)
        self._run_id = self._shared_run_id()
        if self._want(self._step):
            self._activate()
        self._step_t0 = time.perf_counter()  # after torch.profiler's start-up
        return self

    def _activate(self) -> None:
        self._active = True
        if self.use_torch_profiler and self._torch_prof is None and not self._stopped:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            if self._cuda and self.record_memory:
                try:
                    torch.cuda.memory._record_memory_history(
                        context="alloc", stacks="python", max_entries=100_000
                    )
                except Exception:  # noqa: BLE001 - optional feature
                    pass
            shapes = self.record_shapes
            if shapes is None:  # gloo's work events need shapes for their bytes
                shapes = not self._cuda
            self._torch_prof = torch.profiler.profile(activities=acts, record_shapes=shapes)
            self._torch_prof.__enter__()
            with torch.profiler.record_function(ANCHOR):
                self._anchor_t = time.perf_counter()
        self._align_ranks()

    def _shared_run_id(self) -> int:
        """A random id for this run, rank 0's on every rank (one small all_reduce when
        distributed): the report refuses to mix ``profile_rank*.json`` of different runs."""
        rid = int.from_bytes(os.urandom(6), "little")
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return rid
        dev = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([rid if dist.get_rank() == 0 else 0], dtype=torch.int64, device=dev)
        dist.all_reduce(t)
        return int(t.item())

    def _align_ranks(self) -> None:
        """One-element all_reduce so that ranks enter the profiled step together: the
        profiler's start-up time differs per rank and would otherwise show up as a
        collective wait in the first step. Skipped when not distributed or ``sync_ranks``
        is False."""
        dist = torch.distributed
        if not self.sync_ranks or not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size() == 1:
            return
        dev = "cpu"
        if dist.get_backend() == "nccl":
            dev = f"cuda:{torch.cuda.current_device()}"
        dist.all_reduce(torch.zeros(1, device=dev))
        if self._cuda_sync:
            torch.cuda.synchronize()

    def step(self) -> None:
        """Close the current step and begin the next one."""
        if not self.enabled or not self._started or self._stopped:
            self._step += 1
            return
        t = time.perf_counter()
        if self._cuda_sync:  # also unprofiled steps: their times are the overhead baseline
            torch.cuda.synchronize()
            t = time.perf_counter()
        if self._active:
            self._steps.append({"step": self._step, "t0": self._step_t0, "t1": t})
        self._note_wall(t - self._step_t0)
        self._step += 1
        self._step_t0 = t
        want = self._want(self._step)
        if self._active and not want:
            self._active = False
            if self.steps is not None and self._step > self.steps[-1]:
                self._stop_torch()
        elif want and not self._active:
            self._activate()
        # the next step starts after the trace export / torch.profiler's start-up
        self._step_t0 = time.perf_counter()
        self._overhead_s += self._step_t0 - t

    def _note_wall(self, seconds: float) -> None:
        """Keep the wall times the profiling-cost baseline needs, in bounded memory: the
        first step, the latest step before profiling, the profiled steps and the first
        unprofiled step after them (see ``analysis._in_step_overhead``)."""
        entry = {"step": self._step, "s": seconds, "profiled": self._active}
        wall = self._wall
        if self.steps is not None and self._step > self.steps[-1] + 1:
            return  # profiling is over and its follow-up step is kept
        if not self._active and len(wall) >= 2 and not any(w["profiled"] for w in wall):
            wall[-1] = entry  # before profiling: only the first and the latest step
        else:
            wall.append(entry)

    def phase(self, name: str) -> AbstractContextManager:
        """Context manager timing one named phase of the current step (no-op when inactive).

        Phase names of the PPO trainer: gen, reshard, reward, old_log_prob, ref, values,
        update_critic, update_actor (any name is accepted; nesting is allowed).
        """
        if not self._active:
            return NULL_PHASE
        return Phase(name, self)

    def record_rollout(self, latency_s: float, batch_size: int | None = None) -> None:
        """Record the latency (seconds) of one rollout batch; when none are recorded the
        report uses the durations of the ``gen`` phases."""
        if self._active:
            self._rollouts.append(
                {"step": self._step, "latency_s": float(latency_s), "batch_size": batch_size}
            )

    def _trace_path(self) -> Path:
        return self.output_dir / f"trace_rank{self._rank}.json"

    def _stop_torch(self) -> None:
        """Stop torch.profiler, write the Chrome trace and read events back from it."""
        if self._torch_prof is None or self._trace_written:
            return
        self._torch_prof.__exit__(None, None, None)
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._torch_prof.export_chrome_trace(str(self._trace_path()))
        except OSError as exc:  # never end a training run over a trace
            warnings.warn(
                f"profiler: could not write the Chrome trace to {self.output_dir}: {exc}; "
                "torch's events are lost, training goes on",
                stacklevel=3,
            )
            self._torch_prof = None
            return
        self._trace_written = True
        self._collect_torch_events(json.loads(self._trace_path().read_text()))

    def _collect_torch_events(self, trace: dict) -> None:
        """Comm events and device activity of a Chrome trace (:func:`torch_events`)."""
        found = torch_events(trace, self._anchor_t)
        if found is not None:
            self._anchor_offset, comm, kernels = found
            self._torch_events["comm"] += comm
            self._torch_events["kernels"] += kernels

    def stop(self) -> Path | None:
        """Close profiling, write ``profile_rank{r}.json`` and the Chrome trace.

        Returns the path of the profile JSON (None when disabled or nothing was recorded).
        """
        if not self.enabled or not self._started or self._stopped:
            return None
        while self._stack:  # phases left open by an exception
            self._stack[-1].__exit__(None, None, None)
        t = time.perf_counter()
        if self._active and any(p["step"] == self._step for p in self._phases):
            self._steps.append({"step": self._step, "t0": self._step_t0, "t1": t})
        self._active = False
        self._stopped = True
        try:
            self._stop_torch()
            if self._torch_prof is not None and self._cuda and self.record_memory:
                try:
                    torch.cuda.memory._dump_snapshot(
                        str(self.output_dir / f"memory_snapshot_rank{self._rank}.pickle")
                    )
                    torch.cuda.memory._record_memory_history(enabled=None)
                except Exception:  # noqa: BLE001 - optional feature
                    pass
            self._overhead_s += time.perf_counter() - t
            if not self._steps:
                warnings.warn(
                    f"profiler: no step was profiled (steps {self.steps}, last step "
                    f"{self._step}); nothing written to {self.output_dir}",
                    stacklevel=2,
                )
                return None
            self.output_dir.mkdir(parents=True, exist_ok=True)
            path = self.output_dir / f"profile_rank{self._rank}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.to_dict()))
            os.replace(tmp, path)  # a reader never sees half a file
            return path
        except OSError as exc:  # the training run must survive a profiler that cannot write
            warnings.warn(
                f"profiler: could not write to output_dir {self.output_dir}: {exc}; "
                "profile lost, training goes on",
                stacklevel=2,
            )
            return None

    def export_chrome_trace(self, path: str | os.PathLike) -> Path:
        """Write torch.profiler's Chrome trace (JSON, chrome://tracing / Perfetto).

        Raises:
            RuntimeError: when torch.profiler did not run (disabled, ``torch_profiler=False``
                or not stopped yet).
        """
        if not self._trace_written:
            raise RuntimeError(
                "export_chrome_trace needs a stopped profiler that ran torch.profiler "
                "(enabled=True, torch_profiler=True, profiled steps, then stop())"
            )
        p = Path(path)
        if p.resolve() != self._trace_path().resolve():
            p.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self._trace_path(), p)
        return p

    def to_dict(self) -> dict:
        """Everything recorded, as written to ``profile_rank{r}.json``."""
        comm = []
        if self.record_communication:
            comm = [r.to_dict() for r in self.recorder.records[self._rec_start :]]
        return {
            "format": FORMAT_VERSION,
            "meta": {
                "rank": self._rank,
                "world_size": self._world,
                "run_id": getattr(self, "_run_id", None),
                "device": torch.cuda.get_device_name() if self._cuda else "cpu",
                "cuda": self._cuda,
                "torch": torch.__version__,
                "steps_requested": self.steps,
                "torch_profiler": self._anchor_offset is not None,
                "trace": self._trace_path().name if self._trace_written else None,
                "cuda_sync": self._cuda_sync,
                "record_memory": self.record_memory,
                "record_communication": self.record_communication,
                "overhead_s": self._overhead_s,
            },
            "steps": self._steps,
            "phases": self._phases,
            "comm": comm,
            "torch_comm": self._torch_events["comm"] if self.record_communication else [],
            "kernels": self._torch_events["kernels"] if self.keep_kernels else [],
            "device": self._device_summary(),
            "step_wall": self._wall,
            "memory": self._memory,
            "rollouts": self._rollouts,
        }

    def _device_summary(self) -> dict | None:
        """Summary of the device timeline over the profiled steps (None without kernels)."""
        kernels = self._torch_events["kernels"]
        if not kernels:
            return None
        from verl_comm.profiler.analysis import _comm_intervals, device_summary

        comm_iv, _ = _comm_intervals({"torch_comm": self._torch_events["comm"], "comm": []})
        windows = [(s["t0"], s["t1"]) for s in self._steps]
        top = [p for p in self._phases if p.get("depth", 0) == 0]
        return device_summary(kernels, comm_iv, windows, top)

    def __enter__(self) -> VerlProfiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
