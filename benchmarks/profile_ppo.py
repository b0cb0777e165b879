"""Profile PPO steps with :class:`verl_comm.profiler.VerlProfiler` and write its report.

Issue 9's evidence: the PPO job (``verl_ppo.PPOTrainer``, DeepSpeed engines, the run set up
as in ``benchmarks/ppo_throughput.py``: Qwen2.5-0.5B shape with random weights, fixed-length
prompts and responses) runs ``--warmup`` untimed steps and ``--steps`` profiled steps with
``profiler.enable=true``; rank 0 then writes ``report.txt``, ``report.json`` and ``report.png``
(``verl-comm profile report RUN --save``) into ``OUT/profile/<name>/`` next to the per-rank
``profile_rank*.json`` and appends the run's headline numbers (step time P50/P99,
communication share of the step and of backward, exposed communication, symptoms found) to
``OUT/profile_ppo.jsonl``; ``--compare`` writes ``OUT/profile_ppo.md``, one row per run.

The profiler's per-rank Chrome traces (``trace_rank*.json``) and CUDA memory snapshots are
large; they stay in ``OUT/profile/<name>/`` and are not committed (``--keep-traces`` keeps
them; otherwise they are deleted after the report is written).

Usage::

    python benchmarks/profile_ppo.py --smoke --out /tmp/prof            # CPU, tiny, < 2 min
    torchrun --nproc_per_node=2 benchmarks/profile_ppo.py --model-dir .whl/tok \
        --name h200x2_socket_none --set gradient_compression=none --out OUT
    python benchmarks/profile_ppo.py --compare --out OUT
    (benchmarks/gpu/profile_ppo.sh OUTDIR runs none then int8 over sockets on the GPUs)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark module
import ppo_throughput as pt  # noqa: E402
from _ppo_env import _dirty  # noqa: E402

BENCH = "profile_ppo"
HEADLINE = (
    ("timing_s/step_p50", "s"),
    ("timing_s/step_p99", "s"),
    ("comm/time_s_per_step", "s"),
    ("comm/share_of_step", "fraction"),
    ("comm/share_of_backward", "fraction"),
    ("comm/exposed_share_of_step", "fraction"),
    ("comm/bytes_total", "bytes"),
    ("comm/torch_input_bytes", "bytes"),
    ("perf/gpu_idle_share", "fraction"),
    ("rollout/latency_s_p99", "s"),
    ("profile/overhead_share", "fraction"),
)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3+2 steps, for CI")
    p.add_argument(
        "--out", default=None,
        help="output folder (default: benchmarks/results; with --smoke a temporary folder)",
    )  # fmt: skip
    p.add_argument("--name", default=None, help="run name (default: device_compression)")
    pt.add_workload_args(p)
    p.add_argument(
        "--warmup", type=int, default=3,
        help="unprofiled steps first (>= 3: compression starts after start_iter=2 reductions "
        "and the last warm-up step is the baseline of the profiling cost)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--keep-traces", action="store_true", help="keep Chrome traces/snapshots")
    p.add_argument("--compare", action="store_true", help="only write OUT/profile_ppo.md")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.prompt_len, a.response_len = "tiny", 16, 8
        a.rollout_batch, a.micro_batch, a.warmup, a.steps = 4, 2, 3, 2
    if a.out is None:
        a.out = (
            tempfile.mkdtemp(prefix="profile_ppo_smoke_")
            if a.smoke
            else str(pt.REPO / "benchmarks" / "results")
        )
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return a


def _records(name: str, doc: dict, s: pt.Setup, world: int, overrides: dict) -> list[dict]:
    """One JSON record per headline metric of a run's report document."""
    flat, found = doc["flat"], doc["diagnosis"]["found"]
    base = {
        "benchmark": BENCH,
        "run": name,
        "device": pt._device(world),
        "world_size": world,
        "versions": pt._versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": pt._commit(),
        "dirty": _dirty(),
        "shape": s.shape,
        "prompt_len": s.prompt_len,
        "response_len": s.response_len,
        "rollout_batch": s.rollout_batch,
        "micro_batch": s.micro_batch,
        "profiled_steps": s.steps,
        "overrides": overrides,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        "symptoms_found": found,
    }
    return [
        {**base, "metric": key, "value": flat[key], "unit": unit}
        for key, unit in HEADLINE
        if key in flat
    ]


