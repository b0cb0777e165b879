"""``verl-comm profile report DIR``: tables, diagnosis, chart.

``DIR`` is a profiler ``output_dir`` (``profile_rank*.json``) or a folder of such folders
(one report per run, e.g. ``none/`` and ``int8/``).

Examples::

    verl-comm profile report ./profile_logs                # text
    verl-comm profile report ./profile_logs --json         # one JSON document on stdout
    verl-comm profile report runs/ --save                  # also report.txt/.json/.png per run

Exit codes: 0 report written; 2 bad arguments or nothing to report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from verl_comm.profiler.analysis import analyze_run, find_runs, flat_metrics
from verl_comm.profiler.diagnose import Thresholds, diagnose
from verl_comm.profiler.render import plot_report, text_report


def _clean(obj):
    """JSON-safe copy (NaN/inf -> None)."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def report(path: str | Path, thresholds: Thresholds | None = None) -> list[dict]:
    """Analyse and diagnose every run under ``path``.

    Returns a list of ``{"metrics": ..., "diagnosis": ...}``, one per run.
    """
    out = []
    for run in find_runs(path):
        m = analyze_run(run)
        out.append({"metrics": m, "diagnosis": diagnose(m, thresholds)})
    return out


# (flag, Thresholds field, type, help) of the diagnosis limits
THRESHOLD_FLAGS = (
    ("--jitter", "jitter_ratio", float, "symptom 1 when step P99/P50 is above this ratio"),
    ("--host-share", "host_share", float,
     "symptom 2 when host phases exceed this fraction of the step"),
    ("--idle-share", "idle_share", float, "symptom 2 when the GPU idles this fraction of the step"),
    ("--comm-share", "comm_share", float,
     "symptom 3 when communication exceeds this fraction of the step or of backward"),
    ("--rollout-ratio", "rollout_ratio", float, "symptom 4 when rollout P99/P50 is above this"),
    ("--rollout-p99", "rollout_p99_s", float,
     "symptom 4 also when rollout P99 is above this many seconds"),
    ("--min-samples", "min_samples", int, "steps/rollouts needed to judge symptoms 1 and 4"),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``verl-comm profile``."""
    p = argparse.ArgumentParser(prog="verl-comm profile", description="profile reports")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="table + diagnosis of profiler output")
    r.add_argument("dir", help="a profiler output_dir, or a folder of them (one report each)")
    r.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    r.add_argument(
        "--png", default=None, help="chart path (one run only); default with --save: DIR/report.png"
    )
    r.add_argument(
        "--save",
        action="store_true",
        help="write report.txt, report.json, report.png in each run dir",
    )
    r.add_argument("--full", action="store_true", help="also the memory timeline in --json (large)")
    th = Thresholds()
    for flag, field, typ, text in THRESHOLD_FLAGS:
        default = getattr(th, field)
        r.add_argument(
            flag, dest=field, type=typ, default=default,
            help=text + (" (default %(default)s)" if default is not None else " (default: off)"),
        )  # fmt: skip
    return p


def _slim(metrics: dict, full: bool) -> dict:
    if full:
        return metrics
    return {k: v for k, v in metrics.items() if k not in ("memory_timeline",)}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-comm profile``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    th = Thresholds(**{field: getattr(args, field) for _, field, _, _ in THRESHOLD_FLAGS})
    try:
        th.validate()
        results = report(args.dir, th)
    except (FileNotFoundError, ValueError) as exc:
        print(f"verl-comm profile: {exc}", file=sys.stderr)
        return 2
    if args.png and len(results) > 1:
        print(
            f"verl-comm profile: --png names one chart but {args.dir} holds {len(results)} runs; "
            "use --save (a report.png in each run folder) or point DIR at one run",
            file=sys.stderr,
        )
        return 2
    try:
        return _emit(args, results)
    except OSError as exc:
        print(f"verl-comm profile: cannot write the report: {exc}", file=sys.stderr)
        return 2


def _emit(args: argparse.Namespace, results: list[dict]) -> int:
    """Print and/or save the reports of ``results``; returns the exit code."""
    docs = []
    for res in results:
        m, d = res["metrics"], res["diagnosis"]
        doc = _clean(
            {
                "run": m["run"],
                "flat": flat_metrics(m),
                "metrics": _slim(m, args.full),
                "diagnosis": d,
            }
        )
        docs.append(doc)
        text = text_report(m, d)
        if not args.json:
            print(text)
        run_dir = Path(m["run"]["dir"])
        png = args.png
        if args.save:
            (run_dir / "report.txt").write_text(text)
            (run_dir / "report.json").write_text(json.dumps(doc, indent=1))
            png = png or run_dir / "report.png"
        if png:
            written = plot_report(m, png)
            if not args.json:
                print(f"# wrote {written}")
    if args.json:
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1))
    elif len(results) > 1:
        print(comparison_table(results))
    return 0


def comparison_table(results: list[dict]) -> str:
    """One line per run: step P50/P99, communication share and time, exposed share, found
    symptoms (e.g. ``none/`` against ``int8/``)."""
    lines = [
        "=== runs compared",
        f"{'run':<28}{'step P50 s':>11}{'P99 s':>9}{'comm s/step':>12}{'comm share':>11}"
        f"{'exposed':>9}{'of bwd':>8}  symptoms",
    ]
    for res in results:
        m, d = res["metrics"], res["diagnosis"]
        st, c = m["step_time_max_over_ranks"], m["comm"]

        def pct(x):
            return "n/a" if x is None else f"{x:.0%}"

        lines.append(
            f"{Path(m['run']['dir']).name:<28}{st['p50']:>11.3f}{st['p99']:>9.3f}"
            f"{c['per_step_s']:>12.3f}{pct(c['share_of_step']):>11}"
            f"{pct(c['exposed_share_of_step']):>9}{pct(c['share_of_backward']):>8}  "
            + (", ".join(str(i) for i in d["found"]) or "none")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
