"""The shared body of every verl_comm hook (not public; see :mod:`verl_comm.hooks`).

Execution model (issue 14): a hook returns at once and its work proceeds off the critical
path.

* CUDA (NCCL): the hook itself enqueues the bucket's chain on the state's side stream,
  which first waits for the current stream (kernel launches and NCCL calls only enqueue,
  so no worker thread is needed, and none would help: it would add a GIL handoff with the
  autograd thread per launch). From the bucket's second compressed step on, the chain is
  one CUDA graph replay (:mod:`verl_comm.hooks.graphs`), so its host cost is one launch.
  Nothing in a step synchronises the host. Flags and
  statistics (finiteness, error norms, CUDA-event times) are copied non-blocking to pinned
  host memory at the end of the step and read when that copy has completed (checked with
  ``Event.query()`` at a later step's end, or by :meth:`CommHookState.flush`). The
  CUDA-aware Future makes DDP's stream wait for the side stream.
* CPU (gloo, a process group of W > 1), fixed fp16 / bf16: torch's order, the cast on the
  hook's thread, an async all-reduce, the copy back in a callback (:mod:`.direct`).
* CPU (gloo, a process group of W > 1), the other methods: the chain runs on the state's
  :class:`~verl_comm.hooks.worker.CommWorker` in DDP's bucket order and the Future
  completes when the bucket is reduced; no collective is started from ``Future.then``.
  The hook of the last bucket waits for the worker to drain, so a collective issued right
  after it (DDP's unused-parameter bitmap, a caller's collective after backward) can never
  be reordered against the hooks' collectives.
* In-process collectives (W = 1, loopback, thread groups): synchronous, completed Future.

Non-finite detection needs no extra collective: the reduced data is identical on every
rank, so every rank reaches the same verdict.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.compression.collective import (
    Collective,
    LocalCollective,
    LoopbackCollective,
    ProcessGroupCollective,
)
from verl_comm.compression.hier_int8 import chunk_numel, hier_int8_allreduce
from verl_comm.compression.int8_allreduce import (
    cast_allreduce,
    host_slice_numel,
    int8_allreduce,
    int8_allreduce_wire_bytes,
    ring_allreduce_wire_bytes,
)
from verl_comm.compression.lowrank import lowrank_int8_allreduce
from verl_comm.compression.lowrank_plan import (
    FactorWire,
    LowRankPlan,
    TensorSlot,
    payload_wire_bytes,
)
from verl_comm.compression.lowrank_plan import plan_lowrank as _plan_lowrank
from verl_comm.compression.policy import (
    LinkModel,
    PathCost,
    choose_method,
    measure_link,
    time_call,
)

from . import direct, hierarchy, measure, resume, trial
from .bucket import Keep, keep_ranges
from .graphs import run_path
from .lanes import COMPRESSING, bucket_keys, lane_of
from .state import BucketState, CommHookState
from .stats import BucketRecord

logger = logging.getLogger("verl_comm.hooks")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_CAST = direct.CAST


@dataclass
class PathResult:
    """What a reduction path reports (device scalars are read at the end of the step)."""

    wire_bytes: int
    finite: torch.Tensor
    err_sq: torch.Tensor | None = None
    in_sq: torch.Tensor | None = None
    has_residual: bool = False


# -- reduction paths: reduce ``buf`` in place (averaged over the ranks of ``coll``) --------


def reduce_plain(
    state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective, keep: Keep = ()
):
    """All-reduce in the bucket's own dtype."""
    r = cast_allreduce(buf, coll, wire_dtype=buf.dtype, out=buf)
    return PathResult(r.wire_bytes, r.finite)


def _reduce_cast(method: str):
    def fn(
        state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective, keep: Keep = ()
    ):
        r = cast_allreduce(buf, coll, wire_dtype=_CAST[method], out=buf)
        return PathResult(r.wire_bytes, r.finite)

    return fn


