"""The measurement step of ``policy: auto``: backward's own timeline, no transfer in flight.

:func:`~verl_comm.compression.policy.choose_method` places each bucket's chain on a timeline
that starts when its gradients are ready, ``shadow_s`` before the end of backward. The
shadows are taken on one step from the times the hooks are called
(:meth:`CommHookState.mark_ready`). They used to come from the step before the decisions:
DDP's first step (its bucket layout before the rebuild, first-call costs), with that step's
plain all-reduces in flight, which on a CPU host share the cores with backward. On the
shaped-link benchmark (``benchmarks/slow_link_hooks.sh``, 2 gloo ranks on 2 cores,
1 Gbit/s; ``benchmarks/slow_link_trace.py``, ``benchmarks/results/slow_link_trace_auto.txt``)
bucket 0's shadow read about 330 ms there, against 104 ms on a later step of the same run
and 138 ms on this measurement step, so the policy predicted bucket 0's plain all-reduce
(285 ms) to end 47 ms before backward did and kept it plain. So the shadows are taken at ``start_iter`` (DDP's buckets rebuilt), and on
that measurement step every bucket's reduction waits until the last bucket's hook has been
called:

* on the gloo worker (:mod:`verl_comm.hooks.worker`) each job of the step first waits on a
  :class:`threading.Event` that the last bucket's hook sets; the hooks return their Futures
  at once as on every step, so DDP is never blocked, and the jobs keep their order;
* inline (in-process collectives on CPU) the hooks return pending Futures and the last
  bucket's hook reduces every held bucket in bucket order, then its own (DDP allows a
  bucket's Future to complete later, as :mod:`verl_comm.hooks.resume` relies on too).

On CUDA nothing is held: transfers run on the side stream and the shadows are CUDA events
on the caller's stream. The measurement step reduces with a plain all-reduce (buckets not
decided yet); decisions are taken on the next step (:func:`verl_comm.hooks._core.
policy_decision`). The step is ``config.start_iter`` (the first step in DDP's rebuilt bucket
layout), the next step after :meth:`CommHookState.recalibrate`, or after a load the first
step at which buckets may compress again (the loaded iteration + ``start_iter``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


def measuring(state: Any, auto: bool) -> bool:
    """Whether the current step of ``state`` is the measurement step of ``policy: auto``
    (the same on every rank: it depends on the iteration only)."""
    return auto and state.iteration == state._measure_at


def gate(state: Any, is_last: bool) -> threading.Event:
    """The event the worker jobs of the measurement step wait on (call from each hook of
    that step, in bucket order); the last bucket's call sets it."""
    if state._gate is None:
        state._gate = threading.Event()
    ev = state._gate
    if is_last:
        ev.set()
        state._gate = None
    return ev


def wait(ev: threading.Event, timeout_s: float) -> None:
    """Block a worker job until the step's last bucket is ready.

    Raises:
        TimeoutError: the last bucket's hook was not called within ``timeout_s`` (backward
            failed or stopped before its end).
    """
    if not ev.wait(timeout_s):
        raise TimeoutError(
            f"policy auto measurement step: the last bucket's hook was not called within "
            f"{timeout_s:g} s; did backward stop before reducing every bucket?"
        )


def hold_inline(
    state: Any, buf: torch.Tensor, reduce: Callable[[bool], None], is_last: bool
) -> torch.futures.Future:
    """Inline path of the measurement step: hold this bucket; at the last one reduce every
    held bucket in bucket order, then this one, and complete their Futures.

    Args:
        buf: the bucket's buffer (reduced in place; the Future's value).
        reduce: reduces this bucket when called with whether it closes the step.
        is_last: DDP's ``bucket.is_last()``.
    """
    fut: torch.futures.Future = torch.futures.Future()
    state._held_measure.append((buf, reduce, fut))
    if is_last:
        held, state._held_measure = state._held_measure, []
        for k, (_, run, _) in enumerate(held):
            run(k == len(held) - 1)
        for b, _, f in held:
            f.set_result(b)
    return fut
