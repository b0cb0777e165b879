"""Records and report of ``benchmarks/two_host_job.sh`` (the main job across two hosts joined
by a shaped link; the script runs the jobs, this file reads their run folders).

``collect``: one method's job (rank 0's ``run_dir/metrics.jsonl``) -> records appended to
``OUT/two_host_job.jsonl`` (``two_host_job.smoke.jsonl`` with ``--smoke``):

* ``step_time_s``: median of ``timing_s/step`` over steps 2..N (step 1 carries one-time
  costs: the first reduction builds the hook state, DDP rebuilds its buckets), with the
  per-step times, min and max;
* ``eval_end``: the held-out eval reward after the last step (``eval_start`` with it).

``report``: regenerates ``two_host_job.md`` from every record (one table per run_id) with
the issue-28 targets checked within each run: step time with int8 <= 0.65 x ``none``'s and
with int8 low rank r64 <= 0.5 x; every final eval within 0.1 of ``none``'s.

    bash benchmarks/two_host_job.sh benchmarks/results 200   # root: runs the jobs, then this
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGETS = {"int8": 0.65, "int8_r64": 0.5}
EVAL_TOL = 0.1


def _stem(smoke: bool) -> str:
    return "two_host_job.smoke" if smoke else "two_host_job"


def read_rows(run_dir: Path) -> list[dict]:
    """Rows of ``run_dir/metrics.jsonl`` (rank 0 writes it).

    Raises:
        FileNotFoundError: no metrics file (the job did not start training).
    """
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summarize(rows: list[dict]) -> dict:
    """Step times and evals of one job.

    Returns:
        ``{"steps": {step: seconds}, "median_s", "min_s", "max_s", "timed_steps",
        "eval_start", "eval_end", "num_steps"}``; the median is over steps >= 2 (all steps
        if the job ran only one).

    Raises:
        ValueError: no training step, or no eval after the last step.
    """
    steps = {r["step"]: r["timing_s/step"] for r in rows if "reward/mean" in r}
    if not steps:
        raise ValueError("no training step in metrics.jsonl")
    last = max(steps)
    timed = [s for s in sorted(steps) if s >= 2] or sorted(steps)
    times = [steps[s] for s in timed]
    evals = {r["step"]: r["eval/reward"] for r in rows if r.get("eval/reward") is not None}
    if last not in evals:
        raise ValueError(f"no eval after the last step ({last}); evals at {sorted(evals)}")
    return {
        "steps": {str(s): round(steps[s], 3) for s in sorted(steps)},
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "timed_steps": timed,
        "eval_start": evals.get(0),
        "eval_end": evals[last],
        "num_steps": last,
    }


def _summary_line(log: Path | None) -> str | None:
    if log is None or not log.is_file():
        return None
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines()]
    hit = [x[x.index("done | ") :] for x in lines if "done | " in x]
    return hit[-1] if hit else None


def collect(a: argparse.Namespace) -> list[dict]:
    """Records of one method's job (see the module docstring)."""
    from verl_comm.bench.env import commit, dirty, now_iso, versions

    s = summarize(read_rows(Path(a.run_dir)))
    base = {
        "benchmark": "two_host_job",
        "run_id": a.run_id,
        "method": a.method,
        "link_mbit": a.link_mbit,
        "gradient_compression": a.gradient_compression,
        "compression_rank": None
        if a.compression_rank in ("null", "0")
        else int(a.compression_rank),
        "config": a.config,
        "seed": a.seed,
        "nnodes": 2,
        "nproc_per_node": 1,
        "transport": "shaped_veth",
        "device": "cpu",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "smoke": a.smoke,
        "load_1m_start": a.load_1m_start,
        "load_1m_end": os.getloadavg()[0],
        "wall_s": a.wall_s,
        "summary_line": _summary_line(Path(a.log) if a.log else None),
    }
    return [
        {
            **base,
            "metric": "step_time_s",
            "value": s["median_s"],
            "unit": "s",
            "stat": "median",
            "timed_steps": s["timed_steps"],
            "min_s": s["min_s"],
            "max_s": s["max_s"],
            "step_times_s": s["steps"],
        },
        {
            **base,
            "metric": "eval_end",
            "value": s["eval_end"],
            "unit": "reward",
            "eval_start": s["eval_start"],
            "step": s["num_steps"],
        },
    ]