def residual_dtype(setting: str, grad_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of an int8 bucket's residual: ``float32``, or for ``bfloat16`` (16-bit
    storage) bf16, except fp16 for an fp16 bucket (the quantize kernel pairs a 16-bit
    residual with its own input dtype; ``model.half()`` must work with the defaults)."""
    if setting == "float32":
        return torch.float32
    return torch.float16 if grad_dtype == torch.float16 else torch.bfloat16


def reduce_int8(
    state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective, keep: Keep = ()
):
    """int8 quantized all-reduce with error feedback (``bs.residual``).

    A range in ``keep`` (a parameter without a gradient this step) is sent as zeros and
    its residual is left exactly as it was (issue 18: DDP does not apply the result to such
    a parameter, so sending its residual would lose it).
    """
    cfg = state.config
    res = None
    in_sq = None
    saved = []
    hier = getattr(coll, "hierarchy", None)
    n = buf.numel()  # hierarchical: the residual's tail is this rank's chunk of its host's
    size = n + (chunk_numel(n, hier, cfg.quant_block) if hier is not None else 0)
    if cfg.error_feedback:
        if bs.residual is not None and bs.residual.numel() != size:
            logger.warning(
                "comm hook: bucket of %d elements: its error-feedback residual holds %d "
                "elements, the int8 path (%s) needs %d; starting it from zero",
                n,
                bs.residual.numel(),
                "hierarchical" if hier is not None else "flat",
                size,
            )
            bs.residual = None
        if bs.residual is None:
            rdt = residual_dtype(cfg.residual_dtype, buf.dtype)
            bs.residual = torch.zeros(size, dtype=rdt, device=buf.device)
        res = bs.residual[:n]
        for off, k in keep:
            saved.append((off, k, res[off : off + k].clone()))
            res[off : off + k].zero_()
            buf[off : off + k].zero_()
        if state.collect_stats:
            in_sq = (buf.float() + res.float()).square().sum()
    if hier is not None:  # reduced inside each host first (CompressionConfig.hierarchical)
        host = None if res is None else bs.residual[n:]
        r = hier_int8_allreduce(
            buf, hier, block=cfg.quant_block, residual=res, host_residual=host, out=buf
        )
    else:
        r = int8_allreduce(buf, coll, block=cfg.quant_block, residual=res, out=buf)
    for off, k, old in saved:
        res[off : off + k].copy_(old)
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


def link_model(state: CommHookState, device: torch.device) -> LinkModel:
    """The state's link model, measured once (collectives on every rank, in bucket order)."""
    if state.link is None:
        state.link = measure_link(state.collective, device, large_bytes=1 << 20)
    return state.link


def bucket_wire(state: CommHookState, bs: BucketState, plan: LowRankPlan, dev) -> FactorWire:
    """Per payload (P, Q, rest) the wire the link model predicts fastest (cached per bucket):
    the int8 two-step all-reduce (2 collectives, ~1 byte per element) or one all-reduce in
    bf16 (factors only) or fp32. Within 5% of the fastest, the more precise one wins."""
    if bs.wire is None:
        w = state.collective.world_size
        link = link_model(state, dev) if w > 1 else LinkModel(0.0, 0.0, 1)
        b = state.config.quant_block

        def pick(numel: int, modes: tuple[str, ...]) -> str:
            cost = {
                m: link.time_s(payload_wire_bytes(numel, w, b, m), 2 if m == "int8" else 1)
                for m in modes
            }
            best = min(cost.values())
            return next(m for m in modes if cost[m] <= best * 1.05 + 1e-9)

        factor = ("fp32", "bf16", "int8")
        bs.wire = FactorWire(
            pick(plan.p_numel, factor),
            pick(plan.q_numel, factor),
            pick(plan.rest_numel, ("fp32", "int8")),
        )
    return bs.wire


def reduce_lowrank(
    state: CommHookState, bs: BucketState, buf: torch.Tensor, coll: Collective, keep: Keep = ()
):
    """int8 low-rank (PowerSGD) with error feedback and warm start."""
    cfg = state.config
    plan = bucket_plan(state, bs, buf.numel())
    wire = bucket_wire(state, bs, plan, buf.device) if coll is state.collective else None
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
        wire=wire if wire is not None else bs.wire,
        keep=keep,
        stats=state.collect_stats,
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
    state: CommHookState,
    bs: BucketState,
    method: str,
    buf: torch.Tensor,
    w: int,
    hier: Any = None,
) -> tuple[int, int]:
    """``(bytes sent per rank, number of collectives)`` of ``method`` on this bucket, in the
    link model's terms (a flat ring's bytes per rank). Hierarchical int8 (``hier``): what
    crosses the link, L ranks' int8 bytes across hosts (the host's own traffic is left out)."""
    b = state.config.quant_block
    if method in _CAST:
        return ring_allreduce_wire_bytes(buf.numel(), w, 2), 1
    if method == "int8" and hier is not None:
        m = chunk_numel(buf.numel(), hier, b)
        lw, hw = hier.intra.world_size, hier.inter.world_size
        return lw * int8_allreduce_wire_bytes(m, hw, b), 4
    if method == "int8":
        return int8_allreduce_wire_bytes(buf.numel(), w, b), 2
    plan = bucket_plan(state, bs, buf.numel())
    wire = bucket_wire(state, bs, plan, buf.device)
    return plan.wire_bytes(w, b, wire), plan.collectives(wire)


