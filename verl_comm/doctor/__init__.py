"""``verl-comm doctor``: versions, kernels, environment, topology and a distributed check.

Usage::

    verl-comm doctor [--nproc N] [--backend nccl|gloo] [--timeout S] [--json]
    # 2 GPUs
    NCCL_NVLS_ENABLE=0 verl-comm doctor --nproc 2 --backend nccl --json

Checks, in order: versions (Python, torch, CUDA, NCCL, triton, deepspeed, transformers; the
last two by package metadata, never imported); the int8 kernels' self-test (quantize then
dequantize a small CPU tensor, error within the documented bound); the environment linter;
the topology (NVLink counts against the platform's full count); then N processes
(:mod:`verl_comm.doctor.selftest`): init with an explicit timeout, an exact all-reduce
correctness test, small-message latency, large-message busbw and, with NCCL, the transport
NCCL chose (``NCCL_DEBUG=INFO`` lines ``Channel ... via P2P/...``).

Every check has a deadline: each collective the collective timeout (``--timeout``, default
30 s), each worker process ``--startup`` seconds plus four timeouts, after which it is killed
and the step it had reached is reported. The command always ends; exit code 0 only if every
check passed (lint warnings and skipped checks do not fail it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from importlib import metadata

from verl_comm.distributed.launch import free_port, run_ranks

_VIA = re.compile(
    r"NCCL INFO Channel \d+(?:/\d+)? ?: \d+\[\d+\] -> \d+\[\d+\](?: \[\w+\])? via ([^\n]+)"
)
_NCCL_VER = re.compile(r"NCCL version ([0-9.]+\S*)")


def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_versions() -> dict:
    """Versions of the stack; ``cuda``/``nccl`` are ``None`` without CUDA."""
    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": None,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "triton": _version("triton"),
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
    }
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # NCCL missing from this build
            out["nccl"] = f"unavailable ({e})"
    return {"ok": True, **out}


def check_kernels() -> dict:
    """Quantize + dequantize 1000 values on CPU (block 128); error <= scale/2 per element.

    Returns ``{"ok": True, "status": "skipped", ...}`` when ``verl_comm.kernels`` is absent.
    """
    try:
        import torch

        from verl_comm import kernels
    except Exception as e:
        return {"ok": True, "status": "not available", "detail": f"{type(e).__name__}: {e}"}
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1000, generator=g)
        codes, scales = kernels.quantize(x, 128)
        y = kernels.dequantize(codes, scales, 128)[: x.numel()]
        bound = scales.repeat_interleave(128)[: x.numel()] / 2 * (1 + 1e-5) + 1e-12
        err = (x - y).abs()
        ok = bool((err <= bound).all()) and codes.dtype == torch.int8
        return {"ok": ok, "status": "passed" if ok else "FAILED", "max_abs_err": float(err.max())}
    except Exception as e:
        return {"ok": False, "status": "FAILED", "detail": f"{type(e).__name__}: {e}"}


def check_env(host=None) -> dict:
    """Lint this process's environment (``host``: a :class:`~verl_comm.nccl.HostInfo`, or
    ``None`` to detect it)."""
    from verl_comm.nccl import has_errors, lint
    from verl_comm.nccl.presets import comm_env

    findings = lint(os.environ, host=host)
    return {
        "ok": not has_errors(findings),
        "variables": comm_env(os.environ),
        "findings": [f.to_dict() for f in findings],
    }


def check_topology(host) -> dict:
    """Interfaces, IB devices, GPUs and the NVLink matrix of ``host`` (a
    :class:`~verl_comm.nccl.HostInfo`); fails on NVLink pairs below the platform's count."""
    out = host.to_dict()
    if host.topo is not None:
        gpus = host.topo.gpus
        out["nvlinks"] = {
            f"{a}-{b}": host.topo.nvlinks(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]
        }
    return {"ok": not host.nvlink_problems, **out}


def parse_transports(log: str) -> dict:
    """Transports NCCL chose, from ``NCCL_DEBUG=INFO`` output.

    Returns ``{"channels": {"P2P/CUMEM/read": 24, ...}, "nccl_version": "2.28.9+cuda13.0"}``
    (counts of ``Channel ... via X`` lines; empty without INFO logs).
    """
    channels = Counter(m.group(1).strip() for m in _VIA.finditer(log))
    ver = _NCCL_VER.search(log)
    return {"channels": dict(channels), "nccl_version": ver.group(1) if ver else None}


def _read_back(f) -> str:
    f.flush()
    f.seek(0)
    text = f.read()
    f.close()
    return text


