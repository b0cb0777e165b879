"""Worker processes for the execution-model tests of the hooks (gloo, CPU); not a test module.

Launched by ``test_hooks_async.py`` through ``test_hooks_ddp_worker.spawn_session`` (its
``run_session`` reads :data:`SCENARIOS` of this file); each scenario returns a dict of plain
results per rank.
"""

from __future__ import annotations

import hashlib
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _cfg(method: str, **kw):
    import warnings

    from verl_comm.compression import CompressionConfig

    comp = {"none": "none", "lowrank_int8": "int8"}.get(method, method)
    base = dict(
        gradient_compression=comp,
        compression_rank=2 if method == "lowrank_int8" else None,
        start_iter=1,
        quant_block=32,
        bucket_cap_mb=0.002,
    )
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 2 is asked for
        return CompressionConfig(**base)


def _hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Tiny(nn.Module):
    """Three small layers (each its own bucket at a 2 kB cap); ``odd`` is used on even
    steps only, so DDP issues its unused-parameter all-reduce inside backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.odd = nn.Linear(32, 24)
        self.b = nn.Linear(32, 8)
        self.c = nn.Linear(24, 8, bias=False)

    def forward(self, x: torch.Tensor, use_odd: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        out = self.b(h)
        if use_odd:
            out = out + self.c(self.odd(h))
        return out


def scenario_many_steps(rank, world, tmp, method, steps=100, reducer=False, lanes=0):
    """``steps`` DDP (or reducer) steps with a caller all-reduce right after backward
    (finalize for the reducer) and DDP's own unused-parameter collective inside backward:
    no deadlock, the caller's collective always sums what it should, replicas identical.
    ``lanes``: the worker's lanes (0: the default); the worker thread each compressed
    bucket ran on is returned per iteration."""
    from verl_comm.hooks import _core, make_hook
    from verl_comm.hooks import lanes as lanes_mod
    from verl_comm.reducer import BucketedReducer

    real_run_path, default_lanes = _core.run_path, lanes_mod.LANES
    threads: dict = {}

    def run_path(st, bs, path, fn, buf, coll, keep):
        if path != "allreduce":
            threads.setdefault(st.iteration, []).append(threading.current_thread().name)
        return real_run_path(st, bs, path, fn, buf, coll, keep)

    _core.run_path = run_path
    lanes_mod.LANES = lanes or default_lanes

    torch.manual_seed(0)
    model = Tiny()
    hook, state = make_hook(_cfg(method), timeout_s=60)
    red = None
    if reducer:
        red = BucketedReducer(model, hook, state, bucket_cap_mb=0.002, timeout_s=60)
        fwd = model
    else:
        fwd = DDP(model, bucket_cap_mb=0.002, find_unused_parameters=True)
        fwd.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bad = []
    t0 = time.perf_counter()
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, 16, generator=g)
        fwd(x, use_odd=step % 2 == 0).square().mean().backward()
        if red is not None:
            red.finalize()
        t = torch.tensor([float(rank + 10 * step)])
        dist.all_reduce(t)  # the caller's collective, right after the reduction
        if float(t) != sum(range(world)) + 10.0 * step * world:
            bad.append((step, float(t)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    _core.run_path, lanes_mod.LANES = real_run_path, default_lanes
    worker = state._worker
    alive_before = worker is not None and worker.is_alive()
    state.close()
    out = {
        "threads": {str(i): sorted(set(t)) for i, t in threads.items()},
        "bad_caller_sums": bad,
        "hash": _hash(model),
        "iteration": state.iteration,
        "seconds": time.perf_counter() - t0,
        "worker_used": alive_before,
        "worker_closed": worker is None or not worker.is_alive(),
        "paths": sorted({s.method for s in state.last_stats.values()}),
    }
    if red is not None:
        red.remove()
    del fwd, model
    return out


class _Mid(torch.autograd.Function):
    """Identity whose backward first calls ``fn()`` (a stand-in for the rest of a long
    backward, or a probe between two buckets)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fn()
        return g, None