def auto_options(method: str, buf: torch.Tensor) -> tuple[str, ...]:
    """The compressing paths ``policy: auto`` weighs for a bucket whose hook is ``method``:
    every method no lossier than it, most precise first (bf16 only for fp32 buckets)."""
    ladder = {"fp16": ("fp16",), "bf16": ("bf16",), "int8": ("bf16", "int8")}
    opts = ladder.get(method, ("bf16", "int8", "lowrank_int8"))
    return tuple(m for m in opts if m not in _CAST or buf.dtype == torch.float32)


def policy_decision(
    state: CommHookState,
    bs: BucketState,
    method: str,
    buf: torch.Tensor,
    index: int,
    coll: Collective | None = None,
):
    """Measure (once per bucket) and choose the fastest path for this bucket: the plain
    all-reduce or one of :func:`auto_options` (:func:`~verl_comm.compression.policy.
    choose_method`); ``coll``: the collective the measurements agree over (default the
    state's)."""
    if bs.decision is not None:
        return bs.decision
    coll = state.collective if coll is None else coll
    w = coll.world_size
    if state.link is None:
        big = min(max(buf.numel() * buf.element_size(), 1 << 20), 64 << 20)
        state.link = measure_link(coll, buf.device, large_bytes=big)
    names = auto_options(method, buf)
    if "lowrank_int8" in names:
        bucket_wire(state, bs, bucket_plan(state, bs, buf.numel()), buf.device)
    saved_rng = state.generator.get_state()
    compute = []
    for m in names:
        scratch = BucketState(bs.signature, bs.meta, plan=bs.plan, wire=bs.wire)

        def run(fn=PATHS[m], scratch=scratch, loop=LoopbackCollective(w)):
            return fn(state, scratch, buf.clone(), loop)

        compute.append(time_call(run, buf.device))
    state.generator.set_state(saved_rng)
    # compute: the slowest rank's; shadow: the least backward any rank had left (the bucket's
    # collective starts when the last rank is ready, so no rank hides more than its own)
    agreed = torch.tensor(
        [*compute, -state.shadow_of(index)], dtype=torch.float64, device=buf.device
    )
    coll.all_reduce_max(agreed)
    *compute_s, neg_shadow = (float(v) for v in agreed.tolist())
    shadow_s = -neg_shadow
    options = {}
    for m, c in zip(names, compute_s):
        wire, calls = compressed_wire(state, bs, m, buf, w, getattr(coll, "hierarchy", None))
        lead = None
        if m == "int8" and buf.device.type == "cpu" and w > 1:  # pipelined host slices
            lead = c / -(-buf.numel() // host_slice_numel(buf.numel(), w, state.config.quant_block))
        options[m] = PathCost(wire, calls, c, lead)
    if index == 0:
        state._link_free_s = float("-inf")
    d = bs.decision = choose_method(
        state.link,
        plain_bytes=ring_allreduce_wire_bytes(buf.numel(), w, buf.element_size()),
        options=options,
        shadow_s=shadow_s,
        link_free_s=state._link_free_s,
    )
    state._link_free_s = d.link_free_s
    logger.info(
        "policy auto: bucket %d (%d x %s, W=%d): %s; chain ends (ms from end of backward) "
        "%s; compute ms %s; shadow %.3f ms; link alpha %.1f us, %.3f GB/s",
        index,
        buf.numel(),
        buf.dtype,
        w,
        d.method,
        {m: round(e * 1e3, 1) for m, e in (d.options or {}).items()},
        {m: round(c.compute_s * 1e3, 1) for m, c in options.items()},
        d.shadow_s * 1e3,
        d.alpha_s * 1e6,
        state.link.busbw_GBps,
    )
    return d


@contextlib.contextmanager
def _side_stream(state: CommHookState, device: torch.device) -> Iterator[Any]:
    if device.type != "cuda":
        yield None
        return
    stream = _side(state, device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield stream


def _unwrap(fut: torch.futures.Future) -> torch.Tensor:
    return fut.wait()


def _uses_worker(state: CommHookState, dev: torch.device) -> bool:
    """The worker serves a CPU process group with a link (gloo, W > 1), where a collective
    blocks the calling thread. On CUDA every kernel and NCCL call only enqueues work, so the
    hook enqueues the chain on the side stream itself: a worker thread there would add a
    GIL handoff between it and the autograd thread per launch, not take work off the
    critical path (on 1 x H200 the worker and the inline path gave the same step time;
    the host cost per bucket is measured by ``benchmarks/gpu/hook_host_cost.py``)."""
    coll = state.collective
    if not isinstance(coll, ProcessGroupCollective):
        return False
    return dev.type != "cuda" and coll.world_size > 1


def _side(state: CommHookState, dev: torch.device) -> Any:
    stream = state._streams.get(dev)
    if stream is None:
        stream = state._streams[dev] = torch.cuda.Stream(dev)
    return stream


def run_hook(state: CommHookState, bucket: Any, method: str) -> torch.futures.Future:
    """Hand ``bucket.buffer()`` to its reduction with ``method`` (in place); return its Future.

    ``method`` is one of ``allreduce``, ``fp16``, ``bf16``, ``int8``, ``lowrank_int8``;
    int8 and low rank (and every compressing method under ``policy: auto``) run a plain
    all-reduce before ``config.start_iter`` and, after ``load_state_dict``, for
    ``start_iter`` more steps on each bucket whose layout is not the loaded one (a fresh DDP
    rebuilds its buckets after its first step); with ``policy: auto`` one measurement step
    follows (plain, :mod:`verl_comm.hooks.measure`), then each compressing bucket takes the
    path the policy chose at its next step (measured once per bucket).
    On CUDA the chain is enqueued here on the side stream (as a CUDA graph once captured)
    and the CUDA-aware Future makes the consumer's stream wait for it; with a gloo process
    group of W > 1 it runs on the state's worker; in-process collectives run inline and
    return a completed Future (see the module docstring).
    """
    state.apply_deferred()
    buf = bucket.buffer()
    index = int(bucket.index())
    is_last = bool(bucket.is_last())
    shapes = tuple(tuple(p.shape) for p in bucket.parameters())
    keep = keep_ranges(bucket)
    dev = buf.device
    cuda = dev.type == "cuda"
    state.mark_ready(index, is_last, dev)
    if state.config.policy == "auto" and state._trial_seen != state._submitted_iter:
        state._trial_seen = state._submitted_iter  # the step's first hook call
        if cuda or not _uses_worker(state, dev):
            trial.refuse_explicit(state.config, dev)
        else:
            trial.at_step_start(state, state.collective, dev)
    pids = resume.param_ids(state, bucket)
    if not cuda and resume.should_hold(state, index, pids, (buf.numel(), str(buf.dtype), shapes)):
        return resume.hold(state, buf, pids, bucket.parameters(), is_last, _reduce_bucket)
    measuring = measure.measuring(state, method in COMPRESSING and state.config.policy == "auto")
    if _uses_worker(state, dev) and direct.applies(state, method, measuring):
        return direct.run_direct_cast(state, buf, index, shapes, method, is_last, pids)
    if hierarchy.wants(state.config, method):
        if _uses_worker(state, dev):
            hierarchy.attach(state, state.collective)  # once; every rank at its first call
        else:
            hierarchy.refuse(state.config, dev)
    cast = trial.cast_plan(state) if _uses_worker(state, dev) and method in COMPRESSING else None
    if cast is not None:  # policy auto, a step whose plan casts every bucket: torch's order
        path = cast.get(index, "bf16" if buf.dtype == torch.float32 else "fp16")
        return direct.run_direct_cast(state, buf, index, shapes, path, is_last, pids, False)
    if _uses_worker(state, dev):
        fut: torch.futures.Future = (
            torch.futures.Future(devices=[dev]) if cuda else torch.futures.Future()
        )
        worker = state.worker()
        lane = lane_of(state, worker, method, index, buf, shapes)
        gate = measure.gate(state, is_last) if measuring else None
        it = state._submitted_iter
        submitted = time.perf_counter()
        ready = None
        if cuda:  # the gradients of this bucket, as far as the caller's stream has got
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))

        def job(coll: Collective | None) -> torch.Tensor:
            if gate is not None:  # the measurement step: backward alone (hooks.measure)
                measure.wait(gate, state.timeout_s)
            if ready is not None:
                stream = _side(state, dev)
                torch.cuda.set_device(dev)
                torch.cuda.set_stream(stream)  # the worker thread's own current stream
                stream.wait_event(ready)
            _reduce_bucket(
                state, buf, index, shapes, keep, method, False, submitted, pids, lane_coll=coll
            )
            if is_last:  # the step's statistics need every bucket of it
                worker.wait_earlier(state.timeout_s)
                state.end_step()
            return buf  # set_result records the Future's event on the side stream

        def fatal(e: BaseException) -> bool:
            from .state import NonFiniteGradientError

            return not isinstance(e, NonFiniteGradientError)

        worker.submit(job, fut, f"bucket {index} ({method}) at iteration {it}", fatal, lane)
        # A Python Future's set_exception stores the error as its value, which DDP's C++
        # reducer would then try to cast to a Tensor; unwrapping it in a callback (no
        # collective there) turns it into a real error of the returned Future.
        out = fut.then(_unwrap)
        if is_last:
            state._submitted_iter += 1
            worker.drain(state.timeout_s)  # nothing of ours may overlap the caller's next call
        return out
    if measuring and not cuda:
        return measure.hold_inline(
            state,
            buf,
            lambda last: _reduce_bucket(state, buf, index, shapes, keep, method, last, pids=pids),
            is_last,
        )
    fut = torch.futures.Future(devices=[dev]) if cuda else torch.futures.Future()
    with _side_stream(state, dev):
        _reduce_bucket(state, buf, index, shapes, keep, method, is_last, pids=pids)
        fut.set_result(buf)
    state._submitted_iter = state.iteration
    return fut


