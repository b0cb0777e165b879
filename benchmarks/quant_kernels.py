"""Bandwidth of the int8 block kernels against a device-to-device copy and eager torch.

Methods, side by side in one process on one GPU: ``copy`` (``dst.copy_(src)`` of the input
tensor), ``quantize``, ``quantize_sr`` (stochastic rounding), ``quantize_ef`` (fused error
feedback, residual in the input dtype), ``dequant_sum_requant`` (W = 2, 4, 8 chunks read from
a packed (W, M + 4M/B) receive buffer, M = N / W), ``dequantize`` (scale 1/2, bf16 and fp32
out), and the same maths in eager torch (``torch_*``: the public references run on the GPU).

Protocol: numerics first (every Triton result equals the eager-torch reference on the same
GPU bit for bit; stochastic rounding is checked on a 16M-element prefix), then for each
group of methods: warm-up, ``--rounds`` rounds with the methods interleaved, the L2 flushed
(a 256 MiB write) before each timed call, CUDA events around each call, median over rounds.
GB/s = (bytes read + bytes written) / median time / 1e9; the copy counts 2 x its bytes.
Bytes per kernel (N elements, B block, e input element size):
quantize N(e + 1 + 4/B); quantize_ef N(3e + 1 + 4/B); dequant_sum_requant N(1 + 4/B)(1 + 1/W);
dequantize N(1 + 4/B + e_out).

Output: ``<out>/quant_kernels.jsonl`` (one record per (metric, dtype, block[, w]), with
``ratio_to_copy`` and ``speedup_vs_torch``), ``<out>/quant_kernels.md`` (table + targets).
A numerics mismatch is recorded (``numerics_ok: false``), printed, and makes the exit code 1.

Usage::

    python benchmarks/quant_kernels.py --out DIR                # GPU, 256M elements (~2 min)
    python benchmarks/quant_kernels.py --smoke --out /tmp/q     # CPU: interpreter + references
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

BENCH = "quant_kernels"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SWEEP = ((2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options of the kernel benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="output folder")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, < 60 s")
    p.add_argument("--numel", type=int, default=None, help="N (default 2**28 on GPU, 2**14 smoke)")
    p.add_argument("--blocks", default="32,64,128,256")
    p.add_argument("--ws", default="2,4,8", help="W values of dequant_sum_requant")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 30; 1 smoke)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also time launch configs at B=128")
    p.add_argument("--commit", default=None, help="git commit to record (default: git HEAD)")
    return p.parse_args(argv)


class Timer:
    """Interleaved timing: CUDA events + L2 flush on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, rounds: int, warmup: int) -> None:
        self.device, self.rounds, self.warmup = device, rounds, warmup
        self.cuda = device.type == "cuda"
        self.flush_buf = (
            torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda else None
        )

    def run(self, methods: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Median seconds per method over the rounds (methods interleaved within a round)."""
        for _ in range(self.warmup):
            for fn in methods.values():
                fn()
        samples: dict[str, list] = {k: [] for k in methods}
        for _ in range(self.rounds):
            for name, fn in methods.items():
                if self.cuda:
                    self.flush_buf.zero_()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    samples[name].append((start, end))
                else:
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return {
                k: statistics.median(s.elapsed_time(e) / 1e3 for s, e in v)
                for k, v in samples.items()
            }
        return {k: statistics.median(v) for k, v in samples.items()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two results (NaN == NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(
            torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
        )
    return bool(torch.equal(a, b))


def all_same(got, want) -> bool:
    """True when every output tensor equals its reference (bit for bit, NaN == NaN)."""
    return all(same(a, b) for a, b in zip(got, want))


def environment(device: torch.device, commit: str | None) -> dict:
    """Device name, versions, date, commit and dirty flag for the records."""
    import triton

    from verl_comm.bench.env import dirty

    if commit is None:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    versions = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        versions["cuda"] = torch.version.cuda
    return {
        "device": name,
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "dirty": dirty(),
    }


class Bench:
    """Runs the method groups and collects the records (one instance per benchmark run)."""

    def __init__(
        self, K, args: argparse.Namespace, device: torch.device, n: int, out_dir: Path
    ) -> None:
        self.K, self.args, self.device, self.n = K, args, device, n
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        self.T = {"backend": "triton" if device.type == "cuda" or interp else "torch"}
        self.E = {"backend": "torch"}
        self.sweep = args.sweep and device.type == "cuda"
        self.env = environment(device, args.commit)
        rounds = args.rounds or (1 if args.smoke else 30)
        warmup = min(args.warmup, 1) if args.smoke else args.warmup
        self.timer = Timer(device, rounds, warmup)
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.records: list[dict] = []
        self.failures: list[str] = []
        self.copy_gbps: dict[str, float] = {}
        self.jsonl = out_dir / f"{BENCH}.jsonl"
        self.jsonl.write_text("")

    def emit(
        self,
        metric: str,
        dtype: str,
        block: int | None,
        nbytes: int,
        seconds: float,
        ok: bool,
        **extra,
    ) -> dict:
        """Append one record (also to the JSONL at once, so a killed run keeps its rows)."""
        rec = {
            "benchmark": BENCH,
            "metric": metric,
            "dtype": dtype,
            "block": block,
            "value": float(f"{nbytes / seconds / 1e9:.5g}"),
            "unit": "GB/s",
            "time_us": float(f"{seconds * 1e6:.5g}"),
            "bytes": nbytes,
            "numel": self.n,
            "numerics_ok": ok,
            **extra,
            **self.env,
        }
        self.records.append(rec)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        w = extra.get("w", "")
        print(
            f"{metric:28s} {dtype:5s} B={block!s:4s} {w!s:>2} {rec['value']:10.4g} GB/s {rec['time_us']:10.4g} us ok={ok}",
            flush=True,
        )
        return rec

    def check(self, name: str, ok: bool) -> bool:
        """Record a numerics failure loudly."""
        if not ok:
            self.failures.append(name)
            print(f"NUMERICS MISMATCH: {name}", file=sys.stderr, flush=True)
        return ok

    def emit_times(
        self, times: dict[str, float], dtype: str, block: int, nbytes: int, ok: bool, **extra
    ) -> None:
        """Records for keys ``metric`` or ``sweep_metric/tile/warps``."""
        for key, t in times.items():
            more = dict(extra)
            if key.startswith("sweep_"):
                key, tile, warps = key.split("/")
                more.update(tile=int(tile), num_warps=int(warps))
            self.emit(key, dtype, block, nbytes, t, ok, **more)

    def quantize_group(self, dname: str, blocks: list[int]) -> None:
        """copy, quantize, quantize_sr, quantize_ef (+ torch_*) for one input dtype."""
        K, T, E, n = self.K, self.T, self.E, self.n
        dtype = DTYPES[dname]
        es = torch.finfo(dtype).bits // 8
        x = torch.randn(n, generator=self.gen, device=self.device).to(dtype)
        dst = torch.empty_like(x)
        res = (torch.randn(n, generator=self.gen, device=self.device) * 1e-3).to(dtype)
        oks: dict[str, bool] = {}
        for b in blocks:
            oks[f"quantize{b}"] = self.check(
                f"quantize {dname} B={b}", all_same(K.quantize(x, b, **T), K.quantize(x, b, **E))
            )
            r1, r2 = res.clone(), res.clone()
            got, want = K.quantize_ef(x, r1, b, **T), K.quantize_ef(x, r2, b, **E)
            oks[f"quantize_ef{b}"] = self.check(
                f"quantize_ef {dname} B={b}", all_same(got, want) and same(r1, r2)
            )
            del r1, r2, got, want
        sr = {"stochastic": True, "seed": 1234, "offset": 1 << 33}
        pre = x[: min(n, 1 << 24)]
        oks["quantize_sr128"] = self.check(
            f"quantize_sr {dname}",
            all_same(K.quantize(pre, 128, **sr, **T), K.quantize(pre, 128, **sr, **E)),
        )
        oks["torch_quantize128"] = oks["torch_quantize_ef128"] = True  # the reference itself
        methods: dict[str, Callable[[], object]] = {"copy": lambda: dst.copy_(x)}
        for b in blocks:
            methods[f"quantize/{b}"] = lambda b=b: K.quantize(x, b, **T)
            methods[f"quantize_ef/{b}"] = lambda b=b: K.quantize_ef(x, res, b, **T)
        methods["quantize_sr/128"] = lambda: K.quantize(x, 128, **sr, **T)
        methods["torch_quantize/128"] = lambda: K.quantize(x, 128, **E)
        methods["torch_quantize_ef/128"] = lambda: K.quantize_ef(x, res, 128, **E)
        times = self.timer.run(methods)
        self.copy_gbps[dname] = self.emit("copy", dname, None, 2 * n * es, times.pop("copy"), True)[
            "value"
        ]
        for key, t in times.items():
            metric, b = key.split("/")
            nbytes = n * ((3 if "_ef" in metric else 1) * es + 1) + 4 * n // int(b)
            self.emit(metric, dname, int(b), nbytes, t, oks[f"{metric}{b}"])
        if self.sweep:
            sweep: dict[str, Callable[[], object]] = {}
            for tile, warps in SWEEP:
                cfg = {"launch": (tile, warps), **T}
                sweep[f"sweep_quantize/{tile}/{warps}"] = lambda c=cfg: K.quantize(x, 128, **c)
                sweep[f"sweep_quantize_ef/{tile}/{warps}"] = lambda c=cfg: K.quantize_ef(
                    x, res, 128, **c
                )
            for key, t in self.timer.run(sweep).items():
                metric, tile, warps = key.split("/")
                nbytes = n * ((3 if "_ef" in metric else 1) * es + 1) + 4 * n // 128
                ok = oks[f"{metric[6:]}128"]
                self.emit(metric, dname, 128, nbytes, t, ok, tile=int(tile), num_warps=int(warps))

    def dsr_group(self, b: int, w: int, last_w: bool) -> None:
        """dequant_sum_requant over W chunks of M = N / W, from a packed receive buffer."""
        K, T, E, m = self.K, self.T, self.E, self.n // w
        codes = torch.randint(
            -127, 128, (w, m), generator=self.gen, device=self.device, dtype=torch.int8
        )
        scales = torch.rand(w, m // b, generator=self.gen, device=self.device) * 1e-2
        c, s = K.unpack(K.pack(codes, scales), b)  # strided row views, as an all-to-all delivers
        del codes, scales
        got = K.dequant_sum_requant(c, s, b, return_sum=True, **T)
        ok = self.check(
            f"dequant_sum_requant B={b} W={w}",
            all_same(got, K.dequant_sum_requant(c, s, b, return_sum=True, **E)),
        )
        del got
        methods: dict[str, Callable[[], object]] = {
            "dequant_sum_requant": lambda: K.dequant_sum_requant(c, s, b, **T)
        }
        if b == 128:
            methods["torch_dequant_sum_requant"] = lambda: K.dequant_sum_requant(c, s, 128, **E)
            if self.sweep and last_w:
                for tile, warps in SWEEP:
                    cfg = {"launch": (tile, warps), **T}
                    methods[f"sweep_dequant_sum_requant/{tile}/{warps}"] = lambda c_=cfg: (
                        K.dequant_sum_requant(c, s, 128, **c_)
                    )
        nbytes = (w * m + m) * (b + 4) // b
        self.emit_times(self.timer.run(methods), "int8", b, nbytes, ok, w=w)

    def dequantize_group(self, b: int) -> None:
        """dequantize (scale 1/2) into bf16 and fp32 outputs."""
        K, T, E, n = self.K, self.T, self.E, self.n
        codes, scales = K.quantize(torch.randn(n, generator=self.gen, device=self.device), b, **T)
        for oname, odt in DTYPES.items():
            out = torch.empty(n, dtype=odt, device=self.device)
            want = K.dequantize(codes, scales, b, scale=0.5, out_dtype=odt, **E)
            ok = self.check(
                f"dequantize B={b} {oname}",
                same(K.dequantize(codes, scales, b, scale=0.5, out=out, **T), want),
            )
            del want
            methods: dict[str, Callable[[], object]] = {
                "dequantize": lambda o=out: K.dequantize(codes, scales, b, scale=0.5, out=o, **T)
            }
            if b == 128:
                methods["torch_dequantize"] = lambda o=out: K.dequantize(
                    codes, scales, 128, scale=0.5, out=o, **E
                )
                if self.sweep and oname == "bf16":
                    for tile, warps in SWEEP:
                        cfg = {"launch": (tile, warps), **T}
                        methods[f"sweep_dequantize/{tile}/{warps}"] = lambda o=out, c_=cfg: (
                            K.dequantize(codes, scales, 128, scale=0.5, out=o, **c_)
                        )
            nbytes = n * (1 + torch.finfo(odt).bits // 8) + 4 * n // b
            self.emit_times(self.timer.run(methods), oname, b, nbytes, ok)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit code 1 when any numerics check failed."""
    args = parse_args(argv)
    if args.smoke or not torch.cuda.is_available():
        if not args.smoke:
            print("no CUDA device: running the --smoke configuration", file=sys.stderr)
            args.smoke = True
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    from verl_comm import kernels as K  # after TRITON_INTERPRET is settled

    n = args.numel or ((1 << 14) if args.smoke else (1 << 28))
    blocks = [int(b) for b in args.blocks.split(",")]
    ws = [int(w) for w in args.ws.split(",")]
    if args.smoke:
        blocks, ws = [b for b in blocks if b in (32, 128)] or blocks[:1], ws[:2]
    if n % (max(ws) * max(blocks) * 16):
        raise SystemExit(f"--numel must be a multiple of {max(ws) * max(blocks) * 16}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(K, args, device, n, out_dir)
    groups: list[tuple[str, Callable[[], None]]] = [
        (f"quantize {d}", lambda d=d: bench.quantize_group(d, blocks)) for d in DTYPES
    ]
    for b in blocks:
        for w in ws:
            groups.append(
                (f"dsr B={b} W={w}", lambda b=b, w=w: bench.dsr_group(b, w, w == max(ws)))
            )
        groups.append((f"dequantize B={b}", lambda b=b: bench.dequantize_group(b)))
    for name, run_group in groups:
        try:
            run_group()
        except Exception as exc:  # record, keep measuring the other groups, exit 1 at the end
            bench.check(f"{name}: {type(exc).__name__}: {exc}", False)
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not bench.records:
        raise SystemExit("no measurement succeeded: " + "; ".join(bench.failures))
    finish(bench.records, bench.copy_gbps, out_dir, bench.env, bench.failures)
    return 1 if bench.failures else 0


def finish(
    records: list[dict], copy_gbps: dict, out_dir: Path, env: dict, failures: list[str]
) -> None:
    """Add ratios to the records, rewrite the JSONL, write the markdown table with targets."""
    roof = max(copy_gbps.values(), default=float("nan"))
    torch_gbps = {
        (r["metric"][6:], r["dtype"], r["block"], r.get("w")): r["value"]
        for r in records
        if r["metric"].startswith("torch_")
    }
    for r in records:
        if r["metric"] == "copy":
            continue
        base = copy_gbps.get(r["dtype"], roof)
        r["ratio_to_copy"] = float(f"{r['value'] / base:.4g}")
        t = torch_gbps.get((r["metric"], r["dtype"], r["block"], r.get("w")))
        if t and not r["metric"].startswith(("torch_", "sweep_")):
            r["speedup_vs_torch"] = float(f"{r['value'] / t:.4g}")
    with (out_dir / f"{BENCH}.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    lines = [
        f"# {BENCH}: {env['device']}, N = {records[0]['numel']:,} elements",
        "",
        f"{env['versions']}, {env['date']}, commit {env['commit']}. GB/s counts bytes read + written; "
        "dequant_sum_requant and dequantize are compared with the fastest copy."
        + (
            " CPU smoke run (interpreter): not a performance measurement."
            if env["device"] == "cpu" or "cpu" in str(env["versions"].get("torch"))
            else ""
        ),
        "",
        "| metric | dtype | B | W | tile/warps | GB/s | x copy | x torch | time (us) | numerics |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        cfg = f"{r['tile']}/{r['num_warps']}" if "tile" in r else ""
        lines.append(
            f"| {r['metric']} | {r['dtype']} | {r['block'] or ''} | {r.get('w', '')} | {cfg} | {r['value']:.4g} | "
            f"{r.get('ratio_to_copy', '')} | {r.get('speedup_vs_torch', '')} | {r['time_us']:.4g} | "
            f"{'ok' if r['numerics_ok'] else 'WRONG'} |"
        )
    lines += ["", "## Targets", ""]
    for name, ok, detail in targets(records):
        lines.append(f"- {'met' if ok else 'NOT met'}: {name} ({detail})")
    if failures:
        lines += ["", "## Numerics failures", "", *[f"- {f}" for f in failures]]
    (out_dir / f"{BENCH}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-(len(targets(records)) + 1) :]))


def targets(records: list[dict]) -> list[tuple[str, bool, str]]:
    """The issue's targets evaluated on the records: (name, met, detail)."""
    rows = []
    get = {(r["metric"], r["dtype"], r["block"], r.get("w")): r for r in records}
    for metric in ("quantize", "quantize_ef"):
        for d in DTYPES:
            r = get.get((metric, d, 128, None))
            if r:
                rows.append(
                    (
                        f"{metric} {d} B=128 >= 0.85x copy",
                        r["ratio_to_copy"] >= 0.85,
                        f"{r['ratio_to_copy']}x",
                    )
                )
    for w in (2, 4, 8):
        r = get.get(("dequant_sum_requant", "int8", 128, w))
        if r:
            rows.append(
                (
                    f"dequant_sum_requant W={w} B=128 >= 0.80x copy",
                    r["ratio_to_copy"] >= 0.80,
                    f"{r['ratio_to_copy']}x",
                )
            )
    for r in records:
        if "speedup_vs_torch" in r:
            rows.append(
                (
                    f"{r['metric']} {r['dtype']} B=128{' W=' + str(r['w']) if r.get('w') else ''} >= 8x eager torch",
                    r["speedup_vs_torch"] >= 8,
                    f"{r['speedup_vs_torch']}x",
                )
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
