"""Tests of verl_comm.reducer: the bucket planner against torch's own, GradBucket's
contract, and 2-process gloo runs of the reducer against DDP with the same hook.

Multi-process cases run :func:`_worker` of this file on W ranks through the library
launcher (:func:`verl_comm.distributed.launch.spawn`); each rank returns its results and the
test compares them.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from verl_comm.distributed.launch import spawn
from verl_comm.reducer import BucketedReducer, GradBucket, TensorSpec, plan_buckets


# ----------------------------------------------------------------- pure tests
def test_plan_buckets_matches_torch_assignment():
    rng = random.Random(0)
    for trial in range(30):
        n = rng.randint(1, 25)
        tensors = [
            torch.empty(
                rng.choice([1, 3, 100, 1000, 5000]),
                dtype=rng.choice([torch.float32, torch.bfloat16]),
            )
            for _ in range(n)
        ]
        cap, first = rng.choice([(4000, 4000), (8000, 2000), (50_000, 1000)])
        specs = [TensorSpec(t.numel(), t.element_size(), str(t.dtype)) for t in tensors]
        ours = plan_buckets(specs, list(range(n)), cap, first)
        ref, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap])
        assert ours == [list(b) for b in ref], f"trial {trial}"


def test_plan_buckets_follows_order_and_validates():
    specs = [TensorSpec(10, 4, "f32")] * 4
    assert plan_buckets(specs, [3, 2, 1, 0], cap_bytes=80) == [[3, 2], [1, 0]]
    assert plan_buckets(specs, [3, 2, 1, 0], cap_bytes=80, first_cap_bytes=40) == [
        [3],
        [2, 1],
        [0],
    ]
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets(specs, [0, 1, 2], cap_bytes=80)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        plan_buckets(specs, [0, 1, 2, 3], cap_bytes=0)


def test_grad_bucket_views_and_set_buffer():
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(()))]
    b = GradBucket(0, params, is_last=True, dtype=torch.float32, device=torch.device("cpu"))
    assert b.buffer().shape == (7,) and b.index() == 0 and b.is_last()
    assert [g.shape for g in b.gradients()] == [(2, 3), ()]
    b.gradients()[0].fill_(2.0)
    b.gradients()[1].fill_(5.0)
    assert b.buffer().tolist() == [2.0] * 6 + [5.0]
    b.set_buffer(torch.arange(7.0))
    assert b.gradients()[1].item() == 6.0 and b.gradients()[0][1, 0].item() == 3.0
    assert b.parameters()[0] is params[0]
    with pytest.raises(ValueError, match="1-D tensor of 7"):
        b.set_buffer(torch.zeros(3))


# ------------------------------------------------------------ worker helpers
class ScalarNet(torch.nn.Module):
    """Linear layers (two of the same shape), a LayerNorm (1-D params), a 0-dim scale,
    a frozen layer, and a branch only rank 0 uses (when ``uneven``)."""

    def __init__(self, uneven: bool = False) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.rank0_only = torch.nn.Linear(16, 16)
        self.never_used = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)
        self.uneven = uneven

    def forward(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        h = self.frozen(self.norm(h)) * self.scale
        if self.uneven and rank == 0:
            h = h + self.rank0_only(h)
        return self.out(h)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.detach().clone())
        for n, p in model.named_parameters()
    }


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _loss(model, x, y, rank):
    return ((model(x, rank) - y) ** 2).mean()


def _hook_by_name(name: str):
    if name == "allreduce":
        return default_hooks.allreduce_hook
    if name == "fp16":
        return default_hooks.fp16_compress_hook
    raise ValueError(name)


def scenario_vs_ddp(rank: int, world: int, hook_name: str, out: dict) -> None:
    """Same model, data and hook: DDP vs the reducer, 4 SGD steps, gradients compared."""
    uneven = hook_name == "allreduce"
    torch.manual_seed(0)
    ref = ScalarNet(uneven=uneven)
    torch.manual_seed(0)
    mine = ScalarNet(uneven=uneven)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
    ddp.register_comm_hook(None, _hook_by_name(hook_name))
    red = BucketedReducer(
        mine, _hook_by_name(hook_name), None, bucket_cap_mb=0.002, first_bucket_cap_mb=None
    )
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    out["ddp"], out["mine"], out["buckets"] = [], [], []
    for step in range(4):
        x, y = _batch(rank, step)
        _loss(ddp, x, y, rank).backward()
        _loss(mine, x, y, rank).backward()
        assert red.finalize()
        out["ddp"].append(_grads(ref))
        out["mine"].append(_grads(mine))
        out["buckets"].append(len(red.buckets))
        opt_ref.step()
        opt_mine.step()
        opt_ref.zero_grad(set_to_none=True)
        opt_mine.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in mine.named_parameters()}
    del ddp, ref


def scenario_vs_ddp_ours(rank: int, world: int, out: dict) -> None:
    """verl_comm's int8 and int8 low-rank hooks: DDP vs the reducer, bucket for bucket.

    All parameters are used, so DDP rebuilds its buckets from the ready order after
    iteration 0, as the reducer does; with start_iter=1 both compress from iteration 1
    on identical bucket layouts, so the gradients must agree to float rounding.
    """
    import warnings

    from verl_comm.compression.config import CompressionConfig
    from verl_comm.hooks import make_hook

    warnings.simplefilter("ignore")
    cap = 0.002
    configs = {
        "int8": CompressionConfig(gradient_compression="int8", start_iter=1, bucket_cap_mb=cap),
        "lowrank": CompressionConfig(
            gradient_compression="int8", compression_rank=2, start_iter=1, bucket_cap_mb=cap
        ),
    }
    for name, cfg in configs.items():
        torch.manual_seed(0)
        ref = ScalarNet()
        torch.manual_seed(0)
        mine = ScalarNet()
        for m in (ref, mine):  # every parameter used: DDP rebuilds its buckets
            del m.rank0_only, m.never_used
        ddp = torch.nn.parallel.DistributedDataParallel(ref, bucket_cap_mb=cap)
        ddp.register_comm_hook(*reversed(make_hook(cfg)))
        hook, state = make_hook(cfg)
        red = BucketedReducer(mine, hook, state, bucket_cap_mb=cap, first_bucket_cap_mb=None)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
        out[name] = {"ddp": [], "mine": [], "buckets": len(red.buckets), "methods": []}
        for step in range(4):
            x, y = _batch(rank, step)
            _loss(ddp, x, y, rank).backward()
            _loss(mine, x, y, rank).backward()
            red.finalize()
            out[name]["ddp"].append(_grads(ref))
            out[name]["mine"].append(_grads(mine))
            out[name]["methods"].append(sorted({s.method for s in state.last_stats.values()}))
            for opt in (opt_ref, opt_mine):
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[name]["buckets"] = len(red.buckets)
        del ddp, ref


def scenario_resume(rank: int, world: int, out: dict) -> None:
    """Low-rank int8 with error feedback: 4 steps straight vs 2 steps, save everything
    (model, optimizer, hook state, reducer layout) through torch.save, fresh objects,
    load, 2 more steps. Parameters must be bit-identical."""
    import io
    import warnings

    from verl_comm.compression.config import CompressionConfig
    from verl_comm.hooks import make_hook

    warnings.simplefilter("ignore")
    cfg = CompressionConfig(
        gradient_compression="int8", compression_rank=2, start_iter=1, bucket_cap_mb=0.002
    )

    def build():
        torch.manual_seed(0)
        model = ScalarNet()
        del model.rank0_only, model.never_used
        hook, state = make_hook(cfg)
        red = BucketedReducer(model, hook, state, bucket_cap_mb=0.002, first_bucket_cap_mb=None)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), red

    def train(model, opt, red, steps):
        for step in steps:
            x, y = _batch(rank, step)
            _loss(model, x, y, rank).backward()
            red.finalize()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model, opt, red = build()
    train(model, opt, red, range(4))
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, opt, red = build()
    train(model, opt, red, range(2))
    buf = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": red.state.state_dict(),
         "reducer": red.state_dict()},
        buf,
    )  # fmt: skip
    red.remove()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model, opt, red = build()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    red.load_state_dict(ckpt["reducer"])
    red.state.load_state_dict(ckpt["hook"])
    train(model, opt, red, range(2, 4))
    out["identical"] = all(torch.equal(p, straight[n]) for n, p in model.named_parameters())
    out["ef_bytes"] = red.state.ef_state_nbytes()


def scenario_overlap(rank: int, world: int, out: dict) -> None:
    """Many small buckets: the first launch must come before the last gradient."""
    from verl_comm.telemetry import CommRecorder

    recorder = CommRecorder()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    red = BucketedReducer(
        model,
        default_hooks.allreduce_hook,
        None,
        bucket_cap_mb=0.004,
        first_bucket_cap_mb=None,
        trace=True,
        recorder=recorder,
    )
    for step in range(2):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank + 10 * step))
        model(x).square().mean().backward()
        red.finalize()
        model.zero_grad(set_to_none=True)
    out["records"] = [r.to_dict() for r in recorder.records]
    out["events"] = list(red.events)
    out["launched_in_backward"] = red.launched_in_backward
    out["num_buckets"] = len(red.buckets)


def scenario_accumulation(rank: int, world: int, out: dict) -> None:
    """Two micro-batches: no_sync on the first; one reduction of the summed grads."""
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    red = BucketedReducer(model, counting_hook, None)
    local = []
    for micro in range(2):
        x, y = _batch(rank, micro)
        ctx = red.no_sync() if micro == 0 else _null()
        with ctx:
            ((model(x) - y) ** 2).mean().backward()
            if micro == 0:
                out["first_finalize"] = red.finalize()
                local.append(_grads(model))
    out["calls_after_micro"] = len(calls)
    out["second_finalize"] = red.finalize()
    out["calls"] = len(calls)
    out["reduced"] = _grads(model)
    # local sum over both micro-batches, recomputed without any hook
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    for micro in range(2):
        x, y = _batch(rank, micro)
        ((plain(x) - y) ** 2).mean().backward()
    out["local_sum"] = _grads(plain)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def scenario_timeout(rank: int, world: int, out: dict) -> None:
    """A hook whose future never completes: finalize raises TimeoutError."""
    model = torch.nn.Linear(4, 2)
    red = BucketedReducer(model, lambda state, bucket: torch.futures.Future(), None, timeout_s=0.3)
    model(torch.randn(3, 4)).sum().backward()
    try:
        red.finalize()
        out["error"] = None
    except TimeoutError as exc:
        out["error"] = str(exc)


SCENARIOS = {
    "vs_ddp_allreduce": lambda r, w, o: scenario_vs_ddp(r, w, "allreduce", o),
    "vs_ddp_fp16": lambda r, w, o: scenario_vs_ddp(r, w, "fp16", o),
    "vs_ddp_ours": scenario_vs_ddp_ours,
    "resume": scenario_resume,
    "overlap": scenario_overlap,
    "accumulation": scenario_accumulation,
    "timeout": scenario_timeout,
}


def _worker(rank: int, world: int, scenario: str) -> dict:
    """One rank (in a gloo group with a 60 s timeout made by ``spawn``): the results of the
    comma-separated ``scenario`` names of :data:`SCENARIOS`."""
    out: dict = {}
    for name in scenario.split(","):
        out[name] = {}
        SCENARIOS[name](rank, world, out[name])
    return out


def _on_ranks(scenario: str, world: int = 2, timeout: float = 120) -> list[dict]:
    """Every rank's :func:`_worker` results; a rank's failure is raised with its traceback."""
    return spawn(_worker, world, (scenario,), timeout_s=60, deadline_s=timeout,
                 env={"OMP_NUM_THREADS": "1"})  # fmt: skip


# --------------------------------------------------------- distributed tests
@pytest.fixture(scope="module")
def results():
    """All 2-rank scenarios in one launch (process start-up dominates on CPU)."""
    names = ",".join(SCENARIOS)  # "timeout" last: it leaves a future pending
    res = _on_ranks(names, timeout=240)
    return {name: [r[name] for r in res] for name in SCENARIOS}


def _assert_grads_close(a, b, rtol, atol, where):
    assert a.keys() == b.keys()
    for name in a:
        if a[name] is None or b[name] is None:
            assert a[name] is None and b[name] is None, f"{where}: {name} grad None mismatch"
            continue
        torch.testing.assert_close(b[name], a[name], rtol=rtol, atol=atol, msg=f"{where} {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hook", ["allreduce", "fp16"])
def test_reducer_matches_ddp(results, hook):
    res = results[f"vs_ddp_{hook}"]
    rtol, atol = (1e-5, 1e-7) if hook == "allreduce" else (1e-3, 1e-6)
    for r, out in enumerate(res):
        for step, (ref, mine) in enumerate(zip(out["ddp"], out["mine"])):
            _assert_grads_close(ref, mine, rtol, atol, f"rank {r} step {step}")
            assert mine["frozen.weight"] is None
            assert mine["never_used.weight"] is None  # unused on every rank: no update
            if hook == "allreduce":
                assert mine["rank0_only.weight"] is not None  # used on rank 0 only
        assert out["buckets"][0] > 1  # several buckets, rebuilt after step 0
    for name, p in res[0]["params"].items():
        assert torch.equal(p, res[1]["params"][name]), f"replicas differ at {name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hook", ["int8", "lowrank"])
def test_reducer_matches_ddp_with_verl_comm_hooks(results, hook):
    for r, out in enumerate(results["vs_ddp_ours"]):
        o = out[hook]
        assert o["buckets"] > 1
        want = "int8" if hook == "int8" else "lowrank_int8"
        assert o["methods"][0] == ["allreduce"] and want in o["methods"][-1], o["methods"]
        for step, (ref, mine) in enumerate(zip(o["ddp"], o["mine"])):
            _assert_grads_close(ref, mine, 1e-5, 1e-7, f"{hook} rank {r} step {step}")
    a, b = (res["vs_ddp_ours"][hook]["mine"][-1] for res in _by_rank(results))
    for name in a:  # replicas bit-identical
        assert (a[name] is None and b[name] is None) or torch.equal(a[name], b[name]), name


@pytest.mark.timeout(300)
def test_reducer_matches_ddp_world_size_3():
    """Odd world size; bucket sizes not multiples of W x quant_block."""
    res = _on_ranks("vs_ddp_ours", world=3, timeout=240)
    for r, out in enumerate(res):
        for hook in ("int8", "lowrank"):
            o = out["vs_ddp_ours"][hook]
            for step, (ref, mine) in enumerate(zip(o["ddp"], o["mine"])):
                _assert_grads_close(ref, mine, 1e-5, 1e-7, f"W=3 {hook} rank {r} step {step}")
    last = [out["vs_ddp_ours"]["int8"]["mine"][-1] for out in res]
    for name, g in last[0].items():
        if g is None:  # the frozen layer
            assert all(other[name] is None for other in last[1:]), name
        else:
            assert all(torch.equal(g, other[name]) for other in last[1:]), name


def _by_rank(results):
    return [{k: v[r] for k, v in results.items()} for r in range(2)]


@pytest.mark.timeout(300)
def test_reducer_checkpoint_resumes_bit_identically(results):
    for out in results["resume"]:
        assert out["ef_bytes"] > 0  # error feedback was in play
        assert out["identical"]


@pytest.mark.timeout(300)
def test_reducer_overlaps_backward(results):
    res = results["overlap"]
    for out in res:
        ev = out["events"]
        kinds = [k for k, _ in ev]
        first_launch = kinds.index("launch")
        last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
        assert out["num_buckets"] >= 3
        assert first_launch < last_ready, ev  # communication started during backward
        assert out["launched_in_backward"] == out["num_buckets"]
        recs = out["records"]
        assert len(recs) == 2 * out["num_buckets"]  # one per bucket and step
        assert {r["op"] for r in recs} == {"bucket_reduce"} and all(
            r["group_size"] == 2 for r in recs
        )
        last = recs[-out["num_buckets"] :]
        assert sum(r["nbytes"] for r in last) == 6 * (32 * 32 + 32) * 4  # the whole model, fp32
        assert all(r["extra"]["launched_in_backward"] == 1.0 for r in last)
        assert kinds[-1] == "finalize"


@pytest.mark.timeout(300)
def test_reducer_accumulation_reduces_on_boundary_only(results):
    res = results["accumulation"]
    for out in res:
        assert out["first_finalize"] is False and out["second_finalize"] is True
        assert out["calls_after_micro"] == 1 and out["calls"] == 1  # one bucket, one launch
    for name in res[0]["reduced"]:
        mean = (res[0]["local_sum"][name] + res[1]["local_sum"][name]) / 2
        for out in res:
            torch.testing.assert_close(out["reduced"][name], mean, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(300)
def test_reducer_timeout_is_an_error(results):
    res = results["timeout"]
    for out in res:
        assert out["error"] is not None and "not reduced after" in out["error"]