class _Two(nn.Module):
    """Layers a then b, each its own bucket (b's is bucket 0: ready first). ``mid`` runs
    in backward between the two buckets, ``late`` before everything (this rank's lag)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.mid = None
        self.late = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.mid is not None:
            h = _Mid.apply(h, self.mid)
        y = self.b(h)
        if self.late is not None:
            y = _Mid.apply(y, self.late)
        return y


def scenario_overlap(rank, world, tmp, method="int8"):
    """Backward spends 0.4 s between bucket 0 (layer b) and bucket 1 (layer a); rank 1
    starts its backward 1.2 s late, so rank 0's bucket 0 waits on the link. Rank 0's
    backward must go on meanwhile and hand over bucket 1 before bucket 0 is reduced (a hook
    that communicates in its body would hand bucket 1 over only after)."""
    from verl_comm.hooks import make_hook
    from verl_comm.telemetry import CommRecorder

    torch.manual_seed(0)
    model = _Two()
    rec = CommRecorder()
    hook, state = make_hook(_cfg(method, bucket_cap_mb=0.01), recorder=rec)
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, hook)
    timeline = []
    for step in range(3):
        slow = step == 2
        model.mid = (lambda: time.sleep(0.4)) if slow else None
        model.late = (lambda: time.sleep(1.2)) if slow and rank == 1 else None
        rec.drain()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank + step))
        ddp(x).square().mean().backward()
        timeline = [
            (int(r.tag.rsplit("bucket", 1)[1]), r.start_s, r.duration_s, r.extra["submitted_s"])
            for r in rec.drain()
        ]
    state.close()
    del ddp, model
    return {"timeline": sorted(timeline)}


def scenario_failure(rank, world, tmp, method="int8", timeout_s=4):
    """An exception inside rank 0's worker at bucket 1 of step 2: every rank raises one
    CommWorkerError within the process group's timeout."""
    from verl_comm.hooks import _core, make_hook

    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = Tiny()
    hook, state = make_hook(_cfg(method), group)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.002)
    ddp.register_comm_hook(state, hook)
    real = _core.PATHS[method]
    calls = {"n": 0}

    def broken(st, bs, buf, coll, keep=()):
        if rank == 0 and st.iteration == 2:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected failure")
        return real(st, bs, buf, coll, keep)

    _core.PATHS[method] = broken
    out = {"error": None}
    try:
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank + step))
            t0 = time.perf_counter()
            try:
                ddp(x, use_odd=True).square().mean().backward()
            except Exception as e:  # noqa: BLE001 - the error under test
                out.update(error=f"{type(e).__name__}: {e}", step=step)
                out["seconds"] = time.perf_counter() - t0
                break
    finally:
        _core.PATHS[method] = real
    del ddp, model
    return out


def scenario_unused_residual(rank, world, tmp, method):
    """Issue 18 item 4: ``odd`` (its own bucket) gets no gradient on odd steps; its
    error-feedback residual must come out of such a step exactly as it went in."""
    from verl_comm.hooks import make_hook

    torch.manual_seed(0)
    model = Tiny()
    hook, state = make_hook(_cfg(method))
    ddp = DDP(model, bucket_cap_mb=0.002, find_unused_parameters=True)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def odd_state() -> list[torch.Tensor]:
        for bs in state.buckets.values():
            if (24, 32) in bs.signature[2]:
                lr = bs.lowrank
                ts = [bs.residual, lr.rest_residual, *lr.residuals]
                return [t.clone() for t in ts if t is not None]
        return []

    kept, norms, moved = [], [], []
    for step in range(8):
        before, w0 = odd_state(), model.odd.weight.detach().clone()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank + 10 * step))
        ddp(x, use_odd=step % 2 == 0).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after = odd_state()
        norms.append(float(sum(t.double().norm() ** 2 for t in after) ** 0.5) if after else 0.0)
        if step % 2 == 1:
            if before:  # a residual existed when the step began
                kept.append(len(before) == len(after) and all(map(torch.equal, before, after)))
            moved.append(not torch.equal(w0, model.odd.weight))
    out = {"kept": kept, "norms": norms, "moved": moved, "ef_bytes": state.ef_state_nbytes()}
    del ddp, model
    return out


