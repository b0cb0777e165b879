"""The CPU default job before and after a change, side by side (issue 15: "must not get slower").

Protocol: two checkouts (``--base`` and ``--new``) run ``python -m verl_ppo.train --config
configs/default.yaml`` with the same overrides (default: ``train.num_steps=2
data.eval_size=4``, each its own fresh ``run_dir``), interleaved base, new, base, new, ... for
``--rounds`` rounds, so that load from other users of a shared CPU falls on both alike. Wall
time per run (launch to exit: model load, eval, steps, checkpoint) and the per-step
``timing_s/step`` from each run's ``metrics.jsonl`` are recorded; the markdown is generated
from the records. Numerics: each run must exit 0 and log finite step metrics.

Usage::

    python benchmarks/default_job_ab.py --base ../base_checkout --new . --out benchmarks/results
    python benchmarks/default_job_ab.py --report --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = "default_job_ab"


def dirty(repo: Path) -> bool | None:
    """Uncommitted changes in ``repo`` (``verl_comm.bench.env.dirty``)."""
    from verl_comm.bench.env import dirty as tree_dirty

    return tree_dirty(repo)


def _commit(repo: Path) -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True)
    return r.stdout.decode().strip() or "unknown"


def run_once(repo: Path, overrides: list[str], timeout_s: float) -> dict:
    """One default job in ``repo``; returns wall seconds, step times and the exit status."""
    with tempfile.TemporaryDirectory(prefix="default_job_") as run_dir:
        cmd = [sys.executable, "-m", "verl_ppo.train", "--config", "configs/default.yaml"]
        cmd += [*overrides, f"run_dir={run_dir}"]
        env = {**os.environ, "PYTHONPATH": str(repo)}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
        steps = []
        mfile = Path(run_dir) / "metrics.jsonl"
        if mfile.is_file():
            for line in mfile.read_text().splitlines():
                rec = json.loads(line)
                if "timing_s/step" in rec:
                    steps.append(rec["timing_s/step"])
    ok = proc.returncode == 0 and bool(steps) and all(math.isfinite(s) for s in steps)
    return {"wall_s": wall, "step_s": steps, "rc": proc.returncode, "ok": ok}


def main(argv: list[str] | None = None) -> int:
    """Entry point; 0 when every run succeeded."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, help="checkout before the change")
    p.add_argument("--new", type=Path, help="checkout after the change")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--report", action="store_true", help="only write the markdown")
    a = p.parse_args(argv)
    if a.report:
        write_report(a.out)
        return 0
    overrides = a.set or ["train.num_steps=2", "data.eval_size=4"]
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    status = 0
    a.out.mkdir(parents=True, exist_ok=True)
    for rnd in range(a.rounds):
        for side, repo in (("base", a.base), ("new", a.new)):
            res = run_once(repo.resolve(), overrides, a.timeout)
            status |= not res["ok"]
            rec = {
                "benchmark": BENCH,
                "metric": "wall_s",
                "value": res["wall_s"],
                "unit": "s",
                "side": side,
                "round": rnd,
                "step_s": res["step_s"],
                "numerics_ok": res["ok"],
                "overrides": overrides,
                "device": f"cpu ({os.cpu_count()} cores, shared with other users)",
                "versions": {"python": sys.version.split()[0]},
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "commit": _commit(repo),
                "dirty": dirty(repo),
                "run_id": run_id,
            }
            with open(a.out / f"{BENCH}.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec))
    write_report(a.out, run_id)
    return status


def write_report(out: Path, run_id: str | None = None) -> None:
    """``out/default_job_ab.md`` from the records of ``run_id`` (default: the last run)."""
    recs = [json.loads(x) for x in (out / f"{BENCH}.jsonl").read_text().splitlines() if x]
    run_id = run_id or recs[-1]["run_id"]
    recs = [r for r in recs if r["run_id"] == run_id]
    lines = [
        f"# {BENCH}",
        "",
        f"run_id `{run_id}`, {recs[0]['device']}; the default job with "
        f"`{' '.join(recs[0]['overrides'])}`, base and new interleaved per round.",
        "",
        "| round | side | commit | wall s | step s | ok |",
        "|---:|---|---|---:|---|---|",
    ]
    for r in recs:
        steps = ", ".join(f"{s:.1f}" for s in r["step_s"])
        lines.append(
            f"| {r['round']} | {r['side']} | {r['commit']} | {r['value']:.0f} | {steps} | "
            f"{r['numerics_ok']} |"
        )
    med = {
        side: statistics.median(r["value"] for r in recs if r["side"] == side)
        for side in ("base", "new")
        if any(r["side"] == side for r in recs)
    }
    steps = {
        side: statistics.median(x for r in recs if r["side"] == side for x in r["step_s"])
        for side in med
    }
    if len(med) == 2:
        lines.append(
            f"\nMedian wall time: base {med['base']:.0f} s, new {med['new']:.0f} s "
            f"(new / base = {med['new'] / med['base']:.2f}; < 1 is faster). Median step time: "
            f"base {steps['base']:.0f} s, new {steps['new']:.0f} s "
            f"(new / base = {steps['new'] / steps['base']:.2f})."
        )
    (out / f"{BENCH}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
