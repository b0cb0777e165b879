"""GPU only (skipped without CUDA): a DDP step with each verl_comm hook, and a step through
the bucketed reducer, make no host synchronisation (issue 14).

``torch.cuda.set_sync_debug_mode("error")`` turns every synchronising CUDA call (stream or
device synchronise, blocking copies, ``.item()``) into an exception. One NCCL rank (W = 1):
the hooks run their full compress and decompress chain, the collectives are trivial.
Warm-up steps first (start_iter, the one-time link measurement and policy decision are
allowed to synchronise); the step under test is a steady one.
"""

from __future__ import annotations

import datetime
import socket
import warnings

import pytest
import torch

from tests._models import mlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

METHODS = {
    "bf16": {"gradient_compression": "bf16"},
    "fp16": {"gradient_compression": "fp16"},
    "none": {},
    "int8": {"gradient_compression": "int8"},
    "lowrank_int8": {"gradient_compression": "int8", "compression_rank": 16},
    "auto": {"gradient_compression": "int8", "compression_rank": 16, "policy": "auto"},
}


@pytest.fixture(scope="module")
def nccl_one_rank():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        device_id=dev,
    )
    yield dev
    dist.destroy_process_group()


def _cfg(fields):
    from verl_comm.compression import CompressionConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CompressionConfig(bucket_cap_mb=1.0, **fields)


def _trainer(dev, fields, reducer, lr):
    """``(step(x, before_update=None), module, state)``: SGD on a 5-layer MLP (512 wide, 8 out) through DDP
    with our hook, or through the bucketed reducer."""
    from verl_comm.hooks import make_hook
    from verl_comm.reducer import BucketedReducer

    module = mlp(512, 512, 512, 512, 512, 8).to(dev)
    hook, state = make_hook(_cfg(fields))
    red = None
    if reducer:
        red = BucketedReducer(module, hook, state, bucket_cap_mb=1.0)
        model = module
    else:
        model = torch.nn.parallel.DistributedDataParallel(module, device_ids=[0], bucket_cap_mb=1.0)
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(module.parameters(), lr=lr)

    def step(x, before_update=None):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        if red is not None:
            red.finalize()
        if before_update is not None:
            before_update()
        opt.step()

    return step, module, state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reducer", [False, True], ids=["ddp", "reducer"])
@pytest.mark.parametrize("method", list(METHODS))
def test_step_without_host_sync(nccl_one_rank, method, reducer):
    dev = nccl_one_rank
    step, _, state = _trainer(dev, METHODS[method], reducer, lr=1e-3)
    x = torch.randn(64, 512, device=dev)
    for _ in range(4):
        step(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x)
        step(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    state.flush()  # the explicit sync: resolves the last steps' statistics
    want = "allreduce" if method in ("none", "auto") else method
    assert {s.method for s in state.last_stats.values()} == {want}
    assert all(s.finite for s in state.last_stats.values())
    assert state.iteration == 6


def _run_steps(dev, fields, steps, reducer=False, nan_at=None):
    """Per step the reduced gradients (cloned) of a DDP (or reducer) run; and the state."""
    step, module, state = _trainer(dev, fields, reducer, lr=1e-2)
    gen = torch.Generator(device=dev).manual_seed(1)
    grads = []
    for k in range(steps):
        x = torch.randn(64, 512, device=dev, generator=gen)
        if nan_at == k:
            x[0, 0] = float("nan")
        step(x, lambda: grads.append([p.grad.detach().clone() for p in module.parameters()]))
    return grads, state


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reducer", [False, True], ids=["ddp", "reducer"])
@pytest.mark.parametrize("method", ["bf16", "int8", "lowrank_int8"])
def test_cuda_graph_replay_matches_eager(nccl_one_rank, method, reducer):
    """A bucket's chain replayed as a CUDA graph (verl_comm.hooks.graphs) gives the eager
    chain's gradients at every step, error feedback and warm-start Q included."""
    dev = nccl_one_rank
    fields = METHODS[method]
    eager, st_e = _run_steps(dev, {**fields, "cuda_graph": False}, 7, reducer)
    graph, st_g = _run_steps(dev, {**fields, "cuda_graph": True}, 7, reducer)
    st_e.flush()
    st_g.flush()
    assert all(b.graph is None for b in st_e.buckets.values())
    captured = [b for b in st_g.buckets.values() if b.graph is not None]
    assert captured and len(captured) == len(st_g.buckets), "every bucket replays a graph"
    assert all(b.graph_captures <= 2 for b in st_g.buckets.values())
    for k, (ge, gg) in enumerate(zip(eager, graph)):
        for a, b in zip(ge, gg):
            err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
            assert err <= 1e-5, f"step {k}: graph vs eager gradient differs by {err:.2e}"
    assert {s.method for s in st_g.last_stats.values()} == {method}
    assert st_g.metrics()["comm/wire_bytes"] == st_e.metrics()["comm/wire_bytes"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["none", "bf16", "int8", "lowrank_int8"])
def test_cuda_graph_nonfinite_still_raises(nccl_one_rank, method):
    """The finiteness flag written by a replayed graph reaches the non-finite policy."""
    from verl_comm.hooks import NonFiniteGradientError

    dev = nccl_one_rank
    with pytest.raises(NonFiniteGradientError):
        _, st = _run_steps(dev, METHODS[method], 7, nan_at=5)
        st.flush()
