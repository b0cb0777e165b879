"""Where a comm hook spends a DDP step on one GPU (world size 1): host syncs with the stack
that made each, torch.profiler's top CUDA kernels, step time. For finding the cost of the
hooks (issue 14), not for the committed figures (those come from ``comm_hooks.py``).

Usage (one GPU)::

    python benchmarks/gpu/hooks_profile.py --out $OUT [--methods ours_int8,ours_lowrank_int8_r32]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import comm_hooks as ch  # noqa: E402

from verl_comm.distributed.launch import free_port  # noqa: E402


def sync_stacks(m: ch.Method, x: torch.Tensor) -> collections.Counter:
    """Stacks (innermost repo frames) of every synchronising CUDA call in one step."""
    seen: collections.Counter = collections.Counter()
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "verl_comm" in f.filename
                      or "benchmarks" in f.filename or "torch/distributed" in f.filename]  # fmt: skip
            key = " <- ".join(
                f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-4:][::-1]
            )
            seen[key or f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                m.step(x)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = old
    torch.cuda.synchronize()
    return seen


def main() -> int:
    """Profile each method in turn; write ``hooks_profile.txt`` under ``--out``."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--methods", default="none,ours_bf16,ours_int8,ours_lowrank_int8_r32,"
                   "ours_lowrank_int8_r128,ours_auto,reducer_none,reducer_int8")  # fmt: skip
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=4096)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    args = ch._args(["--world", "1", "--layers", str(a.layers), "--dim", str(a.dim)])
    args.batch = a.dim
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name in a.methods.split(","):
        m = ch.Method(name, args, dev)
        x = ch._batch(args, 0, 0, dev)
        for _ in range(5):
            m.step(x)
        stacks = sync_stacks(m, x)
        times = [ch._timed(m, x) for _ in range(7)]
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(2):
                m.step(x)
            torch.cuda.synchronize()
        avg = prof.key_averages()
        table = avg.table(sort_by="self_cuda_time_total", row_limit=22)
        host = avg.table(sort_by="self_cpu_time_total", row_limit=16)  # host-bound steps
        lines += [f"=== {name}: step {statistics.median(times):.2f} ms (median of 7), "
                  f"host syncs {sum(stacks.values())}", *(f"  sync x{n}: {k}" for k, n in
                  stacks.most_common(8)), "--- profiler, 2 steps, by self CUDA time:", table,
                  "--- by self CPU time:", host, ""]  # fmt: skip
        print("\n".join(lines[-(len(stacks) + 4) :]), flush=True)
        m.close()
        del m
        torch.cuda.empty_cache()
    (out / "hooks_profile.txt").write_text("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
