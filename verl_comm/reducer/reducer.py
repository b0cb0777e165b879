"""Bucketed gradient reducer: runs DDP communication hooks outside DDP.

DeepSpeed has no comm-hook API, so this module reproduces the part of torch's DDP
``Reducer`` (``torch/csrc/distributed/c10d/reducer.cpp``) that matters to a hook:

* gradients are grouped into buckets (:func:`~verl_comm.reducer.bucket.plan_buckets`,
  ``bucket_cap_mb`` per bucket, a smaller first bucket like DDP);
* each parameter gets a ``register_post_accumulate_grad_hook``; when its gradient is
  ready it is copied into its bucket's flat buffer, and a bucket whose gradients are
  all ready is handed to ``hook(state, bucket)`` at once, so communication overlaps
  the rest of the backward pass. Buckets are launched strictly in index order on
  every rank (a ready bucket waits for the ones before it), so collectives never
  reorder between ranks;
* :meth:`BucketedReducer.finalize` launches what is left (a parameter that got no
  gradient in this step contributes zeros, like DDP's ``find_unused_parameters``),
  waits for every future with a timeout and copies the averaged gradients back
  into ``param.grad`` (or another attribute, see ``grad_attr``) before the
  optimizer step.

Bucket order, a documented choice: the first synchronised step uses reverse
registration order (DDP's guess); after it, the order in which gradients actually
became ready on group rank 0 is broadcast and the buckets are rebuilt once, as DDP
does. Hooks with per-bucket state must therefore start compressing at iteration
>= 1 (torch's PowerSGD requires ``start_powerSGD_iter >= 2`` for the same reason).

Parameters without a gradient: frozen parameters (``requires_grad=False``) are not
bucketed at all. A parameter with no gradient in a step on some rank is sent as
zeros; with ``find_unused_parameters=True`` (default) a small all-reduce of a
"used" bitmap follows, and a parameter no rank produced a gradient for keeps
``grad=None``, so the optimizer skips it and a lossy hook's error feedback cannot
leak into it as a spurious update.

Gradient accumulation: while ``set_sync(False)`` (or inside ``no_sync()``, or while
``sync_predicate()`` returns False) the hooks do nothing and gradients accumulate
locally; the boundary step's backward reduces the accumulated sums.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.reducer.bucket import GradBucket, TensorSpec, plan_buckets
from verl_comm.telemetry import CommRecord, CommRecorder

_MIB = 1024 * 1024
#: DDP's default first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
DEFAULT_FIRST_BUCKET_MB = 1.0

HookFn = Callable[[Any, GradBucket], torch.futures.Future]


class BucketedReducer:
    """Average gradients across a process group through a DDP comm hook, without DDP.

    Args:
        params: a module (its parameters are used) or an iterable of parameters;
            those with ``requires_grad=False`` are skipped.
        hook: a DDP comm hook ``hook(state, bucket) -> Future[Tensor]`` whose result
            (same numel as ``bucket.buffer()``) is the average over the group, e.g.
            torch's ``default_hooks.allreduce_hook`` or ``verl_comm.hooks.int8_hook``.
        state: the hook's state (torch's default hooks take the process group).
        process_group: group to reduce over (``None`` = WORLD); used for the bucket
            order broadcast and the "used" bitmap, the hook uses its own state.
        bucket_cap_mb: bucket size limit in MiB (DDP's ``bucket_cap_mb``).
        first_bucket_cap_mb: limit of the first bucket in MiB (DDP: 1 MiB).
        grad_attr: parameter attribute holding the gradient (``"grad"``).
        grad_dtype: dtype of the bucket buffers; ``None`` = each parameter's dtype.
        find_unused_parameters: exchange a "used" bitmap each synchronised step so
            that parameters unused on every rank keep ``grad=None`` (costs one
            all-reduce of 4 bytes per parameter tensor).
        rebuild_buckets: rebuild buckets once from the observed ready order.
        sync_predicate: optional callable evaluated when a gradient becomes ready;
            False means "accumulation step, do not reduce" (e.g. DeepSpeed's
            ``engine.is_gradient_accumulation_boundary``).
        timeout_s: :meth:`finalize` raises ``TimeoutError`` after this many seconds.
        recorder: optional :class:`~verl_comm.telemetry.CommRecorder`; one record per
            bucket (op ``"bucket_reduce"``, nbytes = uncompressed bucket bytes handed
            to the hook; the hook records its own wire bytes).
        trace: keep the events (``("ready", param_id)``, ``("launch", bucket)``,
            ``("finalize", -1)``) of the last finalised step in :attr:`events`, in the
            order they happened, to show the overlap with backward.

    Raises:
        ValueError: no trainable parameter, parameters on several devices, or a bad
            cap / timeout.
    """

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.nn.Parameter],
        hook: HookFn,
        state: Any,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = DEFAULT_FIRST_BUCKET_MB,
        grad_attr: str = "grad",
        grad_dtype: torch.dtype | None = None,
        find_unused_parameters: bool = True,
        rebuild_buckets: bool = True,
        sync_predicate: Callable[[], bool] | None = None,
        timeout_s: float = 300.0,
        recorder: CommRecorder | None = None,
        trace: bool = False,
    ) -> None:
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        if not self.params:
            raise ValueError("BucketedReducer got no parameter with requires_grad=True")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(
                f"BucketedReducer needs all parameters on one device, got {sorted(map(str, devices))}; "
                "build one reducer per device (or per model replica)"
            )
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if first_bucket_cap_mb is not None and first_bucket_cap_mb <= 0:
            raise ValueError(f"first_bucket_cap_mb must be > 0 or None, got {first_bucket_cap_mb}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.hook = hook
        self.state = state
        self.process_group = process_group
        self.cap_bytes = int(bucket_cap_mb * _MIB)
        self.first_cap_bytes = (
            None if first_bucket_cap_mb is None else int(first_bucket_cap_mb * _MIB)
        )
        self.grad_attr = grad_attr
        self.grad_dtype = grad_dtype
        self.find_unused_parameters = find_unused_parameters
        self.rebuild_buckets = rebuild_buckets
        self.sync_predicate = sync_predicate
        self.timeout_s = timeout_s
        self.recorder = recorder
        self.trace = trace
        self.events: list[tuple[str, int]] = []
        self.step_count = 0  # synchronised steps finalised so far
        self.launched_in_backward = 0  # buckets of the last step launched from a grad hook
        self._sync = True
        self._rebuilt = not rebuild_buckets
        self._device = self.params[0].device
        self._specs = [
            TensorSpec(p.numel(), self._dtype(p).itemsize, str(self._dtype(p))) for p in self.params
        ]
        self._build(list(reversed(range(len(self.params)))))
        self._handles = [
            p.register_post_accumulate_grad_hook(self._make_grad_hook(pid))
            for pid, p in enumerate(self.params)
        ]

    # ------------------------------------------------------------------ layout
    def _dtype(self, p: torch.nn.Parameter) -> torch.dtype:
        return self.grad_dtype if self.grad_dtype is not None else p.dtype

    def _build(self, order: list[int]) -> None:
        """(Re)build buckets for the given expected ready order of parameter ids."""
        plan = plan_buckets(self._specs, order, self.cap_bytes, self.first_cap_bytes)
        self.bucket_plan = plan
        self.buckets = [
            GradBucket(
                i,
                [self.params[pid] for pid in ids],
                is_last=(i == len(plan) - 1),
                dtype=self._dtype(self.params[ids[0]]),
                device=self._device,
            )
            for i, ids in enumerate(plan)
        ]
        self._bucket_of: dict[int, tuple[int, int]] = {}
        for b, ids in enumerate(plan):
            for slot, pid in enumerate(ids):
                self._bucket_of[pid] = (b, slot)
        self._reset_step()

    def _reset_step(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = [len(ids) for ids in self.bucket_plan]
        self._next = 0
        self._futures: dict[int, tuple[torch.futures.Future, float, bool]] = {}
        self._observed: list[int] = []
        if self.trace and getattr(self, "_events", None):
            self.events = self._events
        self._events: list[tuple[str, int]] = []

    # --------------------------------------------------------------- sync API
    def set_sync(self, enabled: bool) -> None:
        """Reduce on the next backward (True) or only accumulate locally (False)."""
        self._sync = bool(enabled)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context in which backward passes accumulate gradients without reducing."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def _sync_now(self) -> bool:
        if not self._sync:
            return False
        return True if self.sync_predicate is None else bool(self.sync_predicate())

    # ----------------------------------------------------------- backward path
    def _make_grad_hook(self, pid: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if self._sync_now():
                self._mark_ready(pid, param)

        return on_grad_ready

    def _mark_ready(self, pid: int, param: torch.Tensor) -> None:
        if self._ready[pid]:
            raise RuntimeError(
                f"gradient of parameter {pid} {tuple(param.shape)} became ready twice before "
                "finalize(); call finalize() after every synchronised backward, and "
                "set_sync(False) / no_sync() on gradient accumulation steps"
            )
        grad = getattr(param, self.grad_attr, None)
        if grad is None:
            return  # e.g. a hook registered before ours moved the gradient elsewhere
        b, slot = self._bucket_of[pid]
        self.buckets[b].gradients()[slot].copy_(grad)
        self._ready[pid] = True
        self._observed.append(pid)
        self._pending[b] -= 1
        if self.trace:
            self._events.append(("ready", pid))
        self._launch_in_order(in_backward=True)

    def _launch_in_order(self, in_backward: bool) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next, in_backward)
            self._next += 1

    def _launch(self, b: int, in_backward: bool) -> None:
        bucket = self.buckets[b]
        for slot, pid in enumerate(self.bucket_plan[b]):
            if not self._ready[pid]:
                bucket.gradients()[slot].zero_()
        if self.trace:
            self._events.append(("launch", b))
        t0 = time.perf_counter()
        try:
            fut = self.hook(self.state, bucket)
        except BaseException:
            self._reset_step()  # e.g. NonFiniteGradientError: the next step starts clean
            raise
        if not (hasattr(fut, "done") and hasattr(fut, "value")):
            raise TypeError(
                f"comm hook {getattr(self.hook, '__name__', self.hook)!r} returned "
                f"{type(fut).__name__}, expected torch.futures.Future[Tensor]"
            )
        self._futures[b] = (fut, t0, in_backward)

    # ------------------------------------------------------------- finalize
    def finalize(self) -> bool:
        """Finish the reduction of this step and write averaged gradients back.

        Call after ``backward()`` and before the optimizer step, on every rank.

        Returns:
            True if gradients were reduced, False on an accumulation (no-sync) step.

        Raises:
            TimeoutError: a bucket's future did not complete within ``timeout_s``
                (a peer rank died or skipped its backward/finalize).
            RuntimeError: the hook's result has the wrong number of elements.
        """
        if not self._sync_now():
            if self._observed:
                raise RuntimeError(
                    "sync was switched off between backward() and finalize(); "
                    "switch it before the backward of the step"
                )
            return False
        if self.trace:
            self._events.append(("finalize", -1))
        self.launched_in_backward = len(self._futures)
        while self._next < len(self.buckets):  # the rest, missing gradients as zeros
            self._launch(self._next, in_backward=False)
            self._next += 1
        used = self._exchange_used() if self.find_unused_parameters else None
        deadline = time.monotonic() + self.timeout_s
        group_size = dist.get_world_size(self.process_group)
        copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for b, bucket in enumerate(self.buckets):
            fut, t0, in_backward = self._futures[b]
            self._wait(fut, b, deadline)
            result = fut.value()
            if isinstance(result, (list, tuple)):
                result = result[0]
            if result.numel() != bucket.buffer().numel():
                raise RuntimeError(
                    f"comm hook returned {result.numel()} elements for bucket {b}, "
                    f"expected {bucket.buffer().numel()} (the shape of bucket.buffer())"
                )
            if result.data_ptr() != bucket.buffer().data_ptr():
                bucket.buffer().copy_(result.reshape(-1))
            self._write_back(b, used, copies)
            if self.recorder is not None:
                self.recorder.record(
                    CommRecord(
                        op="bucket_reduce",
                        nbytes=bucket.nbytes(),
                        group_size=group_size,
                        duration_s=time.perf_counter() - t0,
                        tag=f"reducer/bucket{b}",
                        start_s=t0,
                        extra={
                            "num_params": float(len(bucket.parameters())),
                            "launched_in_backward": float(in_backward),
                        },
                    )
                )
        if copies[0]:
            torch._foreach_copy_(*copies)  # one launch for every gradient, not one per tensor
        self.step_count += 1
        if not self._rebuilt:
            self._rebuild_from_observed()
        else:
            self._reset_step()
        return True

    def _wait(self, fut: torch.futures.Future, b: int, deadline: float) -> None:
        sleep = 1e-5
        while not fut.done():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"bucket {b} of {len(self.buckets)} not reduced after {self.timeout_s:.0f} s; "
                    "a peer rank may have died or skipped backward()/finalize() "
                    "(raise timeout_s if steps are legitimately this slow)"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 1e-3)
        fut.wait()  # re-raises the hook's exception, if any

    def _exchange_used(self) -> list[bool] | None:
        """Which parameters got a gradient on at least one rank (one small all-reduce).

        Returns None when every parameter got a gradient on this rank (then every one is
        used somewhere): the all-reduce still runs, so the ranks stay in step, but its result
        is not read, so a CUDA step has no host sync here.
        """
        if all(self._ready):
            used = torch.ones(len(self._ready), dtype=torch.int32, device=self._device)
            dist.all_reduce(used, group=self.process_group)
            return None
        used = torch.tensor(self._ready, dtype=torch.int32, device=self._device)
        dist.all_reduce(used, group=self.process_group)
        return [v > 0 for v in used.tolist()]

    def _write_back(
        self, b: int, used: list[bool] | None, copies: tuple[list, list] | None = None
    ) -> None:
        """Give bucket ``b``'s parameters their reduced gradient: a new tensor where
        ``grad`` is None, else a copy into ``grad`` (queued in ``copies`` as
        ``(destinations, sources)`` when given, done at once otherwise)."""
        bucket = self.buckets[b]
        for slot, pid in enumerate(self.bucket_plan[b]):
            if used is not None and not used[pid]:
                continue  # no rank produced a gradient: keep grad None, no spurious update
            p = self.params[pid]
            view = bucket.gradients()[slot]
            grad = getattr(p, self.grad_attr, None)
            if grad is None:
                setattr(p, self.grad_attr, view.detach().to(self._dtype(p), copy=True))
            elif copies is not None and grad.dtype == view.dtype and grad.shape == view.shape:
                copies[0].append(grad)
                copies[1].append(view)
            else:
                grad.copy_(view)

    def _rebuild_from_observed(self) -> None:
        observed = list(self._observed)
        missing = [pid for pid in reversed(range(len(self.params))) if pid not in set(observed)]
        order = torch.tensor(observed + missing, dtype=torch.int64, device=self._device)
        if dist.get_world_size(self.process_group) > 1:
            src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
            dist.broadcast(order, src=src, group=self.process_group)
        self._rebuilt = True
        self._build([int(i) for i in order.tolist()])

    # ----------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The bucket layout (parameter order) and whether it was rebuilt.

        Save it with the hook state: a fresh process that loads both uses the same
        buckets as the saved run, so per-bucket error feedback resumes bit-identically.
        """
        order = [pid for ids in self.bucket_plan for pid in ids]
        return {"order": order, "rebuilt": self._rebuilt, "step_count": self.step_count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s layout (call before the first backward).

        Raises:
            ValueError: the saved order does not match this reducer's parameters.
        """
        order = [int(i) for i in sd["order"]]
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(
                f"saved reducer layout covers {len(order)} parameters, this reducer has "
                f"{len(self.params)}; load the state saved for the same model"
            )
        self._build(order)
        self._rebuilt = bool(sd["rebuilt"])
        self.step_count = int(sd.get("step_count", 0))

    # ------------------------------------------------------------------ misc
    def remove(self) -> None:
        """Remove the gradient hooks (the reducer does nothing afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (
            f"BucketedReducer(params={len(self.params)}, buckets={len(self.buckets)}, "
            f"cap_bytes={self.cap_bytes}, hook={getattr(self.hook, '__name__', self.hook)})"
        )
