"""Loading a hook state (same or other world size) and DDP's own mixed precision.

One-process tests drive the hooks with stand-alone buckets (W = 1); the multi-process test
saves a state on 2 gloo ranks and loads it into a fresh 3-rank DDP whose bucket layout
changes at DDP's bucket rebuild (parameters registered in another order than their
gradients become ready), as after a real resize.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from verl_comm.compression import CompressionConfig
from verl_comm.distributed.launch import spawn
from verl_comm.hooks import CommHookState, GradBucket, int8_hook

SHAPES = [(24, 16), (24,), (24, 24), (24,), (8, 24), (8,)]


def _cfg(**kw) -> CompressionConfig:
    base = dict(gradient_compression="int8", start_iter=2, quant_block=32)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CompressionConfig(**base)


def _bucket(seed: int, shapes=SHAPES) -> GradBucket:
    ps = [torch.zeros(s) for s in shapes]
    g = torch.Generator().manual_seed(seed)
    return GradBucket(0, ps, buffer=torch.randn(sum(p.numel() for p in ps), generator=g))


def _trained(steps: int = 4) -> CommHookState:
    a = CommHookState(config=_cfg())
    for it in range(steps):
        int8_hook(a, _bucket(it))
    assert a.last_stats[0].method == "int8" and a.buckets[0].residual.abs().sum() > 0
    return a


def test_layout_change_warning_names_what_changed():
    a = _trained()
    swapped = SHAPES[2:4] + SHAPES[:2] + SHAPES[4:]  # same numel and dtype, other order
    with pytest.warns(RuntimeWarning, match="bucket 0 changed") as rec:
        int8_hook(a, _bucket(9, swapped))
    msg = str(rec[0].message)
    assert "parameter 0 of 6: shape (24, 16) -> (24, 24)" in msg, msg
    assert "numel" not in msg and "dtype" not in msg  # only what changed


def test_load_other_world_size_waits_start_iter_steps():
    sd = _trained().state_dict()
    sd["world_size"] = 2
    b = CommHookState(config=_cfg())
    with pytest.warns(RuntimeWarning, match="world size 2, now 1.*iterations 4-5 use a plain"):
        b.load_state_dict(sd)
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for it in range(4, 8):
            int8_hook(b, _bucket(it))
            paths.append(b.last_stats[0].method)
    assert paths == ["allreduce", "allreduce", "int8", "int8"]


def test_load_same_world_size_keeps_state_until_layout_matches():
    sd = _trained().state_dict()
    loaded = sd["buckets"][0]["residual"].clone()
    b = CommHookState(config=_cfg())
    b.load_state_dict(sd)
    swapped = SHAPES[2:4] + SHAPES[:2] + SHAPES[4:]  # a fresh DDP's pre-rebuild layout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        int8_hook(b, _bucket(4, swapped))
        assert b.last_stats[0].method == "allreduce"
        assert torch.equal(b.buckets[0].residual, loaded)  # kept for the rebuilt layout
        int8_hook(b, _bucket(5))  # the saved layout again: compress with the loaded residual
    assert b.last_stats[0].method == "int8"
    assert not torch.equal(b.buckets[0].residual, loaded)


# -- multi-process: real DDP on gloo -------------------------------------------------------


def _spawn(world: int, phase: str, tmp: Path) -> list[dict]:
    return spawn(_worker, world, (phase, tmp), timeout_s=120, deadline_s=180,
                 env={"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})  # fmt: skip


@pytest.fixture(scope="module")
def resized(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """4 steps on 2 ranks (state saved at iteration 4), then 4 steps of a fresh 3-rank DDP."""
    tmp = tmp_path_factory.mktemp("resize")
    return _spawn(2, "save", tmp), _spawn(3, "load", tmp)


@pytest.mark.timeout(400)
def test_resized_ddp_compresses_only_after_bucket_rebuild(resized):
    saved, loaded = resized
    for r in saved:
        assert [m for _, m, _ in r["log"]] == ["allreduce", "allreduce", "int8", "int8"]
    for r in loaded:
        assert any("world size 2, now 3" in w for w in r["load_warnings"]), r["load_warnings"]
        assert r["step_warnings"] == []  # no second, contentless warning at the rebuild
        assert [it for it, _, _ in r["log"]] == [4, 5, 6, 7]
        for it, method, rebuilt in r["log"]:
            assert method == "allreduce" or rebuilt, (it, method)  # never before the rebuild
        assert r["log"][-1][1] == "int8"


@pytest.mark.timeout(400)
def test_register_refuses_ddp_mixed_precision(resized):
    for r in resized[0]:
        kind, msg = r["mixed_precision_error"]
        assert kind == "ValueError", msg
        assert "mixed_precision" in msg and "torch.autocast" in msg and "bf16" in msg, msg


class Swapped(torch.nn.Module):
    """``late`` is registered first but used last: DDP's initial buckets (reverse
    registration order) differ from the rebuilt ones (gradient-ready order)."""

    def __init__(self) -> None:
        super().__init__()
        self.late = torch.nn.Linear(24, 8)
        self.early = torch.nn.Linear(16, 24)
        self.mid = torch.nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.tanh(self.mid(torch.tanh(self.early(x)))))


def _worker(rank: int, world: int, phase: str, tmp: Path) -> dict:
    """One rank of ``phase`` ("save" or "load") in the gloo group ``spawn`` made."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verl_comm.hooks import register_comm_hook

    out: dict = {}
    torch.manual_seed(0)
    model = Swapped()
    ddp = DDP(model)  # find_unused_parameters=False: DDP rebuilds its buckets
    state = register_comm_hook(ddp, _cfg(bucket_cap_mb=25))
    log: list[tuple[int, str, bool]] = []
    steps = range(0, 4)
    if phase == "load":
        ck = torch.load(tmp / f"ckpt_rank{rank % 2}.pt", weights_only=False)
        model.load_state_dict(ck["model"])
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            state.load_state_dict(ck["hook"])
        out["load_warnings"] = [str(w.message) for w in rec]
        steps = range(4, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in steps:
            g = torch.Generator().manual_seed(100 * step + rank)
            loss = ddp(torch.randn(8, 16, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            log += [
                (s.iteration, s.method, ddp._has_rebuilt_buckets) for s in state.last_stats.values()
            ]
    out["step_warnings"] = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    out["log"] = log
    if phase == "save":
        torch.save(
            {"model": model.state_dict(), "hook": state.state_dict()}, tmp / f"ckpt_rank{rank}.pt"
        )
        from torch.nn.parallel.distributed import _MixedPrecision

        mp = DDP(Swapped(), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
        try:
            register_comm_hook(mp, _cfg())
            out["mixed_precision_error"] = None
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            out["mixed_precision_error"] = (type(e).__name__, str(e))
        del mp
    del ddp, model
    import gc

    gc.collect()
    dist.barrier()
    return out