def check_distributed(
    nproc: int, backend: str, timeout_s: float, startup_s: float, bw_bytes: int, iters: int
) -> dict:
    """Run :mod:`verl_comm.doctor.selftest` in ``nproc`` processes with deadlines.

    Each worker is killed after ``startup_s + 4 * timeout_s`` seconds; the report lists per
    rank the steps it finished and, for a killed or failed rank, the step it was in.
    """
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    log_dir = tempfile.mkdtemp(prefix="verl_comm_doctor_")
    if backend == "nccl" and "NCCL_DEBUG" not in env:
        # to read the chosen transport; user settings are kept. NCCL logs to stdout unless
        # NCCL_DEBUG_FILE is set: keep its lines in per-process files instead.
        env["NCCL_DEBUG"] = "INFO"
        env.setdefault("NCCL_DEBUG_FILE", os.path.join(log_dir, "nccl.%h.%p.log"))
    port = free_port()
    files = [
        (
            open(os.path.join(log_dir, f"rank{r}.out"), "w+"),  # noqa: SIM115
            open(os.path.join(log_dir, f"rank{r}.err"), "w+"),  # noqa: SIM115
        )
        for r in range(nproc)
    ]

    def cmd(r: int) -> list[str]:
        return [sys.executable, "-m", "verl_comm.doctor.selftest", "--rank", str(r),
                "--world", str(nproc), "--port", str(port), "--backend", backend, "--timeout",
                str(timeout_s), "--iters", str(iters), "--bw-bytes", str(bw_bytes)]  # fmt: skip

    # output to files, not pipes: a chatty rank (NCCL_DEBUG=INFO on stdout) must never block
    # on a full pipe while the parent waits on another rank. Every rank runs to its own end
    # (each reports the step it failed in) or to the deadline.
    deadline_s = startup_s + 4 * timeout_s
    res = run_ranks(
        cmd, nproc, env=env, master_port=port, deadline_s=deadline_s, stop_on_failure=False,
        stdout=lambda r: files[r][0], stderr=lambda r: files[r][1], name="doctor",
        announce=False,
    )  # fmt: skip
    ranks, logs = [], []
    for r, ex in enumerate(res.exits):
        killed = ex.stopped
        stdout, stderr = (_read_back(f) for f in files[r])
        steps = {}
        for ln in stdout.splitlines():
            if ln.startswith("DOCTOR "):
                rec = json.loads(ln[len("DOCTOR ") :])
                steps[rec.pop("step")] = rec
        done = all(s in steps for s in ("init", "allreduce_correctness", "latency", "bandwidth"))
        rank_ok = (
            not killed and ex.returncode == 0 and done and all(s["ok"] for s in steps.values())
        )
        info = {"rank": r, "ok": rank_ok, "returncode": ex.returncode, "steps": steps}
        if killed:
            info["error"] = (
                f"killed at the {deadline_s:g} s deadline after steps {list(steps) or 'none'}"
            )
        elif not rank_ok:
            info["stderr_tail"] = "\n".join(
                ln for ln in stderr.splitlines()[-15:] if "NCCL INFO" not in ln
            )
        ranks.append(info)
        logs += [stdout, stderr]
    out = {"ok": all(i["ok"] for i in ranks), "nproc": nproc, "backend": backend,
           "timeout_s": timeout_s, "ranks": ranks}  # fmt: skip
    r0 = ranks[0]["steps"]
    if "latency" in r0:
        out["latency_us"] = r0["latency"]["s"] * 1e6
    if "bandwidth" in r0:
        out["bandwidth"] = {
            k: r0["bandwidth"][k] for k in ("bytes", "s", "algbw_GBps", "busbw_GBps")
        }
    for name in sorted(os.listdir(log_dir)):
        if name.startswith("nccl."):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                logs.append(f.read())
    shutil.rmtree(log_dir, ignore_errors=True)
    if backend == "nccl":
        out["transport"] = parse_transports("\n".join(logs))
    return out


