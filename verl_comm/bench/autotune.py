"""Pick the fastest NCCL preset at the user's message sizes, by measurement.

NCCL reads its environment once, at communicator init, so each candidate preset runs in
its own processes: for every preset, ``verl-comm bench allreduce`` (``verl_comm.bench``,
nccl-tests layout) is started as a subprocess with the preset applied to a copy of the
environment (:func:`verl_comm.nccl.apply_preset`: the user's own variables still win, as in
a real run). The sweep goes from the smallest to the largest requested size by factors of 2;
each requested size is read at the nearest measured size (log scale). The fastest preset per
size is the one with the lowest median time (``time_us_p50``); the recommendation is the
preset that wins most sizes (ties: lowest summed median time).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verl_comm.nccl.presets import PRESETS, apply_preset


@dataclass
class PresetResult:
    """One preset's measurements.

    Attributes:
        preset: preset name.
        ok: the benchmark ran and every check passed.
        by_size: requested bytes -> ``{"measured_bytes", "time_us", "busbw_GBps"}``.
        error: why it failed (exit code and the tail of its output).
        wall_s: seconds the subprocess took.
    """

    preset: str
    ok: bool
    by_size: dict[int, dict] = field(default_factory=dict)
    error: str = ""
    wall_s: float = 0.0


@dataclass
class AutotuneReport:
    """Results of :func:`autotune`: per preset, the fastest per size, and the pick."""

    sizes: list[int]
    backend: str
    nproc: int
    results: list[PresetResult]
    fastest: dict[int, str]
    recommended: str | None

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict."""
        return asdict(self)


def _nearest(records: list[dict], size: int) -> dict | None:
    if not records:
        return None
    return min(records, key=lambda r: abs(math.log2(max(r["bytes"], 1)) - math.log2(size)))


def run_preset(
    preset: str,
    sizes: list[int],
    nproc: int,
    backend: str,
    iters: int,
    warmup: int,
    timeout_s: float,
    env: dict[str, str] | None = None,
) -> PresetResult:
    """Benchmark all-reduce (fp32, out-of-place) under ``preset`` in ``nproc`` fresh processes.

    Args:
        preset: a name from :data:`PRESETS`.
        sizes: message sizes in bytes (positive).
        nproc, backend: processes to spawn and ``"nccl"``/``"gloo"``.
        iters, warmup: timed and warm-up iterations per size.
        timeout_s: deadline of the whole subprocess (also passed as its launch timeout).
        env: base environment (default ``os.environ``); not modified.
    """
    import time

    child_env = dict(os.environ if env is None else env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the user's own settings win, as in a real run
        apply_preset(preset, child_env)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "bench.jsonl"
        cmd = [sys.executable, "-m", "verl_comm.cli", "bench", "allreduce", "--nproc",
               str(nproc), "--backend", backend, "-b", str(min(sizes)), "-e", str(max(sizes)),
               "-f", "2", "-n", str(iters), "-w", str(warmup), "--outplace", "--timeout",
               str(max(1.0, timeout_s / 2)), "--launch-timeout", str(timeout_s), "--jsonl",
               str(jsonl)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=child_env, capture_output=True, text=True,
                               timeout=timeout_s + 30)  # fmt: skip
        except subprocess.TimeoutExpired:
            return PresetResult(preset, False, error=f"no result within {timeout_s + 30:g} s")
        wall = time.perf_counter() - t0
        if p.returncode != 0 or not jsonl.exists():
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:])
            return PresetResult(preset, False, error=f"exit {p.returncode}: {tail}", wall_s=wall)
        from verl_comm.bench import report

        recs = [r for r in report.measurements(report.read_jsonl(jsonl))
                if r.get("collective") == "all_reduce"]  # fmt: skip
    out = PresetResult(preset, ok=all(not r.get("wrong") for r in recs), wall_s=wall)
    for s in sizes:
        r = _nearest(recs, s)
        if r is not None:
            out.by_size[s] = {"measured_bytes": r["bytes"], "time_us": r["time_us_p50"],
                              "busbw_GBps": r["busbw"]}  # fmt: skip
    if not out.ok:
        out.error = "the benchmark's correctness check found wrong elements"
    return out


def autotune(
    sizes: list[int],
    presets: list[str] | None = None,
    nproc: int = 2,
    backend: str = "nccl",
    iters: int = 20,
    warmup: int = 5,
    timeout_s: float = 300.0,
) -> AutotuneReport:
    """Run :func:`run_preset` for each candidate and pick the fastest per size.

    Raises:
        ValueError: empty or non-positive sizes, unknown preset names (listed), nproc < 2.
    """
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"--sizes must be positive byte counts, got {sizes}")
    presets = list(PRESETS) if presets is None else presets
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise ValueError(f"unknown presets {unknown}; choose from {', '.join(PRESETS)}")
    if nproc < 2:
        raise ValueError(f"--nproc must be >= 2 to time a collective, got {nproc}")
    results = [run_preset(p, sizes, nproc, backend, iters, warmup, timeout_s) for p in presets]
    fastest: dict[int, str] = {}
    for s in sizes:
        timed = [(r.by_size[s]["time_us"], r.preset) for r in results if r.ok and s in r.by_size]
        if timed:
            fastest[s] = min(timed)[1]
    wins = {p: sum(1 for v in fastest.values() if v == p) for p in presets}
    ok = [r for r in results if r.ok and r.by_size]
    recommended = None
    if ok:
        best = max(
            ok, key=lambda r: (wins[r.preset], -sum(v["time_us"] for v in r.by_size.values()))
        )
        recommended = best.preset
    return AutotuneReport(sorted(sizes), backend, nproc, results, fastest, recommended)


def format_report(rep: AutotuneReport) -> str:
    """Markdown table: one row per size, median time (us) and busbw (GB/s) per preset."""
    names = [r.preset for r in rep.results]
    lines = [
        f"# NCCL preset autotune: all_reduce fp32, {rep.nproc} processes, {rep.backend}",
        "",
        "| bytes | " + " | ".join(names) + " | fastest |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for s in rep.sizes:
        cells = []
        for r in rep.results:
            v = r.by_size.get(s)
            cells.append(f"{v['time_us']:.1f} us, {v['busbw_GBps']:.2f} GB/s" if v else "failed")
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {rep.fastest.get(s, '-')} |")
    for r in rep.results:
        if not r.ok:
            lines.append(f"\n{r.preset} failed: {r.error}")
    lines.append(f"\nrecommended: {rep.recommended or 'none (every preset failed)'}")
    return "\n".join(lines)