def scenario_count(rank, world, tmp):
    """Collectives that reach torch.distributed per low-rank bucket in a steady step."""
    from verl_comm.hooks import make_hook
    from verl_comm.hooks._core import bucket_plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 48), nn.Linear(48, 48, bias=False))
    hook, state = make_hook(_cfg("lowrank_int8", compression_rank=4, bucket_cap_mb=1.0))
    ddp = DDP(model, bucket_cap_mb=1.0)
    ddp.register_comm_hook(state, hook)
    names = ("all_reduce", "all_to_all_single", "all_gather_into_tensor")
    real = {n: getattr(dist, n) for n in names}
    count = {"n": 0}
    lock = threading.Lock()

    def counting(fn):
        def wrapped(*a, **k):
            with lock:
                count["n"] += 1
            return fn(*a, **k)

        return wrapped

    per_step = []
    try:
        for n in names:
            setattr(dist, n, counting(real[n]))
        for step in range(4):
            count["n"] = 0
            x = torch.randn(4, 48, generator=torch.Generator().manual_seed(rank + step))
            ddp(x).square().mean().backward()
            per_step.append(count["n"])
    finally:
        for n in names:
            setattr(dist, n, real[n])
    buckets = []
    for bs in state.buckets.values():
        plan = bucket_plan(state, bs, bs.signature[0])
        buckets.append(
            {
                "rest": plan.rest_numel,
                "groups": len(plan.groups),
                "calls": plan.collectives(bs.wire),
            }
        )
    out = {
        "per_step": per_step,
        "buckets": buckets,
        "paths": [s.method for s in state.last_stats.values()],
    }
    del ddp, model
    return out


def scenario_state_dict_in_flight(rank, world, tmp):
    """``state_dict()`` called inside backward after bucket 0 was handed to the worker and
    before bucket 1 exists: it waits for the buckets handed over so far and snapshots
    exactly them (bucket 0 as reduced in this step, bucket 1 as before the step)."""
    from verl_comm.hooks import make_hook

    torch.manual_seed(0)
    model = _Two()
    hook, state = make_hook(_cfg("int8", bucket_cap_mb=0.01))
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, hook)
    snap = {}
    before = {}
    for step in range(3):
        if step == 2:
            before = {i: b.residual.clone() for i, b in state.buckets.items()}
            model.mid = lambda: snap.update(sd=state.state_dict())
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank + step))
        ddp(x).square().mean().backward()
    res = {}
    for i, b in state.buckets.items():
        saved = snap["sd"]["buckets"][i]["residual"]
        res[i] = {
            "equal_after": torch.equal(saved, b.residual),
            "equal_before": i in before and torch.equal(saved, before[i]),
        }
    out = {"buckets": res, "iteration_saved": snap["sd"]["iteration"]}
    state.close()
    del ddp, model
    return out


def scenario_auto_measure(rank, world, tmp, steps=4):
    """``policy: auto`` on the worker: backward spends 0.3 s (rank 0; 0.6 s on the others)
    between bucket 0 and bucket 1 on every step. Logs when each hook was called and when each bucket's reduction started
    (``_core.run_path``), per iteration; returns them with the decisions taken."""
    from verl_comm.hooks import _core, make_hook

    torch.manual_seed(0)
    model = _Two()
    model.mid = lambda: time.sleep(0.3 if rank == 0 else 0.6)
    hook, state = make_hook(_cfg("int8", policy="auto", bucket_cap_mb=0.01), timeout_s=60)
    hooks, starts = [], []

    def logged(st, bucket):
        hooks.append((st.iteration, int(bucket.index()), time.perf_counter()))
        return hook(st, bucket)

    real = _core.run_path

    def run_path(st, bs, path, fn, buf, coll, keep):
        starts.append((st.iteration, bs.signature[0], path, time.perf_counter()))
        return real(st, bs, path, fn, buf, coll, keep)

    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, logged)
    _core.run_path = run_path
    try:
        for step in range(steps):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank + step))
            ddp(x).square().mean().backward()
    finally:
        _core.run_path = real
    decisions = {i: (b.decision.method, b.decision.shadow_s) for i, b in state.buckets.items()}
    out = {
        "hooks": hooks,
        "starts": starts,
        "decisions": decisions,
        "measure_at": state._measure_at,
        "hash": _hash(model),
    }
    state.close()
    del ddp, model
    return out


