"""The shared body of every verl_comm hook (not public; see :mod:`verl_comm.hooks`).

Execution model: each hook starts AND waits on its collectives in the hook body and returns
an already-completed ``torch.futures.Future`` holding ``bucket.buffer()`` (reduced in
place). This works on every backend: on gloo, collectives started or waited on inside a
``Future.then`` callback deadlock (FACTS 7). On CUDA the body runs on a per-device side
stream that first waits on the current stream; a blocking NCCL call then only makes the side
stream wait, so backward compute on the default stream keeps overlapping with the hook's
communication and compression, and the CUDA-aware Future makes DDP's stream wait for the
side stream before reading the result. Non-finite detection needs no extra collective: the
reduced data is identical on every rank, so every rank reaches the same verdict; flags are
read once per step on ``bucket.is_last()``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from verl_comm.compression.collective import Collective, LoopbackCollective
from verl_comm.compression.int8_allreduce import (
    cast_allreduce,
    int8_allreduce,
    int8_allreduce_wire_bytes,
    ring_allreduce_wire_bytes,
)
from verl_comm.compression.lowrank import LowRankPlan, TensorSlot, lowrank_int8_allreduce
from verl_comm.compression.lowrank import plan_lowrank as _plan_lowrank
from verl_comm.compression.policy import decide, measure_link, time_call

from .state import BucketState, CommHookState

logger = logging.getLogger("verl_comm.hooks")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
COMPRESSING = ("fp16", "bf16", "int8", "lowrank_int8")


@dataclass
class PathResult:
    """What a reduction path reports (device scalars are read at the end of the step)."""

    wire_bytes: int
    finite: torch.Tensor
    err_sq: torch.Tensor | None = None
    in_sq: torch.Tensor | None = None
    has_residual: bool = False


# -- reduction paths: reduce ``buf`` in place (averaged over the ranks of ``coll``) --------


def reduce_plain(state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective):
    """All-reduce in the bucket's own dtype."""
    r = cast_allreduce(buf, coll, wire_dtype=buf.dtype, out=buf)
    return PathResult(r.wire_bytes, r.finite)


def _reduce_cast(method: str):
    def fn(state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective):
        r = cast_allreduce(buf, coll, wire_dtype=_CAST[method], out=buf)
        return PathResult(r.wire_bytes, r.finite)

    return fn


def reduce_int8(state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective):
    """int8 quantized all-reduce with error feedback (``bs.residual``)."""
    cfg = state.config
    res = None
    in_sq = None
    if cfg.error_feedback:
        if bs.residual is None or bs.residual.numel() != buf.numel():
            bs.residual = torch.zeros(
                buf.numel(), dtype=_DTYPES[cfg.residual_dtype], device=buf.device
            )
        res = bs.residual
        if state.collect_stats:
            in_sq = (buf.float() + res.float()).square().sum()
    r = int8_allreduce(buf, coll, block=cfg.quant_block, residual=res, out=buf)
    err_sq = res.float().square().sum() if (res is not None and state.collect_stats) else None
    return PathResult(r.wire_bytes, r.finite, err_sq, in_sq, res is not None)


def bucket_plan(state: CommHookState, bs: BucketState, numel: int) -> LowRankPlan:
    """The low-rank plan of a bucket (cached in ``bs``), from its parameter shapes."""
    if bs.plan is None:
        shapes = bs.signature[2]
        if sum(int(torch.Size(s).numel()) for s in shapes) != numel:
            logger.warning(
                "comm hook: bucket parameter shapes do not add up to its %d elements; "
                "the bucket is sent by the int8 all-reduce without low rank",
                numel,
            )
            bs.plan = LowRankPlan(numel, (), (TensorSlot(0, numel, (numel,)),))
        else:
            cfg = state.config
            bs.plan = _plan_lowrank(shapes, cfg.compression_rank or 1, cfg.min_compression_rate)
    return bs.plan


def reduce_lowrank(state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective):
    """int8 low-rank (PowerSGD) with error feedback and warm start."""
    cfg = state.config
    plan = bucket_plan(state, bs, buf.numel())
    fp32 = buf.dtype == torch.float32
    r = lowrank_int8_allreduce(
        buf if fp32 else buf.float(),
        plan,
        bs.lowrank,
        coll,
        block=cfg.quant_block,
        error_feedback=cfg.error_feedback,
        warm_start=cfg.warm_start,
        residual_dtype=_DTYPES[cfg.residual_dtype],
        generator=state.generator,
        out=buf if fp32 else None,
    )
    if not fp32:
        buf.copy_(r.out)
    return PathResult(r.wire_bytes, r.finite, r.error_sq, r.input_sq, cfg.error_feedback)


PATHS: dict[str, Callable[..., PathResult]] = {
    "allreduce": reduce_plain,
    "fp16": _reduce_cast("fp16"),
    "bf16": _reduce_cast("bf16"),
    "int8": reduce_int8,
    "lowrank_int8": reduce_lowrank,
}


def compressed_wire(
    state: CommHookState, bs: BucketState, method: str, buf: torch.Tensor, w: int
) -> tuple[int, int]:
    """``(bytes sent per rank, number of collectives)`` of ``method`` on this bucket."""
    b = state.config.quant_block
    if method in _CAST:
        return ring_allreduce_wire_bytes(buf.numel(), w, 2), 1
    if method == "int8":
        return int8_allreduce_wire_bytes(buf.numel(), w, b), 2
    plan = bucket_plan(state, bs, buf.numel())
    calls = 2 * sum(1 for n in (plan.p_numel, plan.q_numel, plan.rest_numel) if n)
    return plan.wire_bytes(w, b), calls


