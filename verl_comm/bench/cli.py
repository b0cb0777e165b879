"""``verl-comm bench``: collective benchmarks in nccl-tests' layout.

Commands::

    verl-comm bench allreduce [options]        run a sweep (any collective with --op)
    verl-comm bench compare NEW.jsonl OLD.jsonl  regression guard (busbw drop > 20%)
    verl-comm bench plot IN.jsonl [...] --png OUT.png [--collective all_reduce]
    verl-comm bench summary IN.jsonl [...] [--md OUT.md]   targets, int8 crossovers

Examples::

    # CPU, 2 spawned gloo processes, tiny sweep (the CI smoke test)
    verl-comm bench allreduce --smoke --out /tmp/bench
    # 2 GPUs, NVLink, 8 B .. 1 GiB, three methods side by side
    NCCL_NVLS_ENABLE=0 verl-comm bench allreduce --nproc 2 --backend nccl -b 8 -e 1G -f 2 \\
        --method nccl_fp32,nccl_bf16,int8 --jsonl out.jsonl --plot out.png
    # the same under torchrun (no self-launch)
    torchrun --nproc_per_node 2 -m verl_comm.bench.cli allreduce --backend nccl -b 8 -e 1G

Exit codes: 0 success; 1 a check found wrong elements; 2 bad arguments; 3 ``--compare``
found a regression; 4 a rank failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from verl_comm.bench import report
from verl_comm.bench.ops import METHODS
from verl_comm.bench.runner import BenchConfig, launch, under_torchrun
from verl_comm.bench.sweep import COLLECTIVES, parse_size

EXIT_WRONG, EXIT_USAGE, EXIT_REGRESSION, EXIT_FAILED = 1, 2, 3, 4


def _csv(choices: tuple[str, ...], field: str):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{field}: {', '.join(bad) or 'empty'} not in {', '.join(choices)} (comma-separated)"
            )
        return items

    return parse


def _size(field: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, field)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _kv(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--per-rank-env: expected NAME=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k, v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``verl-comm bench``."""
    p = argparse.ArgumentParser(prog="verl-comm bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("allreduce", help="sweep a collective over message sizes")
    a.add_argument(
        "--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)"
    )
    a.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl with CUDA, else gloo",
    )
    a.add_argument("-b", "--minbytes", type=_size("-b/--minbytes"), default=8)
    a.add_argument("-e", "--maxbytes", type=_size("-e/--maxbytes"), default=parse_size("32M"))
    a.add_argument("-f", "--stepfactor", type=float, default=2.0)
    a.add_argument("-n", "--iters", type=int, default=20)
    a.add_argument("-w", "--warmup", type=int, default=5)
    a.add_argument("-c", "--check", type=int, default=1, help="1: closed-form check before timing")
    a.add_argument("-d", "--dtype", default="float32", help="payload dtype (default float32)")
    a.add_argument(
        "--op", type=_csv(COLLECTIVES, "--op"), default=["all_reduce"], help="comma list"
    )
    a.add_argument(
        "--method", type=_csv(METHODS, "--method"), default=["nccl_fp32"], help="comma list"
    )
    a.add_argument("--inplace", action="store_true", help="only in-place (default: both)")
    a.add_argument("--outplace", action="store_true", help="only out-of-place (default: both)")
    a.add_argument("--transport", default=None, help="label in records (default: derived)")
    a.add_argument(
        "--per-rank-env",
        type=_kv,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in each rank before init, {rank} substituted (e.g. NCCL_HOSTID=host{rank})",
    )
    a.add_argument(
        "--time-budget", type=float, default=None, help="seconds per size and case: caps -n"
    )
    a.add_argument("--min-iters", type=int, default=5, help="lower bound of the --time-budget cap")
    a.add_argument("--repeat", type=int, default=1, help="repeat the sweep (stability summary)")
    a.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    a.add_argument("--launch-timeout", type=float, default=1800.0, help="whole run timeout (s)")
    a.add_argument("--out", default=None, help="folder for allreduce_latency.jsonl and .md")
    a.add_argument("--jsonl", default=None, help="JSONL output path")
    a.add_argument("--md", default=None, help="markdown table output path")
    a.add_argument("--append", action="store_true", help="append to --jsonl instead of overwriting")
    a.add_argument("--plot", default=None, help="PNG output path")
    a.add_argument("--compare", default=None, help="old JSONL: flag busbw drops > 20%%, exit 3")
    a.add_argument(
        "--smoke", action="store_true", help="gloo, 2 processes, tiny sweep of every op and method"
    )

    c = sub.add_parser("compare", help="compare two JSONL files (busbw drop > threshold)")
    c.add_argument("new")
    c.add_argument("old")
    c.add_argument("--threshold", type=float, default=report.REGRESSION_THRESHOLD)

    g = sub.add_parser("plot", help="plot JSONL files into one PNG")
    g.add_argument("inputs", nargs="+")
    g.add_argument("--png", required=True)
    g.add_argument("--title", default="")
    g.add_argument("--collective", default=None, help="only records of this collective")
    g.add_argument("--transport", default=None, help="only records of this transport")

    s = sub.add_parser("summary", help="targets and int8 crossover sizes from JSONL files")
    s.add_argument("inputs", nargs="+")
    s.add_argument("--md", default=None, help="also write the markdown here")
    return p