def _fmt_text(report: dict) -> str:
    lines = []
    mark = {True: "PASS", False: "FAIL"}
    v = report["versions"]
    lines.append(f"[{mark[v['ok']]}] versions: " + ", ".join(
        f"{k} {v[k]}" for k in ("python", "torch", "cuda", "nccl", "triton", "deepspeed",
                                "transformers", "gpus")))  # fmt: skip
    k = report["kernels"]
    lines.append(f"[{mark[k['ok']]}] kernels self-test: {k['status']}"
                 + (f" (max abs err {k['max_abs_err']:.3g})" if "max_abs_err" in k else "")
                 + (f" ({k['detail']})" if "detail" in k else ""))  # fmt: skip
    e = report["env"]
    lines.append(f"[{mark[e['ok']]}] env lint: {len(e['findings'])} finding(s)")
    for f in e["findings"]:
        lines.append(f"    {f['severity']:<7} {f['variable']}: {f['message']} -> {f['fix']}")
    t = report["topology"]
    lines.append(f"[{mark[t['ok']]}] topology: GPUs {t['gpu_names'] or 'none'}; IB devices "
                 f"{t['ib_devices'] or 'none'}; interfaces "
                 + ", ".join(f"{i['name']} {'/'.join(i['addresses'][:2])}".strip()
                             for i in t["interfaces"]))  # fmt: skip
    for pair, n in t.get("nvlinks", {}).items():
        lines.append(f"    {pair}: {n} NVLinks")
    if t.get("topo_error"):
        lines.append(f"    note: {t['topo_error']}")
    for prob in t["nvlink_problems"]:
        lines.append(f"    problem: {prob}")
    d = report.get("distributed")
    if d is not None:
        lines.append(f"[{mark[d['ok']]}] distributed ({d['backend']}, {d['nproc']} processes, "
                     f"timeout {d['timeout_s']:g} s)")  # fmt: skip
        for r in d["ranks"]:
            s = r["steps"]
            cases = s.get("allreduce_correctness", {}).get("cases", [])
            bad = [c for c in cases if not c["ok"]]
            lines.append(f"    rank {r['rank']}: {'ok' if r['ok'] else 'FAILED'}; steps "
                         f"{list(s)}; all-reduce {len(cases) - len(bad)}/{len(cases)} exact")  # fmt: skip
            for c in bad:
                lines.append(f"      {c['dtype']} n={c['numel']}: first bad index "
                             f"{c['first_bad_index']} got {c['got']} expected {c['expected']}")  # fmt: skip
            for name, st in s.items():
                if not st.get("ok", True) and "error" in st:
                    lines.append(f"      {name}: {st['error']}")
            for key in ("error", "stderr_tail"):
                if r.get(key):
                    lines.append(f"      {r[key]}")
        if "latency_us" in d:
            lines.append(f"    latency (4 B all-reduce, median, max over ranks): "
                         f"{d['latency_us']:.1f} us")  # fmt: skip
        if "bandwidth" in d:
            b = d["bandwidth"]
            lines.append(f"    bandwidth ({b['bytes']} B fp32 all-reduce): {b['s'] * 1e3:.3f} ms, "
                         f"algbw {b['algbw_GBps']:.2f} GB/s, busbw {b['busbw_GBps']:.2f} GB/s")  # fmt: skip
        if "transport" in d:
            tr = d["transport"]
            lines.append(
                f"    NCCL {tr['nccl_version']} transport: {tr['channels'] or 'not logged'}"
            )
    lines.append(f"doctor: {'all checks passed' if report['ok'] else 'FAILED'} "
                 f"({report['wall_s']:.1f} s, {report['host']}, {report['date']})")  # fmt: skip
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> dict:
    """Run every check; return the report dict (``report["ok"]`` is the verdict)."""
    t0 = time.perf_counter()
    from verl_comm.nccl.topology import detect_host

    host = detect_host(timeout_s=10.0)  # nvidia-smi calls bounded to 10 s each
    report: dict = {"versions": check_versions(), "kernels": check_kernels(),
                    "env": check_env(host), "topology": check_topology(host)}  # fmt: skip
    if args.nproc > 0:
        report["distributed"] = check_distributed(
            args.nproc, args.backend, args.timeout, args.startup, args.bw_bytes, args.iters
        )
    report["ok"] = all(v["ok"] for v in report.values() if isinstance(v, dict))
    report["wall_s"] = time.perf_counter() - t0
    report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report["host"] = socket.gethostname()
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-comm doctor``; exit code 0 only if every check passed."""
    p = argparse.ArgumentParser(prog="verl-comm doctor", description=__doc__.split("\n")[0])
    p.add_argument(
        "--nproc", type=int, default=2, help="processes for the distributed check (0: skip)"
    )
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with >= nproc GPUs, else gloo")  # fmt: skip
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout, seconds")
    p.add_argument("--startup", type=float, default=90.0,
                   help="extra seconds per worker for imports and CUDA init")  # fmt: skip
    p.add_argument("--bw-bytes", type=int, default=None,
                   help="bandwidth message size (default 256 MiB GPU, 16 MiB CPU)")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.nproc < 0 or args.timeout <= 0 or args.iters <= 0:
        p.error("--nproc must be >= 0, --timeout and --iters positive")
    if args.backend is None or args.bw_bytes is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.backend = args.backend or ("nccl" if gpus >= max(args.nproc, 1) else "gloo")
        args.bw_bytes = args.bw_bytes or ((256 << 20) if args.backend == "nccl" else (16 << 20))
    report = run_doctor(args)
    print(json.dumps(report, indent=1) if args.json else _fmt_text(report))
    return 0 if report["ok"] else 1
