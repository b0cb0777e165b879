"""Run logging: one small logger, a JSONL metrics file and a timing helper.

Metric keys carry namespaces and units (``timing_s/gen``, ``perf/throughput_tokens_per_s``,
``reward/mean``); the JSONL file holds one object per logged step.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def get_logger(rank: int) -> logging.Logger:
    """A logger that prints ``[rank r] message`` to stderr (INFO on rank 0, WARNING elsewhere)."""
    log = logging.getLogger("verl_ppo")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return log


class PhaseTimer:
    """Wall time per named phase of a step, reported as ``timing_s/<phase>``.

    ``profiler`` (optional) is any object with a ``phase(name)`` context manager (e.g.
    ``verl_comm.profiler.VerlProfiler``); its ranges then match these timings.
    """

    def __init__(self, profiler: Any = None, sync_cuda: bool = False) -> None:
        self.times: dict[str, float] = {}
        self.profiler = profiler
        self.sync_cuda = sync_cuda

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as phase ``name`` (accumulates if entered twice)."""
        if self.sync_cuda:
            import torch

            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self.profiler is not None:
            with self.profiler.phase(name):
                yield
        else:
            yield
        if self.sync_cuda:
            import torch

            torch.cuda.synchronize()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """``{"timing_s/<phase>": seconds}`` and ``timing_s/step`` (their sum)."""
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        out["timing_s/step"] = sum(self.times.values())
        return out


class MetricsWriter:
    """Appends one JSON object per call to ``run_dir/metrics.jsonl`` (rank 0 only)."""

    def __init__(self, run_dir: str | Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (on resume: those steps run again), atomically."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(self.path)

    def write(self, record: dict[str, Any]) -> None:
        """Write ``record`` (non-finite floats become null)."""
        if not self.enabled:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")


def format_line(step: int, m: dict[str, float]) -> str:
    """The human log line of a step: reward, eval, KL, entropy, clip, value loss, length, speed, phases."""
    keys = [
        ("reward", "reward/mean"),
        ("eval", "eval/reward"),
        ("kl", "actor/kl"),
        ("ent", "actor/entropy"),
        ("clip", "actor/pg_clipfrac"),
        ("vf_loss", "critic/vf_loss"),
        ("resp_len", "response/length_mean"),
        ("tok/s", "perf/throughput_tokens_per_s"),
    ]
    parts = [f"step {step}"]
    for label, k in keys:
        if k in m and m[k] is not None:
            parts.append(f"{label} {m[k]:.4g}")
    phases = [
        f"{k.split('/', 1)[1]} {v:.2f}s"
        for k, v in m.items()
        if k.startswith("timing_s/") and k != "timing_s/step"
    ]
    return " | ".join(parts) + (" | " + " ".join(phases) if phases else "")