def config_from_args(args: argparse.Namespace, argv: list[str]) -> BenchConfig:
    """Translate parsed ``allreduce`` options into a :class:`BenchConfig`."""
    backend = args.backend
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    placements = ["outplace", "inplace"]
    if args.inplace != args.outplace:
        placements = ["inplace"] if args.inplace else ["outplace"]
    cfg = BenchConfig(
        backend=backend,
        nproc=args.nproc,
        minbytes=args.minbytes,
        maxbytes=args.maxbytes,
        factor=args.stepfactor,
        iters=args.iters,
        warmup=args.warmup,
        check=args.check,
        dtype=args.dtype,
        ops=args.op,
        methods=args.method,
        placements=placements,
        transport=args.transport,
        per_rank_env=dict(args.per_rank_env),
        time_budget_s=args.time_budget,
        min_iters=args.min_iters,
        repeat=args.repeat,
        timeout_s=args.timeout,
        launch_timeout_s=args.launch_timeout,
        command="allreduce " + " ".join(shlex.quote(a) for a in argv),
    )
    if args.smoke:
        cfg.backend, cfg.nproc = "gloo", 2
        cfg.minbytes, cfg.maxbytes, cfg.factor = 8, parse_size("16K"), 16.0
        cfg.iters, cfg.warmup, cfg.timeout_s, cfg.launch_timeout_s = 5, 1, 60.0, 120.0
        cfg.ops = list(COLLECTIVES)
        cfg.methods = list(METHODS)
    return cfg


def _outputs(records: list[dict], args: argparse.Namespace) -> int:
    jsonl, md = _jsonl_path(args), args.md
    if args.out:
        md = md or str(Path(args.out) / f"{report.BENCHMARK}.md")
    if jsonl:
        print(f"# wrote {jsonl} (appended as measured)")
    if md:
        Path(md).parent.mkdir(parents=True, exist_ok=True)
        Path(md).write_text(report.markdown(records))
        print(f"# wrote {md}")
    if args.plot:
        from verl_comm.bench.plot import plot_records

        print(f"# wrote {plot_records(records, args.plot)}")
    rc = 0
    wrong = sum(r["wrong"] or 0 for r in report.measurements(records))
    if wrong:
        print(
            f"# FAILED: {wrong} wrong elements in total; timings of wrong results are void",
            file=sys.stderr,
        )
        rc = EXIT_WRONG
    if args.compare:
        flagged, text = report.compare(records, report.read_jsonl(args.compare))
        print(text)
        if flagged:
            rc = rc or EXIT_REGRESSION
    return rc


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-comm bench``; returns the exit code (see module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command == "compare":
        flagged, text = report.compare(
            report.read_jsonl(args.new), report.read_jsonl(args.old), args.threshold
        )
        print(text)
        return EXIT_REGRESSION if flagged else 0
    if args.command == "plot":
        from verl_comm.bench.plot import plot_records

        records = [r for path in args.inputs for r in report.read_jsonl(path)]
        records = [
            r
            for r in records
            if args.collective in (None, r.get("collective"))
            and args.transport in (None, r.get("transport"))
        ]
        print(f"# wrote {plot_records(records, args.png, args.title)}")
        return 0
    if args.command == "summary":
        from verl_comm.bench.summary import markdown_summary

        text = markdown_summary([r for path in args.inputs for r in report.read_jsonl(path)])
        print(text)
        if args.md:
            Path(args.md).parent.mkdir(parents=True, exist_ok=True)
            Path(args.md).write_text(text)
        return 0
    try:
        cfg = config_from_args(args, argv[1:])
        cfg.validate()
    except ValueError as exc:
        print(f"verl-comm bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    cfg.jsonl = _jsonl_path(args)
    if cfg.jsonl and not args.append and not (under_torchrun() and os.environ.get("RANK") != "0"):
        Path(cfg.jsonl).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.jsonl).write_text("")  # rank 0 appends each record as it is measured
    try:
        records = launch(cfg)
    except RuntimeError as exc:
        print(f"verl-comm bench: {exc}", file=sys.stderr)
        if cfg.jsonl:
            print(f"# records measured before the failure are in {cfg.jsonl}", file=sys.stderr)
        return EXIT_FAILED
    if under_torchrun() and not records:
        return 0  # non-zero ranks: rank 0 writes the outputs
    return _outputs(records, args)


def _jsonl_path(args: argparse.Namespace) -> str | None:
    if args.jsonl:
        return args.jsonl
    if args.out:
        return str(Path(args.out) / f"{report.BENCHMARK}.jsonl")
    return None


if __name__ == "__main__":
    sys.exit(main())
