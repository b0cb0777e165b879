"""Which worker lane a bucket's chain runs on (gloo, W > 1; see :mod:`verl_comm.hooks.worker`).

A chain may run on a lane other than 0 only if it touches no state shared between buckets,
and the answer must be the same on every rank (each lane is its own process group, whose
collectives must come in the same order everywhere). Every input of the rule below is:
the bucket layout and method (the same on every rank), and the bucket's own state, which
only its own jobs change and which is read after the previous step drained.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_comm.compression.collective import Collective, ProcessGroupCollective

from . import hierarchy, trial
from .state import BucketState, CommHookState

COMPRESSING = ("fp16", "bf16", "int8", "lowrank_int8")

LANES = 4
"""Worker lanes on gloo. Two matched the two collectives in flight that gloo's default of
two threads per process group gives torch's async hooks; with int8's pipelined slices
(``compression/int8_allreduce.py``) a lane has up to two collectives in flight itself, and
a later bucket no longer waits for the lane of the bucket two before it. Per-bucket trace
on the shaped 1 Gbit/s veth (``TRACE=1 METHODS=torch_fp16,ours_int8@2,ours_int8@4
benchmarks/slow_link_hooks.sh``, 8 steps each, medians): int8 612 ms with 2 lanes, 582 ms
with 4, torch fp16 625 ms."""


def bucket_keys(state: CommHookState, buf: torch.Tensor, shapes: tuple, method: str):
    """``(signature, meta)`` of a bucket: its layout, and the method and settings its state
    was built for (a change of either resets the bucket's state)."""
    cfg = state.config
    signature = (buf.numel(), str(buf.dtype), shapes)
    meta = (method, cfg.compression_rank or 0, cfg.quant_block, cfg.residual_dtype)
    return signature, (*meta, cfg.error_feedback)


def lowrank_settled(state: CommHookState, bs: BucketState | None) -> bool:
    """Whether a low-rank chain of this bucket state touches nothing shared between buckets:
    its plan and factor wire are cached (no link measurement on the state's collective),
    and with ``warm_start`` every group's Q is stored in its shape (no draw from the state's
    generator). True from the bucket's second compressed step on."""
    if bs is None or not state.config.warm_start or bs.plan is None or bs.wire is None:
        return False
    qs = bs.lowrank.qs
    groups = bs.plan.groups
    return len(qs) == len(groups) and all(
        q is not None and tuple(q.shape) == (g.k, g.m, g.rank) for q, g in zip(qs, groups)
    )


def lane_of(
    state: CommHookState, worker: Any, method: str, index: int, buf: torch.Tensor, shapes: tuple
) -> int:
    """The worker lane of bucket ``index``: ``index % LANES`` for chains that touch no state
    shared between buckets (plain, fp16, bf16, int8 with its per-bucket residual, low rank
    once :func:`lowrank_settled`, and under ``policy: auto`` a bucket whose path an earlier
    step chose, low rank under the same condition) over WORLD; 0 for a low-rank bucket's
    first compressed step (the state's generator draws its warm-start factors, the link
    model is measured once), for ``auto`` buckets still to decide (decisions are made in
    bucket order on one timeline) and for a state on a subgroup (issue 28: on lane 0 alone
    every low-rank bucket's compute waited for the previous bucket's transfers). Opening
    the lanes makes a process group over WORLD: every rank does it at the same hook call."""
    signature, meta = bucket_keys(state, buf, shapes, method)
    bs = state.buckets.get(index)
    if bs is not None and (bs.signature, bs.meta) != (signature, meta):
        bs = None  # the bucket's state will be reset by its job
    chosen = method
    if method in COMPRESSING and state.config.policy == "auto":
        d = None if bs is None else bs.decision
        if d is None:
            return 0
        chosen = trial.path_of(state, index, d.method or (method if d.compress else "allreduce"))
    if chosen == "lowrank_int8" and not lowrank_settled(state, bs):
        return 0
    if worker.lanes < LANES:
        group = getattr(state.collective, "group", None)
        if group is not None and group != dist.group.WORLD:
            return 0  # a new group would need every rank of WORLD to make it with us

        def make() -> Collective:
            # every rank makes it (WORLD), in the same order: a numbered group name
            coll = ProcessGroupCollective(dist.new_group(backend=dist.get_backend()))
            if hierarchy.wants(state.config, method):
                hierarchy.attach(state, coll)
            return coll

        worker.open_lanes(LANES, make)
    return index % LANES
