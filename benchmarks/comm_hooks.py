"""DDP step time with gradient comm hooks: torch's built-ins vs verl_comm's, side by side.

Workload (``../shared/FACTS.md`` section 1): 2 ranks, DDP over ``nn.Sequential`` of 24 x
``nn.Linear(4096, 4096)`` (402.8 M parameters, fp32 weights), input 4096 x 4096, bf16
autocast, loss ``mean(out.float()**2)``, SGD, ``bucket_cap_mb=25``.

Methods (one model + optimizer + hook state each, all alive at once, same seed):

* ``compute_only``: forward/backward/step under ``ddp.no_sync()`` (no communication);
* ``none`` (DDP's fp32 all-reduce, in C++), ``torch_allreduce`` (the same all-reduce from
  torch's Python ``allreduce_hook``: what any Python comm hook costs at least),
  ``torch_bf16`` (``bf16_compress_hook``, CUDA only),
  ``torch_fp16`` (``fp16_compress_hook``), ``torch_powersgd_r<N>`` (``powerSGD_hook``:
  start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True, warm_start=True);
* ``ours_bf16``, ``ours_int8``, ``ours_lowrank_int8_r<N>``, ``ours_auto`` (int8 low rank
  r64 with ``policy: auto``; ``ours_auto_r<N>`` at rank N; its ``step_time`` record carries
  ``auto_choice``: the path it took per bucket and the predicted ends behind it), registered as a user does: ``verl_comm.hooks.
  register_comm_hook(ddp, CompressionConfig(...))`` with only the fields the method names
  (so error statistics are off, the library's default);
* ``reducer_none`` / ``reducer_int8``: no DDP, the same hooks through
  ``verl_comm.reducer.make_reducer(module, CompressionConfig(...))`` (the trainer's
  DeepSpeed path, its defaults: ``find_unused_parameters=True``), for its overhead.

Every record carries ``"api": "public"`` and ``non_default``: the settings that differ
from the defaults of the API the method was built with.

Protocol:

1. Warm-up rounds (``--warmup``, >= 3 so that every compressor is past its start
   iteration) with learning rate 0, so all models keep identical weights and see the
   same per-rank batches.
2. Numerics first, on the last warm-up round: each method's averaged gradient against
   ``none``'s (relative L2 error over all parameters; exact 1e-6, bf16/fp16 2e-2, int8
   5e-2), finite, identical on every rank (fingerprint all-gather). Our low rank is
   compared with a float64 run of the same algorithm on the same inputs (same Q, residuals
   and RNG state, exact all-reduces): bound 0.1; an all-zero or wrongly scaled result is
   >= 1. Torch's PowerSGD: finite, replicas identical, and its norm within 0.5-2x of the
   exact average's (a zero result fails). A failing method is flagged and not timed.
3. ``--rounds`` timed rounds at ``--lr``; in each round every method runs one step, in
   an order rotated per round. A step (zero_grad, forward, backward, reduction, SGD step)
   is timed with CUDA events and ``torch.cuda.synchronize()`` (``perf_counter`` on CPU).
4. Per method: median over rounds of the max across ranks (``rank: "max"``) and each
   rank's own median; wire bytes per rank per step (measured by our hooks, analytic for
   torch's); error-feedback state bytes. On CUDA, ``host_syncs_per_step``: synchronising
   CUDA calls in one step, counted with ``torch.cuda.set_sync_debug_mode("warn")``. On
   CPU, ``hidden_fraction``: one probe step per method times each bucket from its hook call
   to its Future's completion; busy = union of those intervals, exposed = step time minus
   ``compute_only``'s median, hidden = 1 - exposed / busy (clamped to [0, 1]).

Every record of one launch carries the same ``run_id`` and ``world_size``; records are
appended to ``<out>/comm_hooks.jsonl`` and ``<out>/comm_hooks.md`` is generated from all of
them by ``benchmarks/comm_hooks_report.py`` (methods are compared only within a run).

Transport: chosen by the launch environment; ``--transport`` is the label (``local`` at
``--world 1``). Without torchrun the script launches its own ranks, once per label
(``socket`` sets ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` for its pass, ``nvlink``
clears them). Under torchrun (or any launcher setting RANK/WORLD_SIZE/MASTER_ADDR, e.g.
``benchmarks/slow_link_hooks.sh``) give one label.

Usage::

    python benchmarks/comm_hooks.py --smoke --out /tmp/ch           # CPU gloo, < 60 s
    python benchmarks/comm_hooks.py --world 1 --out $OUT           # 1 GPU: the hooks' cost
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
import statistics
import sys
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # comm_hooks_report, _methods
from _comm_hooks_methods import (  # noqa: E402 - after the checkout is importable
    METHODS,
    Method,
    _check,
    _config_of,
    known,
    non_default,
)

from verl_comm.profiler import intervals  # noqa: E402

SOCKET_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU gloo, tiny model, < 60 s (CI)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--transport", default=None, help="label(s): nvlink, socket, local, ...")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default per transport)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--loss-scale", type=float, default=1.0,
                   help="multiply the loss (keeps fp16 gradients out of the subnormal range)")  # fmt: skip
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--link-mbit", type=float, default=None, help="shaped link rate (record)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU even if CUDA is present")
    p.add_argument("--deadline-s", type=float, default=560.0, help="all passes together")
    p.add_argument("--pg-timeout-s", type=float, default=300.0, help="process group timeout")
    p.add_argument("--run-id", default=None, help="shared by every record of this run")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # worker output file
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.dim, a.batch, a.warmup = 4, 64, 64, 4
        a.rounds = a.rounds or 3
        a.transport = a.transport or "gloo"
        a.cpu = True
    a.methods = [m for m in a.methods.split(",") if m]
    bad = sorted(m for m in a.methods if not known(m))
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}, torch_fp16, "
                "torch_powersgd_r<N>, ours_lowrank_int8_r<N>")  # fmt: skip
    if "none" not in a.methods:
        a.methods.insert(0, "none")  # the numerics reference
    if a.warmup < 3:
        p.error("--warmup must be >= 3 (compressors start at iteration 2)")
    if a.world < 1:
        p.error("--world must be >= 1")
    a.run_id = a.run_id or uuid.uuid4().hex[:12]
    return a


# ------------------------------------------------------------------ methods
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


def host_syncs(method: Method, x: torch.Tensor) -> int:
    """Synchronising CUDA calls in one step (``set_sync_debug_mode("warn")`` warnings)."""
    _sync(method.device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            method.step(x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    _sync(method.device)
    return sum("synchroniz" in str(w.message) for w in rec)


def _warm_up_and_check(
    args: argparse.Namespace,
    methods: dict[str, Method],
    names: list[str],
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[dict[str, dict], list[str]]:
    """Warm-up rounds at lr 0 (the last one captured), then the numerics check; returns the
    checks and the methods every rank passed (the ones to time)."""
    for step in range(args.warmup):  # lr 0: weights stay identical across methods
        x = _batch(args, rank, step, device)
        last = step == args.warmup - 1
        # policy auto: its trial steps (verl_comm.hooks.trial) end before the captured round,
        # so the timed rounds run the plan it kept; how many steps that took is recorded
        while last and any(m.settling() for m in methods.values()):
            for m in methods.values():
                if m.settling():
                    m.settle_steps += 1
                    m.step(x)
        for m in methods.values():
            m.capture.on = last
            m.step(x)
            m.capture.on = False
        if rank == 0:
            print(f"[{args.transport}] warm-up round {step} done", flush=True)
    _sync(device)
    checks = _check(methods, world)
    for m in methods.values():
        m.capture.items.clear()
    flags = torch.tensor([float(checks[n]["ok"]) for n in names], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # every rank times the same methods
    timed = [n for n, f in zip(names, flags.tolist()) if f > 0]
    if not timed:
        raise SystemExit("no method passed the numerics check; nothing to time")
    if rank == 0:
        for n in names:
            c = checks[n]
            print(f"[{args.transport}] numerics {n:24s} ok={c['ok']} rel={c['rel_error']} {c['why']}",
                  flush=True)  # fmt: skip
    return checks, timed


def _time_rounds(
    args: argparse.Namespace,
    methods: dict[str, Method],
    timed: list[str],
    rank: int,
    device: torch.device,
    rounds: int,
    cuda: bool,
) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """``rounds`` rounds, methods interleaved (rotated each round); then one more step per
    method for its host syncs (CUDA) or its probed busy time (CPU). Returns the step times
    (ms) per method and those extras."""
    times: dict[str, list[float]] = {n: [] for n in timed}
    for r in range(rounds):
        x = _batch(args, rank, args.warmup + r, device)
        order = timed[r % len(timed) :] + timed[: r % len(timed)]
        for n in order:
            times[n].append(_timed(methods[n], x))
    extra: dict[str, dict] = {n: {} for n in timed}
    x = _batch(args, rank, args.warmup + rounds, device)
    for n in timed:
        m = methods[n]
        if cuda:
            extra[n]["host_syncs_per_step"] = host_syncs(m, x)
        else:
            m.probe.on = True
            step_ms = _timed(m, x)
            m.probe.on = False
            extra[n]["probe"] = (step_ms, intervals.total(m.probe.spans) * 1e3)
    for n in timed:  # policy auto: what it chose per bucket and why (the same on every rank)
        st = methods[n].state
        if getattr(getattr(st, "config", None), "policy", None) == "auto":
            extra[n]["auto_choice"] = st.auto_note()
            extra[n]["settle"] = methods[n].settle_steps
    return times, extra


def worker(args: argparse.Namespace) -> None:
    """One rank: build every method, warm up, check numerics, time, write records."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=args.pg_timeout_s),
        **({"device_id": device} if cuda else {}),
    )
    transport = args.transport
    rounds = args.rounds or (8 if transport in ("socket", "shaped_veth") else 20)
    names = [m for m in args.methods]
    if not cuda and "torch_bf16" in names:
        names.remove("torch_bf16")  # torch's bf16_compress_hook refuses to run without CUDA
    methods = {}
    try:
        t0 = time.perf_counter()
        for n in names:
            methods[n] = Method(n, args, device)
        if rank == 0:
            print(f"[{transport}] built {len(methods)} methods in {time.perf_counter() - t0:.1f} s",
                  flush=True)  # fmt: skip
        checks, timed = _warm_up_and_check(args, methods, names, rank, world, device)
        for m in methods.values():
            for g in m.opt.param_groups:
                g["lr"] = args.lr
        times, extra = _time_rounds(args, methods, timed, rank, device, rounds, cuda)
        local_t = torch.tensor([times[n] for n in timed], dtype=torch.float64, device=device)
        all_t = [torch.zeros_like(local_t) for _ in range(world)]
        dist.all_gather(all_t, local_t)
        extras = {n: (methods[n].wire_bytes(world), methods[n].ef_bytes()) for n in names}
        grad_bf16 = sum(p.numel() * 2 for p in methods["none"].module.parameters())
        if rank == 0:
            recs = _records(args, transport, names, timed, checks, all_t, extras, grad_bf16,
                            rounds, extra, cuda)  # fmt: skip
            _write_part(args, recs)
    finally:
        for m in methods.values():
            m.close()
        methods.clear()
        gc.collect()
        dist.destroy_process_group()