def _reduce_bucket(
    state: CommHookState,
    buf: torch.Tensor,
    index: int,
    shapes: tuple,
    keep: Keep,
    method: str,
    is_last: bool,
    submitted_s: float | None = None,
    pids: tuple[int, ...] | None = None,
    lane_coll: Collective | None = None,
) -> None:
    """The whole chain of one bucket (on the side stream, the worker, or inline);
    ``submitted_s``: ``perf_counter`` when the hook handed it to the worker; ``lane_coll``:
    the worker lane's own collective (None: the state's)."""
    cfg = state.config
    coll = state.collective if lane_coll is None else lane_coll
    dev = buf.device
    signature, meta = bucket_keys(state, buf, shapes, method)
    warm = state.iteration < cfg.start_iter  # DDP may still rebuild its buckets
    if state.resuming(index, signature, meta):  # loaded state, DDP not rebuilt yet
        bs, warm = BucketState(signature, meta), True
    else:
        bs = state.bucket_state(index, signature, meta)
        bs.params = pids if pids is not None else bs.params
    if dev.type != "cpu":
        bs.tensors_to(dev)
    path = method
    auto = method in COMPRESSING and cfg.policy == "auto"
    if (auto or method in ("int8", "lowrank_int8")) and warm:
        path = "allreduce"
    elif auto and bs.decision is None and state.iteration <= state._measure_at:
        path = "allreduce"  # measured first (verl_comm.hooks.measure)
    elif auto and buf.numel():
        d = policy_decision(state, bs, method, buf, index, coll)
        path = trial.path_of(state, index, d.method or (method if d.compress else "allreduce"))
    cuda = dev.type == "cuda"
    start_s = time.perf_counter()
    ev0 = ev1 = None
    if cuda:  # device time per bucket: two event records, read with the step's flags
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
    if buf.numel() == 0:
        res = PathResult(0, torch.ones((), dtype=torch.bool, device=dev))
    else:
        res = run_path(state, bs, path, PATHS[path], buf, coll, keep)
    if cfg.nonfinite == "skip" and buf.numel():
        zero = torch.zeros((), dtype=buf.dtype, device=dev)
        buf.copy_(torch.where(res.finite, buf, zero))
        if cuda:  # the verdict is read later: drop NaN state on the device now
            bs.zero_if_nonfinite(res.finite)
    if ev1 is not None:
        ev1.record()
    elapsed = time.perf_counter() - start_s
    state._add_pending(
        BucketRecord.of(
            buf,
            index,
            path,
            coll.world_size,
            res.wire_bytes,
            finite=res.finite,
            err_sq=res.err_sq,
            in_sq=res.in_sq,
            has_residual=res.has_residual,
            time_s=elapsed,
            start_s=start_s,
            submitted_s=start_s if submitted_s is None else submitted_s,
            t_start=ev0,
            t_end=ev1,
        )
    )
    if is_last:
        state.end_step()


def run_stateless(group: Any, bucket: Any, method: str) -> torch.futures.Future:
    """``allreduce`` / ``fp16`` / ``bf16`` for a hook registered with a ProcessGroup or None
    as state (torch's convention): no statistics, no non-finite policy, no state kept;
    synchronous in the hook body on the current stream; a completed Future."""
    buf = bucket.buffer()
    dist_on = dist.is_available() and dist.is_initialized()
    coll = ProcessGroupCollective(group) if dist_on else LocalCollective()
    wire = buf.dtype if method == "allreduce" else _CAST[method]
    if buf.numel():
        cast_allreduce(buf, coll, wire_dtype=wire, out=buf)
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    fut.set_result(buf)
    return fut
