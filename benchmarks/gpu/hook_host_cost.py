"""Host cost of one hook call on one GPU (world size 1): where the Python side of a bucket goes.

A DDP step with our hooks is host-bound (``hooks_profile.py``: the autograd thread's self
time dominates). This calls each hook directly on a bucket shaped like one layer of the
``comm_hooks.py`` workload (a 4096 x 4096 weight and its bias, fp32), outside DDP, and
reports per call: host time (launches only, the GPU is not waited for), GPU time (CUDA
events around the calls), and cProfile's top functions by own time. For finding the
hooks' host cost (issue 14), not for committed figures.

Usage (one GPU)::

    python benchmarks/gpu/hook_host_cost.py --out $OUT [--calls 30]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from verl_comm.distributed.launch import free_port  # noqa: E402

METHODS = ("torch_bf16", "ours_bf16", "ours_int8", "torch_powersgd_r32", "ours_lowrank_int8_r32")


def build(name: str, dev: torch.device):
    """``(hook, state)`` of one method."""
    from verl_comm.compression.config import CompressionConfig
    from verl_comm.hooks import HOOKS, CommHookState

    if name == "torch_bf16":
        return default_hooks.bf16_compress_hook, None
    if name == "torch_powersgd_r32":
        st = psgd.PowerSGDState(None, matrix_approximation_rank=32, start_powerSGD_iter=2)
        return psgd.powerSGD_hook, st
    fields = {"ours_bf16": {"gradient_compression": "bf16"},
              "ours_int8": {"gradient_compression": "int8"},
              "ours_lowrank_int8_r32": {"gradient_compression": "int8", "compression_rank": 32}}[name]  # fmt: skip
    cfg = CompressionConfig(**fields)
    st = CommHookState(None, cfg)
    return HOOKS[cfg.method], st


def main() -> int:
    """Time and profile each method; write ``hook_host_cost.txt`` under ``--out``."""
    import warnings

    from verl_comm.hooks.bucket import GradBucket

    warnings.simplefilter("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (checks the script only)")
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if a.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    w = torch.nn.Parameter(torch.randn(a.dim, a.dim, device=dev))
    b = torch.nn.Parameter(torch.randn(a.dim, device=dev))
    lines = []
    for name in a.methods.split(","):
        hook, state = build(name, dev)
        bucket = GradBucket(0, [w, b], True, device=dev)
        src = torch.randn(bucket.buffer().numel(), device=dev)

        def call(hook=hook, state=state, bucket=bucket, src=src):
            bucket.buffer().copy_(src)  # a fresh gradient each call
            hook(state, bucket).wait()

        for _ in range(5):
            call()
        sync()
        cuda = dev.type == "cuda"
        e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (0, 0)
        if cuda:
            e0.record()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            call()
        host_ms = (time.perf_counter() - t0) * 1e3 / a.calls
        if cuda:
            e1.record()
        sync()
        gpu_ms = e0.elapsed_time(e1) / a.calls if cuda else float("nan")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            call()
        prof.disable()
        sync()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
        lines += [f"=== {name}: host {host_ms:.3f} ms/call, GPU {gpu_ms:.3f} ms/call "
                  f"(incl. a {src.numel() * 4 / 1e6:.0f} MB copy), {a.calls} calls", s.getvalue()]  # fmt: skip
        print(lines[-2], flush=True)
        if state is not None and hasattr(state, "close"):
            state.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hook_host_cost.txt").write_text("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