def _records(args, transport, names, timed, checks, all_t, extras, grad_bf16, rounds, extra, cuda):
    from verl_comm.bench.env import commit, dirty, now_iso, versions

    stacked = torch.stack(all_t).cpu()  # (world, methods, rounds)
    if cuda:
        device = f"{torch.cuda.get_device_name(0)} x{args.world}"
    else:
        device = f"cpu gloo x{args.world}"
    base = {
        "benchmark": BENCH,
        "run_id": args.run_id,
        "transport": transport,
        "device": device,
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "world_size": args.world,
        "api": "public",
        "workload": f"{args.layers}x Linear({args.dim},{args.dim}), input {args.batch}x{args.dim}, "
        f"{'bf16 autocast' if cuda else 'fp32'}, loss mean(out^2)"
        f"{f' x {args.loss_scale:g}' if args.loss_scale != 1 else ''}, SGD, "
        f"bucket_cap_mb={args.bucket_cap_mb:g}",
        "rounds": rounds,
        "warmup": args.warmup,
        "load_avg": [round(v, 2) for v in os.getloadavg()],  # 1/5/15 min, at the end of the run
    }
    if args.link_mbit is not None:
        base["link_mbit"] = args.link_mbit
    if not cuda:
        base["note"] = "CPU wall-clock on a shared machine (other jobs may disturb it)"
    compute = None
    if "compute_only" in timed:
        compute = statistics.median(
            stacked[:, timed.index("compute_only"), :].max(0).values.tolist()
        )
    recs = []
    for n in names:
        c = checks[n]
        info = {**base, "hook": n, "config": _config_of(n, args.bucket_cap_mb),
                "non_default": non_default(n, args.bucket_cap_mb), "numerics_ok": c["ok"],
                "rel_error": c["rel_error"], "rel_error_bound": c.get("bound"),
                **{k: c[k] for k in ("vs_none", "reference", "norm_ratio") if k in c}}  # fmt: skip
        if n in timed:
            i = timed.index(n)
            per_round_max = stacked[:, i, :].max(dim=0).values.tolist()
            choice = (
                {"auto_choice": extra[n]["auto_choice"], "auto_settle_steps": extra[n]["settle"]}
                if "auto_choice" in extra.get(n, {})
                else {}
            )
            recs.append({**info, "metric": "step_time", "rank": "max", "unit": "ms",
                         "value": statistics.median(per_round_max),
                         "min_ms": min(per_round_max), "max_ms": max(per_round_max), **choice})  # fmt: skip
            for r in range(stacked.shape[0]):
                recs.append({**info, "metric": "step_time", "rank": r, "unit": "ms",
                             "value": statistics.median(stacked[r, i, :].tolist())})  # fmt: skip
            e = extra.get(n, {})
            if "host_syncs_per_step" in e:
                recs.append({**info, "metric": "host_syncs_per_step", "rank": 0, "unit": "count",
                             "value": e["host_syncs_per_step"],
                             "how": "torch.cuda.set_sync_debug_mode('warn') over one step"})  # fmt: skip
            if "probe" in e and compute is not None and n != "compute_only":
                step_ms, busy_ms = e["probe"]
                if busy_ms > 0:
                    exposed = max(0.0, step_ms - compute)
                    hidden = min(1.0, max(0.0, 1.0 - exposed / busy_ms))
                    recs.append({**info, "metric": "hidden_fraction", "rank": 0, "unit": "ratio",
                                 "value": hidden, "busy_ms": busy_ms, "probe_step_ms": step_ms,
                                 "compute_only_ms": compute})  # fmt: skip
        else:
            recs.append({**info, "metric": "step_time", "rank": "max", "unit": "ms",
                         "value": None, "status": "numerics_failed: " + c["why"]})  # fmt: skip
        (wire, source), ef = extras[n]
        recs.append({**info, "metric": "wire_bytes_per_step", "rank": 0, "unit": "bytes",
                     "value": wire, "source": source})  # fmt: skip
        recs.append({**info, "metric": "ef_state_bytes", "rank": 0, "unit": "bytes",
                     "value": ef, "grad_bytes_bf16": grad_bf16})  # fmt: skip
    return recs


