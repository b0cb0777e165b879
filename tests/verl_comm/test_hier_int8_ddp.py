"""Hierarchical int8 through the public API: 4 gloo ranks told apart as 2 hosts x 2 ranks
by torchrun's GROUP_RANK, DDP with ``register_comm_hook`` (``CompressionConfig.hierarchical``
auto and off), all in one launch (``verl_comm.distributed.launch.spawn``)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from verl_comm.distributed.launch import spawn

STEPS = 4  # 0: plain all-reduce (start_iter 1), 1-3: int8


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))


def run_all(rank: int, world: int) -> dict:
    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import register_comm_hook

    os.environ["GROUP_RANK"] = str(rank // 2)  # as torchrun --nnodes=2 with 2 ranks each
    out = {}
    for mode in ("auto", "off"):
        model = _net()
        ddp = DDP(model, bucket_cap_mb=0.01)  # a few buckets: lanes open
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = CompressionConfig(gradient_compression="int8", quant_block=32, hierarchical=mode)
        state = register_comm_hook(ddp, cfg)
        grads, errs = [], []
        for step in range(STEPS):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
            ddp.zero_grad(set_to_none=True)
            ddp(x).square().mean().backward()
            got = [p.grad.detach().clone() for p in model.parameters()]
            local = _local(x)
            exact = []
            for g in local:
                t = g.double()
                dist.all_reduce(t)
                exact.append(t / world)
            amax = max(float(e.abs().max()) for e in exact)
            err = max(float((g.double() - e).abs().max()) for g, e in zip(got, exact))
            errs.append((err, amax))
            grads.append(got)
        state.flush()
        out[mode] = {
            "hier": state.collective.hierarchy is not None,
            "lanes": [c.hierarchy is not None for c in state.worker()._colls[1:]],
            "methods": sorted({s.method for s in state.last_stats.values()}),
            "grads": grads,
            "errs": errs,
            "residuals": [(b.signature[0], b.residual.numel()) for b in state.buckets.values()],
        }
        state.close()
    return out


def _local(x: torch.Tensor) -> list[torch.Tensor]:
    ref = _net()
    ref(x).square().mean().backward()
    return [p.grad.detach() for p in ref.parameters()]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(f"{Path(__file__).resolve()}:run_all", 4, timeout_s=240)


def test_two_hosts_use_the_hierarchy_and_off_does_not(results):
    for r in results:
        assert r["auto"]["hier"] and not r["off"]["hier"]
        assert len(r["auto"]["lanes"]) == 3 and all(r["auto"]["lanes"])  # the worker's lanes
        assert not any(r["off"]["lanes"])
        assert r["auto"]["methods"] == r["off"]["methods"] == ["int8"]
        # error feedback: the bucket's residual, plus (hierarchical) this rank's chunk of
        # its host's average: N / L elements padded to whole blocks (quant_block 32, 2 x 2)
        assert r["auto"]["residuals"] and r["off"]["residuals"]
        assert all(k == n + -(-n // 128) * 128 // 2 for n, k in r["auto"]["residuals"])
        assert all(k == n for n, k in r["off"]["residuals"])


def test_gradients_identical_on_every_rank_and_within_int8_error(results):
    for mode in ("auto", "off"):
        for step in range(STEPS):
            ref = results[0][mode]["grads"][step]
            for r in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(ref, r[mode]["grads"][step]))
        # step 1: the first int8 step (residuals still zero); two half steps of an int8
        # block whose absmax is at most W x the largest |average| (one rank's sum dominates)
        err, amax = results[0][mode]["errs"][1]
        assert 0 < err <= 4 * amax / 127
    # the plain step is exact up to the order of a fp32 sum
    err0, amax0 = results[0]["auto"]["errs"][0]
    assert err0 <= amax0 * 4 * 2**-23