def profile_run(a: argparse.Namespace) -> Path:
    """Run the profiled PPO steps, then (rank 0) the report; returns the run folder."""
    from verl_comm.profiler.cli import main as report_main
    from verl_ppo.config import parse_overrides

    overrides = pt._flatten(parse_overrides(a.set))
    comp = overrides.get("gradient_compression", overrides.get("compression.gradient_compression"))
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    name = a.name or f"{kind}x{world_env}_{comp or 'none'}"
    run_dir = Path(a.out).resolve() / "profile" / name
    s = pt.Setup.from_args(a)
    s.overrides = {
        **overrides,
        "profiler.enable": True,
        "profiler.steps": list(range(a.warmup + 1, a.warmup + a.steps + 1)),  # log numbering
        "profiler.output_dir": str(run_dir),
    }
    rank, _ = pt._rank_world()
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in run_dir.glob("*"):  # a rerun under the same name replaces the run
            _rmtree(old) if old.is_dir() else old.unlink()
    env = dict(os.environ)
    pt.run_verl(s, str(run_dir / "_run"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for k in set(os.environ) - set(env):  # the trainer's own one-rank group, if it made one
        del os.environ[k]
    if rank == 0:
        _wait_for_ranks(run_dir, world)
        # relative, so that no path of this machine lands in a committed report
        if report_main(["report", os.path.relpath(run_dir), "--save"]) != 0:
            raise RuntimeError(f"verl-comm profile report {run_dir} failed")
        doc = json.loads((run_dir / "report.json").read_text())
        with open(Path(a.out) / f"{BENCH}.jsonl", "a") as f:
            for rec in _records(name, doc, s, world, overrides):
                f.write(json.dumps(rec) + "\n")
        if not a.keep_traces:
            for f in [*run_dir.glob("trace_rank*.json"), *run_dir.glob("memory_snapshot_*")]:
                f.unlink()
        _rmtree(run_dir / "_run")
    return run_dir


def _wait_for_ranks(run_dir: Path, world: int, timeout_s: float = 300.0) -> None:
    """Wait until every rank's ``profile_rank{r}.json`` exists (the trainer tears its
    process group down in ``close()``, so no barrier is left; the profiler writes each
    file atomically). Raises TimeoutError naming the missing ranks."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(world) if not (run_dir / f"profile_rank{r}.json").exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_dir}: no profile from ranks {missing} after {timeout_s} s")
        time.sleep(0.2)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def compare(out: Path) -> str:
    """Markdown table of the newest record set of each run in ``out/profile_ppo.jsonl``;
    written to ``out/profile_ppo.md`` and returned."""
    recs = [json.loads(x) for x in (out / f"{BENCH}.jsonl").read_text().splitlines() if x]
    runs: dict[str, dict[str, Any]] = {}
    for r in recs:  # later records of a run replace earlier ones
        runs.setdefault(r["run"], {})[r["metric"]] = r
    lines = [
        "# PPO step profile (verl_comm.profiler)",
        "",
        "| run | device | step P50 s | P99 s | comm s/step | comm share | of backward "
        "| exposed | GPU idle | symptoms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def v(d: dict, k: str, pct: bool = False) -> str:
        if k not in d:
            return "n/a"
        x = d[k]["value"]
        return f"{x:.0%}" if pct else f"{x:.3f}"

    for name, d in runs.items():
        any_rec = next(iter(d.values()))
        found = ", ".join(str(i) for i in any_rec["symptoms_found"]) or "none"
        lines.append(
            f"| {name} | {any_rec['device']} | {v(d, 'timing_s/step_p50')} "
            f"| {v(d, 'timing_s/step_p99')} | {v(d, 'comm/time_s_per_step')} "
            f"| {v(d, 'comm/share_of_step', True)} | {v(d, 'comm/share_of_backward', True)} "
            f"| {v(d, 'comm/exposed_share_of_step', True)} | {v(d, 'perf/gpu_idle_share', True)} "
            f"| {found} |"
        )
    lines += [
        "",
        "Symptoms: 1 step-time jitter, 2 accelerator idle while the host works, "
        "3 communication-bound, 4 slow rollout tail. Each run's `profile/<run>/report.txt` "
        "holds the full table, the evidence and the remedy.",
    ]
    text = "\n".join(lines) + "\n"
    (out / f"{BENCH}.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    a = _args(argv)
    out = Path(a.out)
    if a.compare:
        print(compare(out))
        return 0
    profile_run(a)  # rank 0 prints the report
    if pt._rank_world()[0] == 0:
        compare(out)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
