"""DDP step time with gradient comm hooks: torch's built-ins vs verl_comm's, side by side.

Workload (``../shared/FACTS.md`` section 1): 2 ranks, DDP over ``nn.Sequential`` of 24 x
``nn.Linear(4096, 4096)`` (402.8 M parameters, fp32 weights), input 4096 x 4096, bf16
autocast, loss ``mean(out.float()**2)``, SGD, ``bucket_cap_mb=25``.

Methods (one model + optimizer + hook state each, all alive at once, same seed):

* ``compute_only``: forward/backward/step under ``ddp.no_sync()`` (no communication);
* ``none`` (DDP's fp32 all-reduce), ``torch_bf16`` (``bf16_compress_hook``),
  ``torch_powersgd_r32`` / ``_r128`` (``powerSGD_hook``: start_powerSGD_iter=2,
  min_compression_rate=2, use_error_feedback=True, warm_start=True);
* ``ours_bf16``, ``ours_int8``, ``ours_lowrank_int8_r32`` / ``_r64`` / ``_r128``,
  ``ours_auto`` (int8 low rank r64 with ``policy: auto``), registered with DDP's own
  ``register_comm_hook``;
* ``reducer_none`` / ``reducer_int8``: no DDP, the same hooks through
  ``verl_comm.reducer.BucketedReducer`` (the DeepSpeed path), for its overhead.

Protocol:

1. Warm-up rounds (``--warmup``, >= 3 so that every compressor is past its start
   iteration) with learning rate 0, so all models keep identical weights and see the
   same per-rank batches.
2. Numerics first: after the last warm-up round, each method's averaged gradient is
   compared with ``none``'s (relative L2 error over all parameters) and must be within
   the method's bound (exact 1e-6, bf16 2e-2, int8 5e-2; low rank with error feedback
   < 2: it sends an approximation of gradient + carried residual, so only gross failure
   is caught and the value is reported), finite, and identical on both ranks
   (fingerprint all-gather). A failing method is flagged and not timed.
3. ``--rounds`` timed rounds at ``--lr``; in each round every method runs one step, in
   an order rotated per round. A step (zero_grad, forward, backward, reduction, SGD step)
   is timed with CUDA events and ``torch.cuda.synchronize()`` (``perf_counter`` on CPU).
4. Per method: median over rounds of the max across ranks (``rank: "max"``) and each
   rank's own median; wire bytes per rank per step (measured by our hooks, analytic for
   torch's: ring all-reduce 2(W-1)/W x bytes, PowerSGD's P and Q in fp32); error-feedback
   state bytes (ours: residuals + Q; torch PowerSGD: error_dict + P/Q memories).

Transport: chosen by the launch environment; ``--transport`` is the label. Without
torchrun the script launches its own 2 ranks, once per label in ``--transport``
(``socket`` sets ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` for its pass, ``nvlink``
clears them). Under torchrun give one label; it must agree with the environment.

Output: ``<out>/comm_hooks.jsonl`` (records ``{"benchmark": "comm_hooks", "metric":
"step_time" | "wire_bytes_per_step" | "ef_state_bytes" | "rel_error", "hook", "rank",
"transport", "value", "unit", ...}``; a rerun replaces only its transport's records) and
``<out>/comm_hooks.md``.

Usage::

    python benchmarks/comm_hooks.py --smoke --out /tmp/ch           # CPU gloo, < 60 s
    python benchmarks/comm_hooks.py --transport nvlink,socket --out $OUT   # 2 GPUs
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc_per_node 2 \\
        benchmarks/comm_hooks.py --transport socket --out $OUT
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

BENCH = "comm_hooks"
REPO = Path(__file__).resolve().parents[1]


def _importable_checkout() -> None:
    """Run from a checkout that is not pip-installed (the GPU machine): put the repo on
    sys.path and map ``kernels/`` to ``verl_comm.kernels`` as setup.py's package_dir does."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        import verl_comm.kernels  # noqa: F401
    except ModuleNotFoundError:
        import importlib.util

        import verl_comm

        spec = importlib.util.spec_from_file_location(
            "verl_comm.kernels",
            REPO / "kernels" / "__init__.py",
            submodule_search_locations=[str(REPO / "kernels")],
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["verl_comm.kernels"] = mod
        spec.loader.exec_module(mod)
        verl_comm.kernels = mod


_importable_checkout()
SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
TORCH_HOOKS = ("none", "torch_bf16", "torch_powersgd_r32", "torch_powersgd_r128")
OURS = {  # name -> CompressionConfig fields
    "ours_bf16": {"gradient_compression": "bf16"},
    "ours_int8": {"gradient_compression": "int8"},
    "ours_lowrank_int8_r32": {"gradient_compression": "int8", "compression_rank": 32},
    "ours_lowrank_int8_r64": {"gradient_compression": "int8", "compression_rank": 64},
    "ours_lowrank_int8_r128": {"gradient_compression": "int8", "compression_rank": 128},
    "ours_auto": {"gradient_compression": "int8", "compression_rank": 64, "policy": "auto"},
}
REDUCER = {"reducer_none": {}, "reducer_int8": {"gradient_compression": "int8"}}
METHODS = ("compute_only", *TORCH_HOOKS, *OURS, *REDUCER)
BOUNDS = {"none": 1e-6, "reducer_none": 1e-6, "bf16": 2e-2, "int8": 5e-2, "lowrank": 2.0}


def bound_of(method: str) -> float | None:
    """Relative L2 error bound vs the plain all-reduce (None: not checked)."""
    if method == "compute_only":
        return None
    if method in BOUNDS:
        return BOUNDS[method]
    if "powersgd" in method or "lowrank" in method or method == "ours_auto":
        return BOUNDS["lowrank"]
    return BOUNDS["bf16"] if "bf16" in method else BOUNDS["int8"]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU gloo, tiny model, < 60 s (CI)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--transport", default=None, help="label(s): nvlink, socket, or both")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default per transport)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=560.0, help="all passes together")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # worker output file
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.dim, a.batch, a.warmup = 4, 64, 64, 4
        a.rounds = a.rounds or 3
        a.transport = a.transport or "gloo"
    a.methods = [m for m in a.methods.split(",") if m]
    bad = sorted(set(a.methods) - set(METHODS))
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    if "none" not in a.methods:
        a.methods.insert(0, "none")  # the numerics reference
    if a.warmup < 3:
        p.error("--warmup must be >= 3 (compressors start at iteration 2)")
    return a


# ------------------------------------------------------------------ methods
class Method:
    """One model, its DDP wrapper (or reducer), optimizer and hook state."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        from verl_comm.compression.config import CompressionConfig
        from verl_comm.hooks import HOOKS, CommHookState
        from verl_comm.reducer import BucketedReducer

        self.name, self.device = name, device
        torch.manual_seed(0)
        layers = [torch.nn.Linear(args.dim, args.dim, device=device) for _ in range(args.layers)]
        self.module = torch.nn.Sequential(*layers)
        self.state = None
        self.reducer = None
        ids = [device.index] if device.type == "cuda" else None
        if name in REDUCER:
            cfg = CompressionConfig(bucket_cap_mb=args.bucket_cap_mb, **REDUCER[name])
            self.state = CommHookState(None, cfg, collect_stats=False)
            self.reducer = BucketedReducer(
                self.module, HOOKS[cfg.method], self.state, bucket_cap_mb=args.bucket_cap_mb
            )
            self.model = self.module
        else:
            self.model = torch.nn.parallel.DistributedDataParallel(
                self.module, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb
            )
            if name == "torch_bf16":
                self.model.register_comm_hook(None, default_hooks.bf16_compress_hook)
            elif name.startswith("torch_powersgd_r"):
                self.state = psgd.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=int(name.rsplit("r", 1)[1]),
                    start_powerSGD_iter=2,
                    min_compression_rate=2,
                    use_error_feedback=True,
                    warm_start=True,
                )
                self.model.register_comm_hook(self.state, psgd.powerSGD_hook)
            elif name in OURS:
                cfg = CompressionConfig(bucket_cap_mb=args.bucket_cap_mb, **OURS[name])
                self.state = CommHookState(None, cfg, collect_stats=False)
                self.model.register_comm_hook(self.state, HOOKS[cfg.method])
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.0)

    def step(self, x: torch.Tensor) -> None:
        """zero_grad, forward (bf16 autocast on CUDA), backward, reduction, SGD step."""
        self.opt.zero_grad(set_to_none=True)
        ctx = self.model.no_sync() if self.name == "compute_only" else nullcontext()
        with ctx:
            with torch.autocast(
                self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"
            ):
                out = self.model(x)
            out.float().square().mean().backward()
        if self.reducer is not None:
            self.reducer.finalize()
        self.opt.step()

    def wire_bytes(self, world: int) -> tuple[int, str]:
        """Bytes one rank sends per step, and whether measured or analytic."""
        from verl_comm.compression import ring_allreduce_wire_bytes as ring

        params = list(self.module.parameters())
        n = sum(p.numel() for p in params)
        if self.name == "compute_only":
            return 0, "analytic"
        if self.name == "none":
            return ring(n, world, 4), "analytic"
        if self.name == "torch_bf16":
            return ring(n, world, 2), "analytic"
        if self.name.startswith("torch_powersgd"):
            r = self.state.matrix_approximation_rank
            total = 0
            for p in params:
                if p.dim() > 1:
                    rows, cols = p.shape[0], p[0].numel()
                    if psgd._should_compress(rows, cols, r, 2)[0]:
                        total += ring(r * (rows + cols), world, 4)
                        continue
                total += ring(p.numel(), world, 4)
            return total, "analytic"
        stats = getattr(self.state, "last_stats", {})
        return sum(s.wire_bytes for s in stats.values()), "measured"

    def ef_bytes(self) -> int:
        """Bytes of error-feedback state (residuals, warm-start factors) on this rank."""
        if self.state is None:
            return 0
        if isinstance(self.state, psgd.PowerSGDState):
            dicts = (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict)
            return sum(t.numel() * t.element_size() for d in dicts for t in d.values())
        return int(self.state.ef_state_nbytes())

    def close(self) -> None:
        """Drop the model (before destroy_process_group, FACTS 7)."""
        if self.reducer is not None:
            self.reducer.remove()
        del self.model, self.module, self.opt, self.state, self.reducer


def _batch(args, rank: int, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 * rank + step)
    return torch.randn(args.batch, args.dim, generator=g, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(method: Method, x: torch.Tensor) -> float:
    """Step time in ms (CUDA events on GPU, perf_counter on CPU)."""
    dev = method.device
    _sync(dev)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        method.step(x)
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    method.step(x)
    return (time.perf_counter() - t0) * 1e3


def _check(methods: dict[str, Method], world: int) -> dict[str, dict]:
    """Each method's gradient vs ``none``'s: relative L2 error, finiteness, replicas."""
    ref = [p.grad for p in methods["none"].module.parameters()]
    ref_sq = sum(float(g.double().square().sum()) for g in ref)
    out = {}
    for name, m in methods.items():
        bound = bound_of(name)
        if bound is None:
            out[name] = {"ok": True, "rel_error": None, "why": "not checked (no communication)"}
            continue
        grads = [p.grad for p in m.module.parameters()]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        err_sq = sum(float((g.double() - r.double()).square().sum()) for g, r in zip(grads, ref))
        rel = (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else float("inf")
        fp = torch.tensor(
            [float(g.double().sum()) for g in grads] + [float(g.double().norm()) for g in grads],
            dtype=torch.float64,
            device=grads[0].device,
        )
        allfp = [torch.zeros_like(fp) for _ in range(world)]
        dist.all_gather(allfp, fp)
        same = all(torch.equal(allfp[0], f) for f in allfp[1:])
        ok = finite and same and rel <= bound
        why = "" if ok else f"finite={finite} replicas_identical={same} rel={rel:.3g}>{bound}"
        out[name] = {"ok": ok, "rel_error": rel, "bound": bound, "why": why}
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: build every method, warm up, check numerics, time, write records."""
    warnings.filterwarnings("ignore", message="compression_rank=")  # r32 is asked for
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=300),
        **({"device_id": device} if cuda else {}),
    )
    transport = args.transport
    rounds = args.rounds or (8 if transport == "socket" else 20)
    names = [m for m in METHODS if m in args.methods]
    if not cuda and "torch_bf16" in names:
        names.remove("torch_bf16")  # torch's bf16_compress_hook refuses to run without CUDA
    methods = {}
    try:
        t0 = time.perf_counter()
        for n in names:
            methods[n] = Method(n, args, device)
        if rank == 0:
            print(f"[{transport}] built {len(methods)} methods in {time.perf_counter() - t0:.1f} s")
        for step in range(args.warmup):  # lr 0: weights stay identical across methods
            x = _batch(args, rank, step, device)
            for m in methods.values():
                m.step(x)
        _sync(device)
        checks = _check(methods, world)
        flags = torch.tensor([float(checks[n]["ok"]) for n in names], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank times the same methods
        timed = [n for n, f in zip(names, flags.tolist()) if f > 0]
        if not timed:
            raise SystemExit("no method passed the numerics check; nothing to time")
        if rank == 0:
            for n in names:
                c = checks[n]
                print(
                    f"[{transport}] numerics {n:24s} ok={c['ok']} rel={c['rel_error']} {c['why']}"
                )
        for m in methods.values():
            for g in m.opt.param_groups:
                g["lr"] = args.lr
        times = {n: [] for n in timed}
        for r in range(rounds):
            x = _batch(args, rank, args.warmup + r, device)
            order = timed[r % len(timed) :] + timed[: r % len(timed)]
            for n in order:
                times[n].append(_timed(methods[n], x))
        local_t = torch.tensor([times[n] for n in timed], dtype=torch.float64, device=device)
        all_t = [torch.zeros_like(local_t) for _ in range(world)]
        dist.all_gather(all_t, local_t)
        extras = {n: (methods[n].wire_bytes(world), methods[n].ef_bytes()) for n in names}
        grad_bf16 = sum(p.numel() * 2 for p in methods["none"].module.parameters())
        if rank == 0:
            recs = _records(args, transport, names, timed, checks, all_t, extras, grad_bf16, rounds)
            _write_part(args, recs)
    finally:
        for m in methods.values():
            m.close()
        methods.clear()
        gc.collect()
        dist.destroy_process_group()


def _records(args, transport, names, timed, checks, all_t, extras, grad_bf16, rounds):
    from verl_comm.bench.env import commit, now_iso, versions

    stacked = torch.stack(all_t).cpu()  # (world, methods, rounds)
    if torch.cuda.is_available() and not args.smoke:
        device = f"{torch.cuda.get_device_name(0)} x{args.world}"
    else:
        device = f"cpu gloo x{args.world}"
    base = {
        "benchmark": BENCH,
        "transport": transport,
        "device": device,
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "world_size": args.world,
        "workload": f"{args.layers}x Linear({args.dim},{args.dim}), input {args.batch}x{args.dim}, "
        f"{'bf16 autocast' if 'cpu' not in device else 'fp32'}, SGD, bucket_cap_mb="
        f"{args.bucket_cap_mb:g}",
        "rounds": rounds,
        "warmup": args.warmup,
    }
    recs = []
    for n in names:
        c = checks[n]
        info = {**base, "hook": n, "config": _config_of(n), "numerics_ok": c["ok"],
                "rel_error": c["rel_error"], "rel_error_bound": c.get("bound")}  # fmt: skip
        if n in timed:
            i = timed.index(n)
            per_round_max = stacked[:, i, :].max(dim=0).values.tolist()
            recs.append({**info, "metric": "step_time", "rank": "max", "unit": "ms",
                         "value": statistics.median(per_round_max),
                         "min_ms": min(per_round_max), "max_ms": max(per_round_max)})  # fmt: skip
            for r in range(stacked.shape[0]):
                recs.append({**info, "metric": "step_time", "rank": r, "unit": "ms",
                             "value": statistics.median(stacked[r, i, :].tolist())})  # fmt: skip
        else:
            recs.append({**info, "metric": "step_time", "rank": "max", "unit": "ms",
                         "value": None, "status": "numerics_failed: " + c["why"]})  # fmt: skip
        (wire, source), ef = extras[n]
        recs.append({**info, "metric": "wire_bytes_per_step", "rank": 0, "unit": "bytes",
                     "value": wire, "source": source})  # fmt: skip
        recs.append({**info, "metric": "ef_state_bytes", "rank": 0, "unit": "bytes",
                     "value": ef, "grad_bytes_bf16": grad_bf16})  # fmt: skip
    return recs


def _config_of(name: str) -> dict:
    """The settings a method ran with (for the records)."""
    if name in OURS or name in REDUCER:
        from verl_comm.compression.config import CompressionConfig

        return CompressionConfig(**(OURS.get(name) or REDUCER[name])).model_dump()
    if name.startswith("torch_powersgd_r"):
        return {"matrix_approximation_rank": int(name.rsplit("r", 1)[1]),
                "start_powerSGD_iter": 2, "min_compression_rate": 2,
                "use_error_feedback": True, "warm_start": True}  # fmt: skip
    return {}


# --------------------------------------------------------------- outputs
def _write_part(args, recs: list[dict]) -> None:
    path = Path(args.part) if args.part else None
    if path is None:  # under torchrun: merge straight into the results
        merge_outputs(Path(args.out), recs)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def merge_outputs(out: Path, recs: list[dict]) -> None:
    """Write ``comm_hooks.jsonl`` (replacing records of the same transports) and ``.md``."""
    out.mkdir(parents=True, exist_ok=True)
    jl = out / f"{BENCH}.jsonl"
    mine = {r["transport"] for r in recs}
    old = []
    if jl.exists():
        old = [json.loads(x) for x in jl.read_text().splitlines() if x.strip()]
        old = [r for r in old if r.get("transport") not in mine]
    allr = old + recs
    jl.write_text("".join(json.dumps(r) + "\n" for r in allr))
    (out / f"{BENCH}.md").write_text(markdown(allr))


def markdown(recs: list[dict]) -> str:
    """Markdown table per transport and the issue's targets as measured."""
    lines = [f"# {BENCH}", ""]
    if recs:
        r0 = recs[0]
        lines += [f"Workload: {r0['workload']}; {r0['device']}; warm-up {r0['warmup']}, "
                  f"median over {r0['rounds']} rounds of the max across ranks. "
                  f"Commit {r0['commit']}, {r0['date']}, versions {r0['versions']}.", ""]  # fmt: skip
    for tr in sorted({r["transport"] for r in recs}):
        rs = [r for r in recs if r["transport"] == tr]
        t = {r["hook"]: r for r in rs if r["metric"] == "step_time" and r["rank"] == "max"}
        wb = {r["hook"]: r for r in rs if r["metric"] == "wire_bytes_per_step"}
        ef = {r["hook"]: r for r in rs if r["metric"] == "ef_state_bytes"}
        none = (t.get("none") or {}).get("value")
        lines += [f"## transport: {tr}", "",
                  "| hook | step ms | vs none | wire MB/step/rank | EF state MB | rel err | numerics |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for h, r in t.items():
            v = r["value"]
            rel = r.get("rel_error")
            lines.append(
                f"| {h} | {'-' if v is None else f'{v:.2f}'} | "
                f"{'-' if v is None or not none else f'{v / none:.2f}x'} | "
                f"{wb[h]['value'] / 1e6:.2f} ({wb[h]['source']}) | {ef[h]['value'] / 1e6:.1f} | "
                f"{'-' if rel is None else f'{rel:.3g}'} | "
                f"{'ok' if r['numerics_ok'] else r.get('status', 'FAILED')} |"
            )
        lines += [""] + _targets(tr, t, ef) + [""]
    return "\n".join(lines) + "\n"


def _targets(tr: str, t: dict, ef: dict) -> list[str]:
    def ratio(a: str, b: str) -> float | None:
        va, vb = (t.get(a) or {}).get("value"), (t.get(b) or {}).get("value")
        return None if va is None or vb is None else va / vb

    checks = []
    if tr == "socket":
        checks = [("ours_lowrank_int8_r128", "torch_powersgd_r128", 0.30),
                  ("ours_lowrank_int8_r32", "torch_powersgd_r32", 0.45),
                  ("ours_int8", "torch_bf16", 0.60)]  # fmt: skip
    elif tr == "nvlink":
        checks = [("ours_auto", "none", 1.05)]
    out = []
    for a, b, lim in checks:
        r = ratio(a, b)
        got = "not measured" if r is None else f"{r:.2f} ({'met' if r <= lim else 'MISSED'})"
        out.append(f"- target {a} <= {lim} x {b}: {got}")
    for h, r in ef.items():
        if h.startswith("ours") and r["value"]:
            ok = r["value"] <= r["grad_bytes_bf16"]
            out.append(f"- target EF state {h} <= gradients in bf16: "
                       f"{r['value'] / 1e6:.1f} MB vs {r['grad_bytes_bf16'] / 1e6:.1f} MB "
                       f"({'met' if ok else 'MISSED'})")  # fmt: skip
    return out


# ---------------------------------------------------------------- launch
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_env(label: str) -> None:
    sock = all(os.environ.get(k) == v for k, v in SOCKET_ENV.items())
    if label == "socket" and not sock:
        raise SystemExit("--transport socket needs NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 set")
    if label == "nvlink" and any(k in os.environ for k in SOCKET_ENV):
        raise SystemExit("--transport nvlink: unset NCCL_P2P_DISABLE / NCCL_SHM_DISABLE")


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the 2 ranks as subprocesses, once per transport label, and merge results."""
    labels = [x for x in (args.transport or "nvlink,socket").split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recs = []
    deadline = time.monotonic() + args.deadline_s
    status = 0
    for label in labels:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE=str(args.world), OMP_NUM_THREADS="1")  # fmt: skip
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        for k in SOCKET_ENV:
            env.pop(k, None)
        if label == "socket":
            env.update(SOCKET_ENV)
        part = out / f".{BENCH}.{label}.part"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv,
               "--transport", label, "--part", str(part)]  # fmt: skip
        procs = [
            subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(args.world)
        ]
        codes: list[int | None] = []
        try:
            for p in procs:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1.0)))
        except subprocess.TimeoutExpired:
            print(f"[{label}] past --deadline-s {args.deadline_s:g}: killed", file=sys.stderr)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if len(codes) != len(procs) or any(codes) or not part.exists():
            print(f"[{label}] FAILED, rank exit codes {codes}; no records", file=sys.stderr)
            status = 1
            continue
        recs += [json.loads(x) for x in part.read_text().splitlines() if x.strip()]
        part.unlink()
    if recs:
        merge_outputs(out, recs)
        print((out / f"{BENCH}.md").read_text())
    return status


def main(argv: list[str] | None = None) -> int:
    """Launch or run the hook benchmark (see the module docstring); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    if "RANK" in os.environ:
        if args.part is None:  # torchrun: one label, checked against the environment
            if not args.transport or "," in args.transport:
                raise SystemExit("under torchrun give one --transport label (nvlink or socket)")
            if not args.smoke:
                _check_env(args.transport)
        worker(args)
        return 0
    clean = []
    skip = False
    for a in argv:  # drop --transport/--part, the launcher sets them per pass
        if skip:
            skip = False
            continue
        if a in ("--transport", "--part"):
            skip = True
            continue
        if a.startswith(("--transport=", "--part=")):
            continue
        clean.append(a)
    return launch(args, clean)


if __name__ == "__main__":
    sys.exit(main())