def _run_table(recs: list[dict]) -> list[str]:
    by = {(r["method"], r["metric"]): r for r in recs}
    methods = list(dict.fromkeys(r["method"] for r in recs))
    base_t = by.get(("none", "step_time_s"))
    base_e = by.get(("none", "eval_end"))
    out = [
        "| method | gradient_compression | rank | step s, median (min-max) | x none "
        "| eval start -> end | end - none's | wall s | load 1m start/end |",
        "|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    verdicts = []
    for m in methods:
        t, e = by.get((m, "step_time_s")), by.get((m, "eval_end"))
        if t is None or e is None:
            continue
        ratio = t["value"] / base_t["value"] if base_t else None
        d_eval = e["value"] - base_e["value"] if base_e else None
        out.append(
            f"| {m} | {t['gradient_compression']} | {t['compression_rank'] or '-'} "
            f"| {t['value']:.2f} ({t['min_s']:.2f}-{t['max_s']:.2f}) "
            f"| {_num(ratio, '.2f')} "
            f"| {_num(e['eval_start'], '.3f')} -> {e['value']:.3f} | {_num(d_eval, '+.3f')} "
            f"| {t['wall_s']} | {t['load_1m_start']:.1f} / {t['load_1m_end']:.1f} |"
        )
        if m in TARGETS and ratio is not None:
            ok = ratio <= TARGETS[m]
            verdicts.append(f"{m} step {ratio:.2f}x none (<= {TARGETS[m]}): {_met(ok)}")
        if m != "none" and d_eval is not None:
            verdicts.append(
                f"{m} eval {d_eval:+.3f} vs none (within {EVAL_TOL}): "
                f"{_met(abs(d_eval) <= EVAL_TOL)}"
            )
    if verdicts:
        out += ["", "Targets (issue 28): " + "; ".join(verdicts) + "."]
    return out


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(out: Path, smoke: bool) -> str:
    """Regenerate ``<stem>.md`` from ``<stem>.jsonl``; returns the markdown."""
    from verl_comm.bench.report import read_jsonl

    stem = _stem(smoke)
    recs = read_jsonl(out / f"{stem}.jsonl")
    lines = [
        "# two_host_job: the main job on two hosts joined by a shaped link",
        "",
        "Generated by `benchmarks/two_host_job.py report` from `" + stem + ".jsonl` "
        "(`bash benchmarks/two_host_job.sh OUTDIR RATE_MBIT`). Two network namespaces "
        "joined by a veth pair shaped with tc tbf stand in for two hosts; each runs "
        "`torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d` (one gloo rank per "
        "host). Step time: `timing_s/step` of the trainer, median over steps 2..N (step 1 "
        "builds the hook state). The CPU is shared: the 1-minute load average is recorded.",
    ]
    for run_id in dict.fromkeys(r["run_id"] for r in recs):
        run = [r for r in recs if r["run_id"] == run_id]
        r0 = run[0]
        lines += [
            "",
            f"## run {run_id}: {r0['link_mbit']:g} Mbit/s, {r0['config']}, seed {r0['seed']}, "
            f"commit {r0['commit']}, {r0['date']}, torch {r0['versions']['torch']}",
            "",
            *_run_table(run),
        ]
    text = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """``collect`` one method's records from its run folder, or ``report`` the markdown
    from the JSONL (see the module docstring); returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="records of one method's job")
    c.add_argument("--run-dir", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--run-id", required=True)
    c.add_argument("--link-mbit", type=float, required=True)
    c.add_argument("--method", required=True)
    c.add_argument("--gradient-compression", required=True)
    c.add_argument("--compression-rank", default="null")
    c.add_argument("--config", required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--load-1m-start", type=float, required=True)
    c.add_argument("--wall-s", type=float, required=True)
    c.add_argument("--log", default=None)
    c.add_argument("--smoke", action="store_true")
    r = sub.add_parser("report", help="regenerate the markdown from the records")
    r.add_argument("--out", required=True)
    r.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.cmd == "collect":
        recs = collect(a)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{_stem(a.smoke)}.jsonl", "a") as f:
            for x in recs:
                f.write(json.dumps(x) + "\n")
        print(f"two_host_job: {a.method}: step {recs[0]['value']:.2f} s, eval {recs[1]['value']}")
        return 0
    print(report(out, a.smoke))
    return 0


if __name__ == "__main__":
    sys.exit(main())
