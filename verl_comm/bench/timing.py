"""Per-iteration timing of a collective, and the max across ranks.

Protocol (one size, one case), after NVIDIA/nccl-tests and quack's benchmark scripts:

1. all ranks synchronise (device sync + a one-element all_reduce);
2. ``warmup`` untimed-for-statistics iterations; their time estimates the cost of one
   iteration, the MAX of that estimate across ranks caps the timed iterations to the
   per-size time budget, so every rank runs the same count (no hang);
3. ``iters`` timed iterations: on CUDA a pair of events brackets each call on the current
   stream (NCCL's stream joins it, so the end event fires when the collective completes);
   on CPU ``time.perf_counter`` brackets each blocking call;
4. per-iteration times are gathered and the MAX across ranks is taken per iteration (the
   slowest rank defines the collective's time), then mean/P50/P99 are computed from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def sync_all(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """Device synchronisation followed by a one-element all_reduce on ``group``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iterations(
    run: Callable[[], None],
    iters: int,
    device: torch.device,
    reset: Callable[[], None] | None = None,
) -> list[float]:
    """Time ``iters`` calls of ``run`` one by one; returns seconds per call on this rank.

    ``reset`` (optional) is called before each iteration outside the timed window.
    """
    if iters < 1:
        raise ValueError(f"-n/--iters must be >= 1, got {iters}")
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if reset is not None:
                reset()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
    out = []
    for _ in range(iters):
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        run()
        out.append(time.perf_counter() - t0)
    return out


def time_bare_all_reduce(
    tensor: torch.Tensor, iters: int, warmup: int, group: dist.ProcessGroup | None = None
) -> list[float]:
    """The reference loop: bare ``dist.all_reduce(tensor)`` calls, timed exactly as
    :func:`time_iterations` times a case (events or perf_counter around each call).

    Returns seconds per call on this rank. Used to show the harness adds no overhead.
    """
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            starts[i].record()
            dist.all_reduce(tensor, group=group)
            ends[i].record()
        torch.cuda.synchronize(tensor.device)
        return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        out.append(time.perf_counter() - t0)
    return out


def max_across_ranks(
    values: list[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Element-wise max over ranks of equally long lists (float64 on ``device``).

    Raises:
        RuntimeError: if the lists have different lengths on different ranks.
    """
    n = torch.tensor([len(values), -len(values)], dtype=torch.int64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    if int(n[0]) != -int(n[1]):
        raise RuntimeError(f"ranks timed different iteration counts ({int(n[0])} vs {-int(n[1])})")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def agree_max(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The max of a scalar across ranks (used to agree on iteration counts)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def sum_across_ranks(
    value: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> int:
    """The sum of an integer across ranks (total ``#wrong``)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())
