"""One rank of a distributed failure scenario, for ``tests/verl_comm/test_dist*.py``.

Run as a script (not imported by pytest): ``python dist_scenarios.py SCENARIO --rank R
--world W --port P --timeout S``. Prints one line ``RESULT {json}`` with ``ok``,
``error_type``, ``message``, ``elapsed_s`` (seconds from just before the scenario's first
distributed call) and scenario-specific fields, then exits without interpreter teardown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from verl_comm.distributed import init_distributed


def _start_barrier(sync_dir: str, rank: int, launched: int, deadline_s: float = 120.0) -> None:
    """Wait until every launched process has imported torch, so slow imports on a loaded
    machine do not eat into the few-second deadlines under test."""
    open(os.path.join(sync_dir, f"ready.{rank}"), "w").close()
    end = time.monotonic() + deadline_s
    while len([f for f in os.listdir(sync_dir) if f.startswith("ready.")]) < launched:
        if time.monotonic() > end:
            raise SystemExit("start barrier: peers never started")
        time.sleep(0.02)


def _init(a, **kw):
    return init_distributed(
        "gloo", a.timeout, rank=a.rank, world_size=a.world, master_port=a.port, **kw
    )


def bad_ifname(a, out):
    for value in ("nonexistent0", "^lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = value
        _case(out, value, lambda: _init(a))


def rendezvous(a, out):
    _init(a)


def one_rank_only(a, out):
    """After one barrier together, rank 1 skips the next collective (debug mode off)."""
    ctx = _init(a)
    ctx.barrier()
    if a.rank == 0:
        t0 = time.perf_counter()
        try:
            ctx.all_reduce(torch.ones(4))
        finally:
            out["op_s"] = time.perf_counter() - t0
    else:
        time.sleep(a.timeout + 2.5)  # stay alive: a timeout, not a closed connection


def subgroup_timeout(a, out):
    """First a sub-group with its own deadline (half the job's), then one with the job's."""
    ctx = _init(a)
    own = ctx.new_group([0, 1], timeout_s=a.timeout / 2)
    sub = ctx.new_group([0, 1])
    if a.rank == 0:
        t0 = time.perf_counter()
        try:
            ctx.all_reduce(torch.ones(4), group=own)
        except Exception as e:
            out["own"] = {"error_type": type(e).__name__, "message": str(e)}
        out["own_op_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            ctx.all_reduce(torch.ones(4), group=sub)
        finally:
            out["op_s"] = time.perf_counter() - t0
    else:
        time.sleep(1.5 * a.timeout + 2 * 1.0 + 2.5)  # both deadlines and report graces


def rank0_long_no_helper(a, out):
    ctx = _init(a)
    t0 = time.perf_counter()
    if a.rank == 0:
        time.sleep(a.timeout + 2.0)  # "evaluation" longer than the timeout
        out["op_s"] = 0.0
        return
    try:
        ctx.all_reduce(torch.ones(4))
    finally:
        out["op_s"] = time.perf_counter() - t0


def _case(out, name, fn):
    """Run one case of the debug suite; record its error (or success) and duration."""
    t0 = time.perf_counter()
    try:
        fn()
        out[name] = {"ok": True}
    except Exception as e:
        out[name] = {"ok": False, "error_type": type(e).__name__, "message": str(e)}
    out[name]["op_s"] = time.perf_counter() - t0


def debug_suite(a, out):
    """Cases after which the process group stays usable, run in one job (fingerprint on):
    each failing case raises on every rank before any backend collective is issued."""
    ctx = _init(a, fingerprint=True)
    rank = a.rank

    def healthy():
        t = torch.arange(5, dtype=torch.float32) * (rank + 1)
        ctx.all_reduce(t, check_finite_first=True)
        out["sum"] = t.tolist()
        ctx.barrier()

    def nan():
        g = torch.arange(8, dtype=torch.float32)
        if rank == 1:
            g[3] = float("nan")
        plain = g.clone()
        ctx.all_reduce(plain)  # what a plain all-reduce does: every rank gets the NaN
        out["plain_has_nan"] = bool(torch.isnan(plain).any())
        ctx.all_reduce(g, check_finite_first=True, name="grad bucket 0")

    def mismatch_op():
        t = torch.ones(4)
        ctx.all_reduce(t) if rank == 0 else ctx.broadcast(t, src=0)

    def mismatch_shape():
        ctx.all_reduce(torch.ones(4 if rank == 0 else 8))

    def section_raises():
        with ctx.rank0_section("checkpoint", timeout_s=30) as mine:
            if mine:
                raise OSError("disk full")

    def section_long():
        with ctx.rank0_section("eval", timeout_s=a.timeout + 10) as mine:
            if mine:
                time.sleep(a.timeout + 1.5)  # longer than the collective timeout
        t = torch.full((3,), float(rank + 1))
        ctx.all_reduce(t)
        out["section_sum"] = t.tolist()

    def one_rank_only():
        if rank == 0:
            ctx.all_reduce(torch.ones(4))  # rank 1 skips it and goes on to tear down
        ctx.destroy()

    for name, fn in [
        ("healthy", healthy),
        ("nan", nan),
        ("mismatch_op", mismatch_op),
        ("mismatch_shape", mismatch_shape),
        ("section_raises", section_raises),
        ("section_long", section_long),
        ("one_rank_only", one_rank_only),
    ]:
        _case(out, name, fn)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--sync-dir", required=True)
    p.add_argument("--launched", type=int, required=True)
    a = p.parse_args()
    _start_barrier(a.sync_dir, a.rank, a.launched)
    out: dict = {"rank": a.rank, "ok": True}
    t0 = time.perf_counter()
    try:
        globals()[a.scenario](a, out)
    except Exception as e:
        out.update(ok=False, error_type=type(e).__name__, message=str(e))
    out["elapsed_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo may abort at exit after a failure)


if __name__ == "__main__":
    main()
