"""The first step after :meth:`CommHookState.load_state_dict` in a fresh DDP: reduce in the
saved bucket layout, so that a resumed run is bit-identical to an uninterrupted one.

Why: a fresh DDP reduces its first step in its initial bucket layout (reverse registration
order) and rebuilds its buckets afterwards from the order gradients became ready
(torch ``Reducer::rebuild_buckets``); the saved error-feedback state is keyed by the
rebuilt buckets. So on that step the hook holds every bucket (their Futures complete
later, which DDP allows), and at the last one copies the gradients into the saved layout
(parameters identified by their index in ``ddp_model.parameters()``, recorded by
:func:`~verl_comm.hooks.register_comm_hook`), reduces those buckets with their loaded state
exactly as the uninterrupted run does, and copies the results back. From the next step
DDP's rebuilt layout is the saved one again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Held:
    """Buckets of the current step held until its last one (DDP's layout)."""

    buckets: list[tuple[torch.Tensor, tuple[int, ...], list[Any], torch.futures.Future]] = field(
        default_factory=list
    )


def param_ids(state: Any, bucket: Any) -> tuple[int, ...] | None:
    """Indices in the DDP module's parameters of the bucket's parameters (None if the
    state was not given the module's parameters, or one is unknown)."""
    keys = getattr(state, "param_keys", None)
    if not keys:
        return None
    ids = tuple(keys.get(p.data_ptr(), -1) for p in bucket.parameters())
    return None if -1 in ids else ids


def should_hold(state: Any, index: int, pids: tuple[int, ...] | None, signature: tuple) -> bool:
    """True on the first step after a load when DDP's first bucket is not laid out as the
    saved bucket 0 but the saved layout knows its parameters (then the whole step is
    reduced in the saved layout); decided at bucket 0, kept for the step."""
    if state._held is not None:
        return True
    if state.iteration >= state._resume_until or pids is None or index != 0:
        return False
    saved = state.buckets.get(0)
    if saved is None or any(b.params is None for b in state.buckets.values()):
        return False
    return saved.params != pids or saved.signature != signature


def hold(
    state: Any,
    buf: torch.Tensor,
    pids: tuple[int, ...],
    params: list[Any],
    is_last: bool,
    reduce: Callable[..., None],
):
    """Hold one bucket; at the last, reduce the step in the saved layout (see module doc)
    with ``reduce`` (the hooks' ``_reduce_bucket``, passed in: this module is below
    ``_core``)."""
    if state._held is None:
        state._held = Held()
    fut: torch.futures.Future = torch.futures.Future()
    state._held.buckets.append((buf, pids, list(params), fut))
    if is_last:
        held, state._held = state._held, None
        _reduce_saved_layout(state, held, reduce)
    return fut


def _reduce_saved_layout(state: Any, held: Held, reduce: Callable[..., None]) -> None:
    if state._worker is not None:
        state._worker.drain(state.timeout_s)
    views: dict[int, torch.Tensor] = {}
    grads_none: dict[int, bool] = {}
    for buf, pids, params, _ in held.buckets:
        off = 0
        for pid, p in zip(pids, params):
            views[pid] = buf[off : off + p.numel()]
            grads_none[pid] = bool(getattr(p, "requires_grad", False) and p.grad is None)
            off += p.numel()
    order = sorted(state.buckets)
    for k, idx in enumerate(order):
        bs = state.buckets[idx]
        dtype = getattr(torch, bs.signature[1].replace("torch.", ""))
        buf = torch.cat([views[pid].to(dtype) for pid in bs.params])
        keep, off = [], 0
        for pid in bs.params:
            n = views[pid].numel()
            if grads_none[pid]:
                keep.append((off, n))
            off += n
        shapes = bs.signature[2]
        method = bs.meta[0]
        reduce(state, buf, idx, shapes, tuple(keep), method, k == len(order) - 1)
        off = 0
        for pid in bs.params:
            n = views[pid].numel()
            views[pid].copy_(buf[off : off + n])
            off += n
    state._submitted_iter = state.iteration
    for buf, _, _, fut in held.buckets:
        fut.set_result(buf)