def policy_decision(
    state: CommHookState, bs: BucketState, method: str, buf: torch.Tensor, index: int
):
    """Measure (once per bucket) and decide whether compressing this bucket saves time."""
    if bs.decision is not None:
        return bs.decision
    coll = state.collective
    w = coll.world_size
    if state.link is None:
        big = min(max(buf.numel() * buf.element_size(), 1 << 20), 64 << 20)
        state.link = measure_link(coll, buf.device, large_bytes=big)
    scratch = BucketState(bs.signature, bs.meta, plan=bs.plan)
    fn = PATHS[method]
    saved_rng = state.generator.get_state()
    compute = time_call(lambda: fn(state, scratch, buf.clone(), LoopbackCollective(w)), buf.device)
    state.generator.set_state(saved_rng)
    agreed = torch.tensor([compute], dtype=torch.float64, device=buf.device)
    coll.all_reduce_max(agreed)
    wire, calls = compressed_wire(state, bs, method, buf, w)
    bs.decision = decide(
        state.link,
        plain_bytes=ring_allreduce_wire_bytes(buf.numel(), w, buf.element_size()),
        compressed_bytes=wire,
        compressed_collectives=calls,
        compute_s=float(agreed.item()),
    )
    d = bs.decision
    logger.info(
        "policy auto: bucket %d (%d x %s, W=%d): %s; plain %.3f ms (%d B), %s %.3f ms "
        "(%d B + %.3f ms compute), link alpha %.1f us, %.2f GB/s",
        index,
        buf.numel(),
        buf.dtype,
        w,
        "compress" if d.compress else "plain all-reduce",
        d.t_plain_s * 1e3,
        d.plain_bytes,
        method,
        d.t_compressed_s * 1e3,
        d.compressed_bytes,
        d.compute_s * 1e3,
        d.alpha_s * 1e6,
        state.link.busbw_GBps,
    )
    return d


@contextlib.contextmanager
def _side_stream(state: CommHookState, device: torch.device) -> Iterator[Any]:
    if device.type != "cuda":
        yield None
        return
    stream = state._streams.get(device)
    if stream is None:
        stream = state._streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


def run_hook(state: CommHookState, bucket: Any, method: str) -> torch.futures.Future:
    """Reduce ``bucket.buffer()`` in place with ``method`` and return a completed Future.

    ``method`` is one of ``allreduce``, ``fp16``, ``bf16``, ``int8``, ``lowrank_int8``;
    int8 and low rank (and every compressing method under ``policy: auto``) run a plain
    all-reduce before ``config.start_iter`` and, after ``load_state_dict``, for
    ``start_iter`` more steps on each bucket whose layout is not the loaded one (a fresh DDP
    rebuilds its buckets after its first step); with ``policy: auto`` each compressing bucket
    then takes the path the policy chose at its first step (measured once per bucket).
    """
    state.apply_deferred()
    buf = bucket.buffer()
    index = int(bucket.index())
    dev = buf.device
    cfg = state.config
    coll = state.collective
    signature = (buf.numel(), str(buf.dtype), tuple(tuple(p.shape) for p in bucket.parameters()))
    meta = (method, cfg.compression_rank or 0, cfg.quant_block, cfg.residual_dtype)
    meta = (*meta, cfg.error_feedback)
    warm = state.iteration < cfg.start_iter  # DDP may still rebuild its buckets
    if state.resuming(index, signature, meta):  # loaded state, DDP not rebuilt yet
        bs, warm = BucketState(signature, meta), True
    else:
        bs = state.bucket_state(index, signature, meta)
    if dev.type != "cpu":
        bs.tensors_to(dev)
    path = method
    auto = method in COMPRESSING and cfg.policy == "auto"
    if (auto or method in ("int8", "lowrank_int8")) and warm:
        path = "allreduce"
    elif auto and buf.numel():
        if not policy_decision(state, bs, method, buf, index).compress:
            path = "allreduce"

    fut: torch.futures.Future = (
        torch.futures.Future(devices=[dev]) if dev.type == "cuda" else torch.futures.Future()
    )
    with _side_stream(state, dev) as stream:
        start_s = time.perf_counter()
        ev0 = ev1 = None
        if stream is not None:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record(stream)
        if buf.numel() == 0:
            res = PathResult(0, torch.ones((), dtype=torch.bool, device=dev))
        else:
            res = PATHS[path](state, bs, buf, coll)
        if cfg.nonfinite == "skip" and buf.numel():
            buf.copy_(torch.where(res.finite, buf, torch.zeros((), dtype=buf.dtype, device=dev)))
        if ev1 is not None:
            ev1.record(stream)
        elapsed = time.perf_counter() - start_s
        fut.set_result(buf)
    state._add_pending(
        {
            "index": index,
            "method": path,
            "numel": buf.numel(),
            "dtype": str(buf.dtype).replace("torch.", ""),
            "world_size": coll.world_size,
            "wire_bytes": res.wire_bytes,
            "plain_bytes": ring_allreduce_wire_bytes(
                buf.numel(), coll.world_size, buf.element_size()
            ),
            "finite": res.finite,
            "err_sq": res.err_sq,
            "in_sq": res.in_sq,
            "has_residual": res.has_residual,
            "time_s": elapsed,
            "start_s": start_s,
            "t_start": ev0,
            "t_end": ev1,
        }
    )
    if bucket.is_last():
        state.end_step()
    return fut
