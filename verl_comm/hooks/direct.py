"""fp16 / bf16 buckets on gloo (W > 1) in torch's order: cast on the hook's thread, start the
collective at once, copy back when it completes (issue 28).

Why not the worker (:mod:`verl_comm.hooks.worker`): on a CPU rank the worker's cast runs
beside backward on the same core, so it takes about twice its time alone, and the bucket's
all-reduce starts that much later. On the shaped 1 Gbit/s veth (``TRACE=1
benchmarks/slow_link_hooks.sh``, 2 ranks, 3 buckets of 8.4 M elements) the first bucket's
all-reduce started 7-8 ms after its hook, against 4 ms for torch's ``fp16_compress_hook``,
which casts on the autograd thread and calls ``dist.all_reduce(async_op=True)``; the link is
the bottleneck of that step, so the delay reached the step's end. This path does what torch's
hook does -- the cast and the division on the hook's thread (``cast_scale``), an async
all-reduce, the copy back in a ``Future.then`` callback on gloo's thread -- and keeps ours:
the finiteness verdict in the same pass as the copy back (``copy_finite``), the per-bucket
record, ``nonfinite`` raise or skip, and the end of the step.

For fixed fp16 / bf16, and under policy ``auto`` for a step whose plan casts every bucket
(:func:`verl_comm.hooks.trial.cast_plan`: a step is all on this path or all on the worker,
whose order of collectives every rank shares, never both). Every bucket of such a step takes
this path, in DDP's bucket order on the autograd thread, so every rank issues the same
collectives in the same order; no collective is started from a callback.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verl_comm.compression.int8_allreduce import ring_allreduce_wire_bytes
from verl_comm.kernels import cast_scale, copy_finite

from .lanes import bucket_keys
from .stats import BucketRecord

if TYPE_CHECKING:
    from .state import CommHookState

CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def applies(state: CommHookState, method: str, measuring: bool) -> bool:
    """Whether a bucket of ``method`` takes this path (the caller has checked that the
    state's collective is a gloo process group of W > 1 on CPU)."""
    return method in CAST and state.config.policy != "auto" and not measuring


def run_direct_cast(
    state: CommHookState,
    buf: torch.Tensor,
    index: int,
    shapes: tuple,
    method: str,
    is_last: bool,
    pids: tuple[int, ...] | None,
    own_state: bool = True,
) -> torch.futures.Future:
    """Reduce ``buf`` (the bucket, in place) in ``method``'s wire dtype; returns the Future
    DDP waits on (its value: ``buf``; its error: :class:`NonFiniteGradientError` from the
    step's end with ``nonfinite='raise'``, or the collective's error).

    ``own_state=False`` (policy ``auto``): the bucket's state (its decision, the residuals
    of its other paths) belongs to the configured method and is left as it is.

    Raises:
        RuntimeError: whatever ``dist.all_reduce`` raises when starting.
    """
    cfg, coll = state.config, state.collective
    signature, meta = bucket_keys(state, buf, shapes, method)
    if own_state and not state.resuming(index, signature, meta):
        bs = state.bucket_state(index, signature, meta)
        bs.params = pids if pids is not None else bs.params
    w = coll.world_size
    start_s = time.perf_counter()
    wire = cast_scale(buf, CAST[method], w)  # as torch's hook: cast, divide, then sum
    state.direct_opened()
    try:
        work = dist.all_reduce(wire, group=coll.group, async_op=True)
    except BaseException:
        state.direct_finished(False)
        raise
    sent = ring_allreduce_wire_bytes(wire.numel(), w, wire.element_size())
    coll.bytes_sent += sent
    cast_s = time.perf_counter() - start_s
    if is_last:
        state._submitted_iter += 1

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        try:
            fut.value()  # the collective's error, if any, is this Future's
            t0 = time.perf_counter()
            finite = copy_finite(wire, buf)
            if cfg.nonfinite == "skip":
                buf.copy_(torch.where(finite, buf, torch.zeros((), dtype=buf.dtype)))
            state._add_pending(
                BucketRecord.of(
                    buf,
                    index,
                    method,
                    w,
                    sent,
                    finite=finite,
                    time_s=cast_s + time.perf_counter() - t0,
                    start_s=start_s,
                    submitted_s=start_s,
                )
            )
        finally:
            close = state.direct_finished(is_last)
        if close:  # the records in bucket order, as the worker's (gloo finishes in any order)
            state._pending.sort(key=lambda r: r.index)
            state.end_step()  # raises NonFiniteGradientError with nonfinite='raise'
        return buf

    return work.get_future().then(finish)