def _write_part(args, recs: list[dict]) -> None:
    path = Path(args.part) if args.part else None
    if path is None:  # under torchrun: merge straight into the results
        merge_outputs(Path(args.out), recs)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def merge_outputs(out: Path, recs: list[dict]) -> None:
    """Append ``recs`` to ``comm_hooks.jsonl`` and regenerate ``comm_hooks.md`` from all."""
    from comm_hooks_report import markdown

    out.mkdir(parents=True, exist_ok=True)
    jl = out / f"{BENCH}.jsonl"
    with jl.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    allr = [json.loads(x) for x in jl.read_text().splitlines() if x.strip()]
    (out / f"{BENCH}.md").write_text(markdown(allr))


# ---------------------------------------------------------------- launch
def _check_env(label: str) -> None:
    sock = all(os.environ.get(k) == v for k, v in SOCKET_ENV.items())
    if label == "socket" and not sock:
        raise SystemExit("--transport socket needs NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 set")
    if label == "nvlink" and any(k in os.environ for k in SOCKET_ENV):
        raise SystemExit("--transport nvlink: unset NCCL_P2P_DISABLE / NCCL_SHM_DISABLE")


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the ranks (``verl_comm.distributed.launch.run_ranks``: one message and nothing
    left behind when a rank fails), once per transport label, and merge the results."""
    from verl_comm.distributed.launch import run_ranks

    default = "local" if args.world == 1 else ("gloo" if args.cpu else "nvlink,socket")
    labels = [x for x in (args.transport or default).split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recs = []
    deadline = time.monotonic() + args.deadline_s
    status = 0
    for label in labels:
        env = {k: v for k, v in os.environ.items() if k not in SOCKET_ENV}
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        if label == "socket":
            env.update(SOCKET_ENV)
        part = out / f".{BENCH}.{label}.part"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--run-id", args.run_id,
               "--transport", label, "--part", str(part)]  # fmt: skip
        res = run_ranks(
            cmd, args.world, base_env=env, env={"OMP_NUM_THREADS": "1"},
            deadline_s=max(deadline - time.monotonic(), 1.0), name=f"comm_hooks [{label}]",
        )  # fmt: skip
        if not res.ok or not part.exists():
            print(f"[{label}] FAILED ({res.message}); no records", file=sys.stderr)
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
                raise SystemExit("under torchrun give one --transport label (nvlink, socket, ...)")
            if not args.smoke and args.transport in ("nvlink", "socket"):
                _check_env(args.transport)
        worker(args)
        return 0
    clean = []
    skip = False
    for a in argv:  # drop --transport/--part/--run-id, the launcher sets them per pass
        if skip:
            skip = False
            continue
        if a in ("--transport", "--part", "--run-id"):
            skip = True
            continue
        if a.startswith(("--transport=", "--part=", "--run-id=")):
            continue
        clean.append(a)
    return launch(args, clean)


if __name__ == "__main__":
    sys.exit(main())