def scenario_direct_bits(rank, world, tmp):
    """fp16/bf16 buckets (fp32 and bf16 buffers, an odd size) through the hook's direct gloo
    path and through :func:`~verl_comm.compression.int8_allreduce.cast_allreduce` on the same
    inputs: whether the results are equal bit for bit, and whether the worker stayed unused."""
    from verl_comm.compression.collective import ProcessGroupCollective
    from verl_comm.compression.int8_allreduce import cast_allreduce
    from verl_comm.hooks import make_hook
    from verl_comm.hooks.bucket import GradBucket

    wire = {"fp16": torch.float16, "bf16": torch.bfloat16}
    out: dict = {"equal": {}, "worker": {}}
    for method in ("fp16", "bf16"):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(100 * rank + 7)
            x = (torch.randn(4099, generator=g) * 3).to(dtype)
            hook, state = make_hook(_cfg(method), timeout_s=60)
            got = hook(state, GradBucket.from_tensors([x.clone()])).wait().clone()
            ref = cast_allreduce(
                x.clone(), ProcessGroupCollective(None), wire_dtype=wire[method], out=None
            ).out
            key = f"{method}/{dtype}"
            out["equal"][key] = bool(torch.equal(got.view(-1), ref.view(-1)))
            out["worker"][key] = state._worker is not None
            out.setdefault("iteration", {})[key] = state.iteration
            state.close()
    return out


def scenario_int8_pipeline(rank, world, tmp):
    """int8's host path over gloo (asynchronous all-to-alls and all-gathers, several slices
    in flight, issue 28) against the same all-reduce with every collective blocking, one
    slice at a time: whether out, residual and bytes sent are equal bit for bit, the number
    of collectives each started asynchronously, and the slices."""
    import importlib

    from verl_comm.compression.collective import ProcessGroupCollective

    mod = importlib.import_module("verl_comm.compression.int8_allreduce")  # not the function

    class Counting(ProcessGroupCollective):
        started = 0

        def start_all_to_all_single(self, output, input):
            self.started += 1
            return super().start_all_to_all_single(output, input)

        def start_all_gather_into_tensor(self, output, input):
            self.started += 1
            return super().start_all_gather_into_tensor(output, input)

    n = 50_001
    g = torch.Generator().manual_seed(31 * rank + 5)
    x = torch.randn(n, generator=g) * (1 + rank)
    r0 = (torch.randn(n, generator=g) * 0.1).bfloat16()
    old = mod.HOST_MIN_SLICE_BYTES
    mod.HOST_MIN_SLICE_BYTES = 4096  # HOST_SLICES slices at this n
    try:
        coll, ra = Counting(None), r0.clone()
        a = mod.int8_allreduce(x, coll, block=64, residual=ra)
        rb = r0.clone()
        b = mod._reduce_direct(x, ProcessGroupCollective(None), 64, rb, True, torch.empty(n))
    finally:
        mod.HOST_MIN_SLICE_BYTES = old
    return {
        "equal": bool(torch.equal(a.out, b.out)) and bool(torch.equal(ra, rb)),
        "bytes": [a.wire_bytes, b.wire_bytes],
        "started": coll.started,
        "finite": bool(a.finite),
    }


SCENARIOS = {
    "int8_pipeline": scenario_int8_pipeline,
    "direct_bits": scenario_direct_bits,
    "auto_measure": scenario_auto_measure,
    "many_steps": scenario_many_steps,
    "overlap": scenario_overlap,
    "failure": scenario_failure,
    "unused_residual": scenario_unused_residual,
    "count": scenario_count,
    "state_dict_in_flight": scenario_state_dict_in_flight,
}
