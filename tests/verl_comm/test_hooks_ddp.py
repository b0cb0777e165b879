"""DDP with each verl_comm hook vs DDP without, on gloo with 2 and 3 processes (CPU).

Model and data: ``test_hooks_ddp_worker.Net`` (0-dim gain, 1-dim biases, three same-shape
matrices, a matrix too small for low rank, odd sizes not divisible by W x B, a frozen layer,
a never-used layer with ``find_unused_parameters=True``), different data per rank.

Checks per bucket and step (model after torch's ``test_ddp_hooks.py``):
* allreduce: equal to DDP's own reduction within rtol 1e-5;
* fp16/bf16: within ``(W+1) eps`` of the exact average (ring rounding bound);
* int8: within the per-block bound ``sum_w absmax_w / 127 / W`` of the exact average of
  the error-fed inputs;
* low rank: median relative error <= 1e-4 (bf16: 5e-3), max 1e-2 (bf16 2e-2), against a
  float64 reference of the same algorithm (int8 quantisation of the factors simulated in
  float64);
* replicas bit-identical after every step (sha256 of all parameters on every rank).
Each world size runs all its scenarios in one session of processes (spawning is the cost).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "verl_comm_hooks_ddp_worker", Path(__file__).with_name("test_hooks_ddp_worker.py")
)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

METHODS = ["none", "fp16", "bf16", "int8", "lowrank_int8"]
W2 = [f"compare:method={m}" for m in METHODS] + [
    "compare:method=none,dtype=bfloat16",
    "compare:method=int8,dtype=bfloat16",
    "compare:method=lowrank_int8,dtype=bfloat16",
    "compare:method=int8,dtype=float16",
    "compare:method=none,no_sync=True",
    "compare:method=int8,no_sync=True",
    "compare:method=lowrank_int8,no_sync=True",
    "compare:method=none,static_graph=True",
    "compare:method=lowrank_int8,static_graph=True",
    "compare:method=int8,policy=auto",
    "compare:method=lowrank_int8,policy=auto",
    "nonfinite:method=none,mode=skip",
    "nonfinite:method=int8,mode=skip",
    "nonfinite:method=lowrank_int8,mode=skip",
    "nonfinite:method=bf16,mode=skip",
    "ckpt_save:method=int8",
    "ckpt_save:method=lowrank_int8",
    "nonfinite:method=lowrank_int8,mode=raise",  # last: DDP is unusable after a raise
]
W3 = [f"compare:method={m}" for m in METHODS] + [
    "compare:method=lowrank_int8,policy=auto",
    "nonfinite:method=int8,mode=skip",
    "nonfinite:method=int8,mode=raise",
]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """Results of the W=2 and W=3 sessions, run once per module."""
    cache: dict = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            d = tmp_path_factory.mktemp(f"w{world}")
            cache[world] = (worker.spawn_session(world, W2 if world == 2 else W3, d), d)
        return cache[world][0]

    get.dirs = cache  # type: ignore[attr-defined]
    return get


def _results(per_rank: list[dict], spec: str) -> list[dict]:
    out = []
    for r, d in enumerate(per_rank):
        res = d[spec]
        assert "exception" not in res, f"rank {r} {spec}:\n{res.get('exception')}"
        out.append(res)
    return out


def _check_compare(res: list[dict], method: str, tol: float = 1e-4, max_tol: float = 1e-2) -> None:
    """``tol``: bound on the median low-rank relative error over buckets and steps;
    ``max_tol`` on the max (a factor entry on a rounding boundary can round the other way
    in float64 than in fp32: one int8 step, ~1e-3 relative after orthonormalisation)."""
    world = len(res)
    lowrank_errs = []
    # replicas bit-identical after every step
    for step in range(len(res[0]["hashes"])):
        assert len({r["hashes"][step] for r in res}) == 1, f"replicas differ at step {step}"
    for r in res:
        assert r["finite"]
        assert r["frozen_unchanged"] and r["unused_unchanged"] and r["unused_grad_none"]
        assert r["unused_residual_norm"] == 0.0  # no error-feedback drift without gradients
        for b in r["buckets"]:
            if b["path"] == "allreduce":
                assert b["rel_close"], b
            elif b["path"] in ("fp16", "bf16", "int8"):
                assert b["ratio"] <= 1.0, (b, world)
            elif b["path"] == "lowrank_int8":
                lowrank_errs.append(b["rel_err"])
                assert b["rel_err"] <= max_tol, b
        if method == "none":
            assert r["grad_close"] and all(r["grad_close"])
    if lowrank_errs:
        lowrank_errs.sort()
        assert lowrank_errs[len(lowrank_errs) // 2] <= tol, lowrank_errs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_hook_matches_ddp(sessions, world, method):
    res = _results(sessions(world), f"compare:method={method}")
    _check_compare(res, method)
    paths = set().union(*(r["paths"] for r in res))
    expect = {"none": "allreduce"}.get(method, method)
    assert expect in paths, paths  # the compressed path really ran (after start_iter)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "spec,tol",
    [
        ("compare:method=none,dtype=bfloat16", 1e-4),
        ("compare:method=int8,dtype=bfloat16", 1e-4),
        ("compare:method=lowrank_int8,dtype=bfloat16", 5e-3),
        ("compare:method=int8,dtype=float16", 1e-4),
    ],
)
def test_half_precision_gradients(sessions, spec, tol):
    res = _results(sessions(2), spec)
    _check_compare(res, spec.split("method=")[1].split(",")[0], tol, max(1e-2, 4 * tol))


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "spec",
    [
        "compare:method=none,no_sync=True",
        "compare:method=int8,no_sync=True",
        "compare:method=lowrank_int8,no_sync=True",
        "compare:method=none,static_graph=True",
        "compare:method=lowrank_int8,static_graph=True",
    ],
)
def test_no_sync_and_static_graph(sessions, spec):
    res = _results(sessions(2), spec)
    _check_compare(res, spec.split("method=")[1].split(",")[0])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
def test_auto_policy_agrees_across_ranks(sessions, world):
    specs = ["compare:method=lowrank_int8,policy=auto"]
    if world == 2:
        specs.append("compare:method=int8,policy=auto")
    for spec in specs:
        res = _results(sessions(world), spec)
        _check_compare(res, "auto")
        decisions = [r["decisions"] for r in res]
        assert all(d == decisions[0] for d in decisions)
        assert all(v is not None for v in decisions[0].values())  # every bucket decided


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "world,method", [(2, "none"), (2, "int8"), (2, "lowrank_int8"), (2, "bf16"), (3, "int8")]
)
def test_nonfinite_skip(sessions, world, method):
    res = _results(sessions(world), f"nonfinite:method={method},mode=skip")
    for r in res:
        assert r["error"] is None
        assert r["events"] == [(1, 1)]  # iteration 1, the bucket of blocks[2].weight
        assert r["poisoned_grad_zero"] and r["other_grads_finite"] and r["other_grad_nonzero"]
        flagged = [s for s in r["stats"] if not s["finite"]]
        assert [s["index"] for s in flagged] == [1] and flagged[0]["skipped"]
        assert r["finite"]
    for step in range(3):
        assert len({r["hashes"][step] for r in res}) == 1


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,method", [(2, "lowrank_int8"), (3, "int8")])
def test_nonfinite_raise(sessions, world, method):
    res = _results(sessions(world), f"nonfinite:method={method},mode=raise")
    for r in res:  # every rank raises, naming the bucket
        assert r["error"] is not None and r["error_step"] == 1
        assert "non-finite" in r["error"] and "bucket(s) [1]" in r["error"]


@pytest.mark.timeout(400)
def test_nonfinite_raise_on_the_bf16_direct_path(tmp_path):
    """bf16 on gloo takes the direct path (hooks/direct.py): the step ends in a callback on
    gloo's thread, and its NonFiniteGradientError still reaches every rank's backward,
    naming the bucket (a session of its own: DDP is unusable after a raise)."""
    spec = "nonfinite:method=bf16,mode=raise"
    for r in _results(worker.spawn_session(2, [spec], tmp_path), spec):
        assert r["error"] is not None and r["error_step"] == 1
        assert "non-finite" in r["error"] and "bucket(s) [1]" in r["error"]


@pytest.fixture(scope="module")
def resumed(sessions):
    """Fresh processes that load the step-3 checkpoints of the W=2 session and go on."""
    sessions(2)
    specs = ["ckpt_load:method=int8", "ckpt_load:method=lowrank_int8"]
    return worker.spawn_session(2, specs, sessions.dirs[2][1])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["int8", "lowrank_int8"])
def test_checkpoint_resume_bit_identical(sessions, resumed, method):
    saved = _results(sessions(2), f"ckpt_save:method={method}")
    loaded = _results(resumed, f"ckpt_load:method={method}")
    for r, (a, b) in enumerate(zip(saved, loaded)):
        assert len(b["hashes"]) == 3
        assert a["hashes"][3:] == b["hashes"], f"rank {r} diverged after resume"
