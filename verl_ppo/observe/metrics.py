"""Run logging: one small logger, a JSONL metrics file and the phase timer
(:class:`verl_comm.profiler.phases.PhaseTimer`, the one phase timer, re-exported here).

Metric keys carry namespaces and units (``timing_s/gen``, ``perf/throughput_tokens_per_s``,
``reward/mean``); the JSONL file holds one object per logged step.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from verl_comm.profiler.phases import PhaseTimer as PhaseTimer  # re-export


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


def progress_bar(total: int, desc: str, initial: int = 0, enabled: bool = True) -> Any:
    """A ``tqdm`` bar on stderr when stderr is a terminal; disabled otherwise (a log file or
    a pipe would keep every ``\r`` redraw as a fragment), so lines written through
    ``tqdm.write`` stay plain."""
    from tqdm import tqdm

    on = enabled and sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, disable=not on, dynamic_ncols=True)


class MetricsWriter:
    """One JSON object per step in ``run_dir/metrics.jsonl`` (rank 0 only).

    The file never holds two rows of one step: a row for a step already in the file (the
    step-0 eval, a step repeated after a resume) replaces the old row in place (the file is
    rewritten atomically), every other row is appended.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._steps: set[Any] = {r.get("step") for r in self._read()}

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        tmp.replace(self.path)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (on resume: those steps run again), atomically."""
        if not self.path.is_file():
            return
        keep = [r for r in self._read() if r.get("step", 0) <= step]
        self._rewrite(keep)
        self._steps = {r.get("step") for r in keep}

    def write(self, record: dict[str, Any]) -> None:
        """Write ``record`` (non-finite floats become null), replacing a row of its step."""
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        step = clean.get("step")
        if step in self._steps:
            self._rewrite([clean if r.get("step") == step else r for r in self._read()])
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._steps.add(step)


def format_line(step: int, m: dict[str, float], comm_method: str | None = None) -> str:
    """The human log line of a step: reward, eval, KL, entropy, clip, value loss, length, speed,
    compression (method and ratio per role, see :func:`verl_ppo.observe.report.comm_part`), phases."""
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
    if comm_method is not None and "reward/mean" in m:  # a training step
        from verl_ppo.observe.report import comm_part

        parts.append(comm_part(m, comm_method))
    return " | ".join(parts) + (" | " + " ".join(phases) if phases else "")
