"""Convergence with each compression setting vs the uncompressed run (2 gloo ranks, CPU).

Task: teacher-student regression with a tiny MLP (32 -> 64 -> 64 -> 8, tanh), Adam 3e-3,
batch 32 per rank, different data per rank, DDP with the hook of each setting
(``test_hooks_ddp_worker.CONV_SETTINGS``), default ``start_iter=2``, error feedback on
unless the setting says otherwise. Metric: the evaluation MSE on 512 fixed points after the
last step. Margin, from the measured seed noise: with ``sigma`` the seed-to-seed standard
deviation of the uncompressed run's final loss and ``n`` seeds, the difference of two
``n``-seed means of runs that differ only by seed has standard deviation
``sigma * sqrt(2 / n)``; the margin is twice that. A setting passes when the mean over seeds
of its final loss is at most that margin above the uncompressed mean. (Compressed and
uncompressed runs share each seed's initialisation and data, so their difference is less
noisy than that: the margin errs on the side of passing.) Everything is seeded and
deterministic on the CPU, so a result does not change between runs of the same code.

* CI (``test_convergence_short``, the full run at a reduced size): 4 settings, 3 seeds, 120
  steps; int8 must be within the margin and low rank r4 without error feedback outside it,
  as in the full run (measured at 120 steps: seed std 1.2e-4, margin 2.0e-4, gap 9.3e-4
  without error feedback, 3.4e-4 with it: r4 has not caught up yet, so CI asserts that
  error feedback recovers most of the gap). With error feedback removed (the
  ``CompressionConfig.error_feedback`` default set to False) it fails: r4's gap is then
  9.26e-4, the same as without it, against the required < 4.63e-4. 63 s in pytest on the
  2-core machine at load average 13-16.
* Full measurement (marked ``slow``, runs with ``VERL_COMM_RUN_SLOW=1``, ~6 min on 2 cores;
  or run this file as a script): all settings, 5 seeds, 300 steps; the script writes ``benchmarks/results/convergence.jsonl`` and ``convergence.md``::

      .venv/bin/python tests/verl_comm/test_convergence.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "verl_comm_hooks_ddp_worker", Path(__file__).with_name("test_hooks_ddp_worker.py")
)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

ROOT = Path(__file__).resolve().parents[2]
SHORT_STEPS, SHORT_SEEDS = 120, 3


def measure(steps: int, seeds: int, settings: list[str], tmp: Path) -> dict:
    """Run the settings on 2 ranks; return ``{(setting, seed): rank-0 result}``.

    Raises:
        AssertionError: replicas ended different (every setting must keep them identical).
    """
    names = list(dict.fromkeys(["none", *settings]))
    spec = f"convergence:steps={steps},seeds={seeds},settings={'+'.join(names)}"
    per_rank = worker.spawn_session(2, [spec], tmp, timeout_s=1200)
    res = [d[spec] for d in per_rank]
    for r in res:
        assert "exception" not in r, r.get("exception")
    for key in res[0]:
        assert res[0][key]["hash"] == res[1][key]["hash"], f"replicas differ for {key}"
    return res[0]


def summarize(results: dict) -> dict:
    """Mean/std per setting, the margin (``2 sigma sqrt(2 / n)``, sigma the seed std of
    'none', n seeds; see the module docstring) and pass/fail."""
    names = sorted({k[0] for k in results}, key=lambda n: (n != "none", n))
    per = {n: [v["eval_loss"] for (s, _), v in results.items() if s == n] for n in names}
    base = per["none"]
    noise = statistics.stdev(base) if len(base) > 1 else 0.0
    margin = 2 * noise * (2 / len(base)) ** 0.5
    base_mean = statistics.fmean(base)
    out = {}
    for n in names:
        vals = per[n]
        mean = statistics.fmean(vals)
        rows = [v for (s, _), v in results.items() if s == n]
        out[n] = {
            "mean_eval_loss": mean,
            "std_eval_loss": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "gap": mean - base_mean,
            "margin": margin,
            "seed_std_none": noise,
            "within_margin": mean - base_mean <= margin,
            "mean_initial_loss": statistics.fmean(v["initial_loss"] for v in rows),
            "wire_bytes_per_step": rows[0]["wire_bytes"],
            "plain_bytes_per_step": rows[0]["plain_bytes"],
            "rel_error": rows[0]["rel_error"],
        }
    return out


@pytest.mark.timeout(300)
def test_convergence_short(tmp_path):
    settings = ["int8", "lowrank_int8_r4", "lowrank_int8_r4_no_ef"]
    summary = summarize(measure(SHORT_STEPS, SHORT_SEEDS, settings, tmp_path))
    base = summary["none"]
    assert base["mean_eval_loss"] < 0.5 * base["mean_initial_loss"]  # it learns
    assert base["seed_std_none"] > 0  # the margin comes from a measured spread
    for n in settings:
        s = summary[n]
        assert s["mean_eval_loss"] < 0.5 * s["mean_initial_loss"], (n, s)
        assert s["wire_bytes_per_step"] < s["plain_bytes_per_step"]
    assert summary["int8"]["within_margin"], summary["int8"]
    # the failure the full run found must fail here too: r4 without error feedback
    no_ef, ef = summary["lowrank_int8_r4_no_ef"], summary["lowrank_int8_r4"]
    assert not no_ef["within_margin"], no_ef
    # after 120 steps r4 with error feedback still trails by a few sigma (measured: gap
    # 3.4e-4 vs margin 2.0e-4; within the margin after 300 steps), but error feedback
    # recovers most of what r4 loses without it
    assert ef["gap"] < 0.5 * no_ef["gap"], (ef, no_ef)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("VERL_COMM_RUN_SLOW") != "1", reason="~6 min on 2 cores; VERL_COMM_RUN_SLOW=1"
)
@pytest.mark.timeout(1200)
def test_convergence_full(tmp_path):
    summary = summarize(measure(300, 5, list(worker.CONV_SETTINGS), tmp_path))
    for n, s in summary.items():
        if "no_ef" not in n:  # without error feedback a gap is expected
            assert s["within_margin"], (n, s)
    assert not summary["lowrank_int8_r4_no_ef"]["within_margin"]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def write_results(results: dict, summary: dict, out: Path, steps: int) -> None:
    """``convergence.jsonl`` (per seed and summary rows) and ``convergence.md``."""
    out.mkdir(parents=True, exist_ok=True)
    common = {
        "benchmark": "convergence",
        "device": f"cpu ({platform.processor() or platform.machine()}), 2 gloo ranks",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "steps": steps,
    }
    with open(out / "convergence.jsonl", "w") as f:
        for (name, seed), v in sorted(results.items()):
            row = dict(common, metric="eval_loss", setting=name, seed=seed)
            row.update(value=v["eval_loss"], unit="mse", train_loss=v["train_loss"])
            f.write(json.dumps(row) + "\n")
        for name, s in summary.items():
            row = dict(common, metric="mean_eval_loss", setting=name, value=s["mean_eval_loss"])
            row.update(unit="mse", **{k: v for k, v in s.items() if k != "mean_eval_loss"})
            f.write(json.dumps(row) + "\n")
    seeds = len({k[1] for k in results})
    lines = [
        "# Convergence: compressed vs uncompressed gradients",
        "",
        f"Tiny MLP teacher-student regression, 2 gloo ranks (CPU), Adam 3e-3, {steps} steps, "
        f"{seeds} seeds, start_iter 2. Margin = 2 sigma sqrt(2/n), sigma the seed-to-seed "
        f"std of the uncompressed final eval loss, n = {seeds} seeds: "
        f"{summary['none']['margin']:.4g}. Commit {common['commit']}, "
        f"{common['date']}.",
        "",
        "| setting | mean eval loss | std | gap vs none | within margin | bytes/step (rank) "
        "| vs plain | rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        rel = "-" if s["rel_error"] is None else f"{s['rel_error']:.3f}"
        ratio = s["wire_bytes_per_step"] / max(s["plain_bytes_per_step"], 1)
        lines.append(
            f"| {name} | {s['mean_eval_loss']:.4g} | {s['std_eval_loss']:.2g} | "
            f"{s['gap']:+.3g} | {'yes' if s['within_margin'] else 'NO'} | "
            f"{s['wire_bytes_per_step']} | {ratio:.3f} | {rel} |"
        )
    (out / "convergence.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(a.steps, a.seeds, list(worker.CONV_SETTINGS), Path(tmp))
    summary = summarize(results)
    write_results(results, summary, a.out, a.steps)
    print((a.out / "convergence.md").read_text())


if __name__ == "__main__":
    main()
