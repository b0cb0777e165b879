"""One rank of the doctor's distributed check (``python -m verl_comm.doctor.selftest``).

Launched N times by :mod:`verl_comm.doctor`; each step prints one line
``DOCTOR {json}`` as soon as it finishes, so the parent knows which step a hung or killed
rank reached. Steps, each bounded by the collective timeout of :func:`init_distributed`:

1. ``init``: rendezvous + ``init_process_group`` (eager NCCL init with ``device_id``).
2. ``allreduce_correctness``: SUM of rank-dependent small integers,
   ``x_r[i] = ((i + 3 r) mod 7) - 3``, sizes 1, 1023 and 2^20 + 3, fp32 and bf16. Every
   partial sum is an integer of magnitude <= 3 W, exact in bf16 for W <= 64, so the result
   is compared exactly against the sum computed in int64; the first bad index is reported.
3. ``latency``: 4-byte all-reduce, median of ``iters`` host-timed calls (synchronised).
4. ``bandwidth``: ``bw_bytes`` fp32 all-reduce, median per-call time (CUDA events on GPU),
   algbw = S / t, busbw = algbw x 2(n-1)/n (nccl-tests' all_reduce factor).

Times are the max across ranks of each rank's median (the slowest rank bounds a collective).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from verl_comm.distributed.context import DistContext, init_distributed

SIZES = (1, 1023, (1 << 20) + 3)
DTYPES = (torch.float32, torch.bfloat16)


def emit(step: str, **fields) -> None:
    """Print one ``DOCTOR {json}`` line (flushed) for the parent."""
    print("DOCTOR " + json.dumps({"step": step, **fields}), flush=True)


def pattern(n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: int64 ``(n,)``, ``((i + 3 rank) mod 7) - 3``."""
    return (torch.arange(n, dtype=torch.int64) + 3 * rank) % 7 - 3


def check_allreduce(ctx: DistContext) -> list[dict]:
    """Exact all-reduce correctness for :data:`SIZES` x :data:`DTYPES`; one dict per case
    with ``ok``, ``first_bad_index``, ``got`` and ``expected`` at that index."""
    cases = []
    for dtype in DTYPES:
        for n in SIZES:
            expected = sum(pattern(n, r) for r in range(ctx.world_size))
            t = pattern(n, ctx.rank).to(dtype).to(ctx.device)
            ctx.all_reduce(t)
            got = t.to(torch.int64 if dtype == torch.float32 else torch.float32).cpu()
            bad = (got.to(torch.float64) != expected.to(torch.float64)).nonzero()
            case = {"dtype": str(dtype).replace("torch.", ""), "numel": n, "ok": not len(bad)}
            if len(bad):
                i = int(bad[0, 0])
                case.update(first_bad_index=i, got=float(got[i]), expected=int(expected[i]))
            cases.append(case)
    return cases


def _max_across(ctx: DistContext, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    ctx.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_allreduce(ctx: DistContext, nbytes: int, iters: int, warmup: int) -> float:
    """Median seconds per fp32 all-reduce of ``nbytes`` bytes on this rank, max over ranks.

    GPU: CUDA events around each call; CPU: ``time.perf_counter`` around each call.
    """
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=ctx.device)
    for _ in range(warmup):
        ctx.all_reduce(t)
    times = []
    cuda = ctx.device.type == "cuda"
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(ctx.device)
            start.record()
            dist.all_reduce(t)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
    return _max_across(ctx, statistics.median(times))


def run(args: argparse.Namespace) -> int:
    """Run every step as rank ``args.rank``; return 0 when all passed, 1 otherwise."""
    t0 = time.perf_counter()
    try:
        ctx = init_distributed(
            args.backend,
            args.timeout,
            rank=args.rank,
            world_size=args.world,
            master_addr="127.0.0.1",
            master_port=args.port,
        )
    except Exception as e:
        emit("init", ok=False, error=f"{type(e).__name__}: {e}", s=time.perf_counter() - t0)
        return 1
    emit("init", ok=True, s=time.perf_counter() - t0, device=str(ctx.device))
    ok = True
    steps = [
        ("allreduce_correctness", lambda: {"cases": check_allreduce(ctx)}),
        ("latency", lambda: {"bytes": 4, "s": time_allreduce(ctx, 4, args.iters, 5)}),
        (
            "bandwidth",
            lambda: {
                "bytes": args.bw_bytes,
                "s": time_allreduce(ctx, args.bw_bytes, args.iters, 3),
            },
        ),
    ]
    for name, fn in steps:
        t1 = time.perf_counter()
        try:
            out = fn()
            passed = all(c["ok"] for c in out.get("cases", []))
        except Exception as e:
            emit(name, ok=False, error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t1)
            return 1
        if name == "bandwidth":
            n = ctx.world_size
            out["algbw_GBps"] = out["bytes"] / out["s"] / 1e9
            out["busbw_GBps"] = out["algbw_GBps"] * 2 * (n - 1) / n
        emit(name, ok=passed, wall_s=time.perf_counter() - t1, **out)
        ok &= passed
    gc.collect()
    ctx.destroy()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Parse the worker's arguments (set by the doctor) and run."""
    p = argparse.ArgumentParser(prog="python -m verl_comm.doctor.selftest")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--bw-bytes", type=int, default=1 << 24)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
