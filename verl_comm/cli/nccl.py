"""``verl-comm nccl``: lint the environment, show a preset, autotune, read the topology.

Commands::

    verl-comm nccl lint [--json] [--preset NAME] [VAR=VALUE ...]
        lint os.environ (or only the VAR=VALUE given, or a preset's table); exit 1 on errors
    verl-comm nccl show [PRESET] [--json]      a preset's (variable, value, reason) table
    verl-comm nccl autotune --sizes 64K,1M,64M [--presets a,b] [--nproc 2] [--backend nccl]
        time all-reduce under each preset in fresh processes; report the fastest per size
    verl-comm nccl topo [FILE] [--json]        parse nvidia-smi topo -m (FILE or live)

Example (the advice that circulates, checked)::

    verl-comm nccl lint NCCL_ASYNC_ERROR_HANDLING=0 NCCL_SOCKET_TIMEOUT=1200 NCCL_BUFFSIZE=2M
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from verl_comm.nccl.lint import Finding, has_errors, lint
from verl_comm.nccl.presets import PRESETS, get_preset

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"4096"`` -> 4096 (binary units, bytes).

    Raises:
        ValueError: not a positive size, naming the text.
    """
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = s[-1:] if s[-1:] in _UNITS and s[-1:] else ""
    num = s[: -len(unit)] if unit else s
    try:
        value = int(float(num) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"--sizes: {text!r} is not a size like 4096, 64K, 1M or 1G") from None
    if value <= 0:
        raise ValueError(f"--sizes: {text!r} must be positive")
    return value


def format_findings(findings: list[Finding]) -> str:
    """The findings as an aligned text table (severity, variable, message, fix)."""
    if not findings:
        return "no findings"
    wv = max(len(f.variable) for f in findings)
    rows = [f"{'severity':<8} {'variable':<{wv}}  message / fix"]
    for f in findings:
        indent = " " * (8 + 1 + wv + 2)
        msg = textwrap.fill(f.message, 100, initial_indent=indent, subsequent_indent=indent)
        msg = msg[len(indent) :]
        rows.append(f"{f.severity:<8} {f.variable:<{wv}}  {msg}")
        rows.append(f"{indent}fix: {f.fix}")
    return "\n".join(rows)


def _lint(args: argparse.Namespace) -> int:
    if args.preset:
        env = get_preset(args.preset).as_env()
    elif args.assignments:
        env = {}
        for a in args.assignments:
            if "=" not in a:
                print(f"verl-comm nccl lint: expected VAR=VALUE, got {a!r}", file=sys.stderr)
                return 2
            k, v = a.split("=", 1)
            env[k] = v
    else:
        env = dict(os.environ)
    findings = lint(env)
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=1))
    else:
        print(format_findings(findings))
    return 1 if has_errors(findings) else 0


def _show(args: argparse.Namespace) -> int:
    if args.preset is None:
        for p in PRESETS.values():
            print(f"{p.name:<20} {p.summary}")
        return 0
    try:
        p = get_preset(args.preset)
    except KeyError as e:
        print(f"verl-comm nccl show: {e.args[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"name": p.name, "summary": p.summary,
                          "entries": [vars(e) for e in p.entries],
                          "init_options": [dict(zip(("option", "value", "reason"), o))
                                           for o in p.init_options]}, indent=1))  # fmt: skip
        return 0
    w = max(len(e.variable) for e in p.entries)
    wv = max(len(e.value) for e in p.entries)
    print(f"# {p.name}: {p.summary}")
    for e in p.entries:
        print(f"{e.variable:<{w}}  {e.value:<{wv}}  {e.reason}")
    for opt, val, reason in p.init_options:
        print(f"{'init: ' + opt:<{w}}  {val:<{wv}}  {reason}")
    return 0


def _autotune(args: argparse.Namespace) -> int:
    from verl_comm.bench.autotune import autotune, format_report

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        presets = [p.strip() for p in args.presets.split(",")] if args.presets else None
        backend = args.backend
        if backend is None:
            import torch

            backend = "nccl" if torch.cuda.device_count() >= args.nproc else "gloo"
        rep = autotune(sizes, presets, args.nproc, backend, args.iters, args.warmup, args.timeout)
    except ValueError as e:
        print(f"verl-comm nccl autotune: {e}", file=sys.stderr)
        return 2
    text = format_report(rep)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "nccl_autotune.json").write_text(json.dumps(rep.to_dict(), indent=1))
        (out / "nccl_autotune.md").write_text(text + "\n")
    print(json.dumps(rep.to_dict(), indent=1) if args.json else text)
    return 0 if rep.recommended else 1


def _topo(args: argparse.Namespace) -> int:
    from verl_comm.nccl.topology import check_nvlinks, detect_host, parse_topo_matrix

    if args.file:
        topo = parse_topo_matrix(Path(args.file).read_text())
        info = {"topo": topo.to_dict(), "nvlink_problems": check_nvlinks(topo, args.gpu or "")}
    else:
        info = detect_host().to_dict()
    print(json.dumps(info, indent=1) if args.json else _topo_text(info))
    return 1 if info["nvlink_problems"] else 0


def _topo_text(info: dict) -> str:
    lines = []
    topo = info.get("topo")
    if topo:
        devs = topo["devices"]
        lines.append("      " + " ".join(f"{d:>5}" for d in devs))
        for d in devs:
            lines.append(f"{d:>5} " + " ".join(f"{topo['links'][d][c]:>5}" for c in devs))
    else:
        lines.append("no nvidia-smi topology")
    for key in ("ib_devices", "gpu_names"):
        if key in info:
            lines.append(f"{key}: {info[key] or 'none'}")
    for i in info.get("interfaces", []):
        lines.append(f"interface {i['name']}: {', '.join(i['addresses']) or '-'}")
    lines += [f"problem: {p}" for p in info["nvlink_problems"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``verl-comm nccl``."""
    p = argparse.ArgumentParser(prog="verl-comm nccl", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("lint", help="lint the environment (exit 1 on errors)")
    lp.add_argument("assignments", nargs="*", metavar="VAR=VALUE")
    lp.add_argument("--preset", default=None, help="lint a preset's table instead")
    lp.add_argument("--json", action="store_true")
    sp = sub.add_parser("show", help="show a preset (or list them)")
    sp.add_argument("preset", nargs="?", default=None)
    sp.add_argument("--json", action="store_true")
    ap = sub.add_parser("autotune", help="fastest preset at your message sizes")
    ap.add_argument("--sizes", required=True, help="comma list, e.g. 64K,1M,64M")
    ap.add_argument(
        "--presets", default=None, help=f"comma list (default all: {','.join(PRESETS)})"
    )
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None)
    ap.add_argument("-n", "--iters", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per preset")
    ap.add_argument("--out", default=None, help="also write nccl_autotune.{json,md} here")
    ap.add_argument("--json", action="store_true")
    tp = sub.add_parser("topo", help="parse nvidia-smi topo -m")
    tp.add_argument("file", nargs="?", default=None, help="captured output (default: live)")
    tp.add_argument("--gpu", default=None, help="GPU name for the NVLink check with FILE")
    tp.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-comm nccl``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return {"lint": _lint, "show": _show, "autotune": _autotune, "topo": _topo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
