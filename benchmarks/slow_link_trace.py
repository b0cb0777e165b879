"""Per-bucket timeline of one DDP step on a slow link: where each hook's time goes.

For each method (``none``, ``torch_fp16``, ``ours_bf16``, ``ours_int8``) on the comm_hooks
workload (6 x Linear(2048, 2048), bucket_cap_mb 25, batch 64, loss x 1024), after warm-up
steps, one step is traced on every rank with ``time.perf_counter`` (ms from the start of
backward):

Methods ``ours_<m>@<L>`` hold our gloo worker to ``L`` lanes (an A/B of the lanes).
``ours_auto`` is the comm_hooks benchmark's (``benchmarks/_comm_hooks_methods.py``); after
the rounds rank 0 prints what its policy measured (the shadow of each bucket: ms of
backward left after its hook, on the measurement step) and what it chose per bucket, and why.

* ``hook``: DDP called the bucket's hook; ``ret``: the hook returned;
* ``c0``/``c1``: each collective of the bucket started / completed (``torch.distributed``'s
  ``all_reduce`` / ``all_to_all_single`` / ``all_gather_into_tensor`` wrapped in this
  process only; an async call's completion is taken in a ``Future.then`` that reads the
  clock);
* ``done``: the bucket's Future completed; ``bwd``: ``backward()`` returned (DDP waited on
  every Future); ``step``: the optimizer step ended.

Rank 0 prints one JSON line per method and step (``{"method", "round", "events": [...]}``).
Run by ``benchmarks/slow_link_hooks.sh`` with ``TRACE=1`` (same namespaces and link);
``python benchmarks/slow_link_trace.py --summarize FILE`` prints per step: the collective
window (first start to last end), the time some collective was running in it (busy), and
how long backward ran on after the last hook (the exposed tail).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

EVENTS: list[tuple] = []
T0 = [0.0]


def _now() -> float:
    return (time.perf_counter() - T0[0]) * 1e3


def _ev(kind: str, index, **kw) -> None:
    EVENTS.append({"t": round(_now(), 2), "kind": kind, "bucket": index,
                   "thread": threading.current_thread().name[:12], **kw})  # fmt: skip


CURRENT = threading.local()


def _wrap_collectives() -> None:
    for name in ("all_reduce", "all_to_all_single", "all_gather_into_tensor"):
        orig = getattr(dist, name)

        def traced(*a, _orig=orig, _name=name, **kw):
            idx = getattr(CURRENT, "bucket", None)
            _ev("c0", idx, op=_name)
            work = _orig(*a, **kw)
            if kw.get("async_op"):
                work.get_future().then(lambda f: _ev("c1", idx, op=_name))
            else:
                _ev("c1", idx, op=_name)
            return work

        setattr(dist, name, traced)


def _traced_hook(hook):
    def wrapped(state, bucket):
        idx = int(bucket.index())
        CURRENT.bucket = idx
        _ev("hook", idx)
        fut = hook(state, bucket)
        _ev("ret", idx)
        CURRENT.bucket = None

        def done(f):
            _ev("done", idx)
            return f.value()

        return fut.then(done)

    return wrapped


def _ours_job_tag(state) -> None:
    """Tag collectives issued on our worker thread with the bucket being reduced."""
    from verl_comm.hooks import _core

    orig = _core._reduce_bucket

    def tagged(st, buf, index, *a, **kw):
        CURRENT.bucket = index
        _ev("job0", index)
        try:
            return orig(st, buf, index, *a, **kw)
        finally:
            _ev("job1", index)
            CURRENT.bucket = None

    _core._reduce_bucket = tagged


def _lanes(name: str) -> int | None:
    """``ours_int8@1``: our hook with its gloo worker held to 1 lane (an A/B of the lanes)."""
    return int(name.split("@")[1]) if "@" in name else None


def build(name: str, dim: int, layers: int):
    """DDP over ``layers`` x ``Linear(dim, dim)`` (fp32, ``bucket_cap_mb`` 25) with method
    ``name``'s hook wrapped in the per-bucket tracer; returns ``(ddp, optimizer, state)``
    (state None for torch's hooks). Needs an initialised process group.

    Raises:
        pydantic.ValidationError: an unknown ``ours_<method>`` (CompressionConfig).
    """
    from verl_comm.compression.config import CompressionConfig
    from verl_comm.hooks import HOOKS, CommHookState

    torch.manual_seed(0)
    mod = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    ddp = torch.nn.parallel.DistributedDataParallel(mod, bucket_cap_mb=25)
    state = None
    if name == "none":
        ddp.register_comm_hook(None, _traced_hook(default_hooks.allreduce_hook))
    elif name == "torch_fp16":
        ddp.register_comm_hook(None, _traced_hook(default_hooks.fp16_compress_hook))
    else:
        from _comm_hooks_methods import ours_config

        # ours_auto: the benchmark's own configuration; ours_<m>: gradient_compression=<m>
        cfg = ours_config(name.split("@")[0]) or CompressionConfig(
            gradient_compression=name.split("@")[0].removeprefix("ours_"), bucket_cap_mb=25
        )
        state = CommHookState(None, cfg)  # statistics off: the default (stats_every=0)
        ddp.register_comm_hook(state, _traced_hook(HOOKS[cfg.method]))
    opt = torch.optim.SGD(mod.parameters(), lr=0.0)
    return ddp, opt, state


def summarize(path: str) -> None:
    """One line per traced step of ``path`` (this script's output)."""
    from verl_comm.profiler import intervals

    for line in open(path):
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        starts: dict = {}
        spans = []
        for e in d["events"]:
            key = (e["bucket"], e.get("op"))
            if e["kind"] == "c0":
                starts.setdefault(key, []).append(e["t"])
            elif e["kind"] == "c1":
                spans.append((starts[key].pop(0), e["t"]))
        last_hook = max(e["t"] for e in d["events"] if e["kind"] == "hook")
        w0, w1 = min(a for a, _ in spans), max(b for _, b in spans)
        busy = intervals.total(spans)
        print(f"{d['method']:11s} r{d['round']} backward ends {d['bwd']:7.1f} ms, step "
              f"{d['step']:7.1f} | collectives {w0:7.1f}-{w1:7.1f} ({len(spans)}), busy "
              f"{busy:6.1f} of {w1 - w0:6.1f} ms ({busy / (w1 - w0):4.0%}) | after the last "
              f"hook {d['bwd'] - last_hook:6.1f} ms")  # fmt: skip


def main() -> None:
    """Trace the methods on this rank's process group (torchrun variables), or with
    ``--summarize FILE`` print the busy fraction of the link per method from a trace."""
    p = argparse.ArgumentParser()
    p.add_argument("--summarize", metavar="FILE", help="summarize a trace instead")
    p.add_argument("--methods", default="none,torch_fp16,ours_bf16,ours_int8")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    _wrap_collectives()
    _ours_job_tag(None)
    from verl_comm.hooks import lanes

    default_lanes = lanes.LANES
    methods = {n: build(n, a.dim, a.layers) for n in a.methods.split(",")}
    try:
        for r in range(a.warmup + a.rounds):
            g = torch.Generator().manual_seed(1000 * rank + r)
            x = torch.randn(64, a.dim, generator=g)
            for n, (ddp, opt, _) in methods.items():
                lanes.LANES = _lanes(n) or default_lanes
                opt.zero_grad(set_to_none=True)
                dist.barrier()
                EVENTS.clear()
                T0[0] = time.perf_counter()
                loss = ddp(x).float().square().mean() * 1024
                fwd = _now()
                loss.backward()
                bwd = _now()
                opt.step()
                end = _now()
                if rank == 0 and r >= a.warmup:
                    print(json.dumps({"method": n, "round": r, "fwd": round(fwd, 1),
                                      "bwd": round(bwd, 1), "step": round(end, 1),
                                      "events": EVENTS}), flush=True)  # fmt: skip
        if rank == 0:
            _print_policy(methods)
    finally:
        for _, _, st in methods.values():
            if st is not None:
                st.close()
        methods.clear()
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        print(f"load average {os.getloadavg()}", flush=True)


def _print_policy(methods: dict) -> None:
    """Rank 0: what ``policy: auto`` measured and chose per method (the shadows of its
    measurement step, ms of backward left after each bucket's hook, and its decisions)."""
    for n, (_, _, st) in methods.items():
        if st is None or st.config.policy != "auto":
            continue
        marks = st._prev_marks
        shadows = {i: round(st.shadow_of(i) * 1e3, 1) for i in sorted(marks)}
        print(f"policy {n}: measurement step {getattr(st, '_measure_at', '-')}, shadow ms {shadows}; "
              f"{st.auto_note()}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
