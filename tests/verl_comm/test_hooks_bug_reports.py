"""Inputs from public bug reports (issue 28), each on 2 gloo ranks through the public API.

* ``model.half()`` with the int8 hook and the default ``residual_dtype`` (and the bucketed
  reducer with ``grad_dtype=None``): used to raise "residual must be torch.float16";
* a bucket of an fp16 and an fp32 gradient (``GradBucket.from_tensors``): used to cast the
  fp32 gradients to fp16 (1e-8 lost, 1e5 -> Inf blamed on the loss scale);
* low rank with ``find_unused_parameters=True``: a parameter unused on every rank for one
  step used to get a zero warm-start Q and never update again;
* statistics on (``stats_every=1``) and off give bit-identical gradients (statistics only
  read the bucket, so bit equality is the property).

All scenarios run in one launch of 2 ranks (``verl_comm.distributed.launch.spawn``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from verl_comm.compression import CompressionConfig
from verl_comm.distributed.launch import spawn

INT8_STEP = 1.0 / 127  # one int8 step of a block's absmax (two half steps: rank + owner)


def _cfg(**kw) -> CompressionConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # low ranks are asked for
        return CompressionConfig(**kw)


def _exact_average(local: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for g in local:
        t = g.detach().double().clone()
        dist.all_reduce(t)
        out.append(t / dist.get_world_size())
    return out


def _net(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8)).to(
        dtype
    )


def _x(rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)


def _local_grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _int8_error(got: list[torch.Tensor], exact: list[torch.Tensor]) -> tuple[float, float]:
    """Max abs error against the bound: one int8 step of the largest |average| plus fp16
    rounding of it (the bucket holds fp16)."""
    err = max(float((g.double() - e).abs().max()) for g, e in zip(got, exact))
    amax = max(float(e.abs().max()) for e in exact)
    return err, amax * (INT8_STEP + 2**-10) * 2  # x2: per-rank absmax can exceed the mean's


def scenario_half_int8(rank: int, world: int) -> dict:
    """model.half() + int8 hook (default residual dtype) via DDP, and via the reducer."""
    from verl_comm.hooks import register_comm_hook
    from verl_comm.reducer import make_reducer

    out = {}
    ref = _net(torch.float16)
    for api in ("ddp", "reducer"):
        model = _net(torch.float16)
        cfg = _cfg(gradient_compression="int8", quant_block=32)
        if api == "ddp":
            wrapped = DDP(model)
            state = register_comm_hook(wrapped, cfg)
        else:
            wrapped = model
            red = make_reducer(model, cfg)  # grad_dtype=None: fp16 buckets
            state = red.state
        errs = []
        for step in range(3):  # 0: plain all-reduce (start_iter 1), 1: first int8, 2: int8
            x = _x(rank, step, torch.float16)
            exact = _exact_average(_local_grads(ref, x))
            model.zero_grad(set_to_none=True)
            wrapped(x).float().square().mean().backward()
            if api == "reducer":
                red.finalize()
            if step == 1:  # first compressed step: residual still zero, so the bound holds
                errs.append(_int8_error([p.grad for p in model.parameters()], exact))
        out[api] = {
            "methods": sorted({s.method for s in state.last_stats.values()}),
            "residual_dtypes": sorted(str(b.residual.dtype) for b in state.buckets.values()),
            "err": errs,
            "finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
        }
        if api == "reducer":
            red.remove()
        state.close()
        del wrapped
    return out


def scenario_mixed_bucket(rank: int, world: int) -> dict:
    """One bucket of an fp16 and an fp32 gradient (1e-8 and 1e5 in fp32), through the
    plain and the int8 hook on the 2-rank group."""
    from verl_comm.hooks import CommHookState, GradBucket, allreduce_hook, int8_hook

    g16 = torch.full((64,), 0.5 + rank, dtype=torch.float16)
    g32 = torch.cat([torch.full((64,), 1e-8 * (rank + 1)), torch.full((64,), 1e5 * (rank + 1))])
    exact = torch.cat([torch.full((64,), 1.0), torch.full((64,), 1.5e-8), torch.full((64,), 1.5e5)])
    out = {}
    for name, hook in (("allreduce", allreduce_hook), ("int8", int8_hook)):
        state = CommHookState(config=_cfg(gradient_compression="int8", quant_block=32))
        results = []
        for _ in range(2):  # iteration 0: plain all-reduce, 1: int8
            b = GradBucket.from_tensors([g16, g32])
            results.append(hook(state, b).wait().clone())
        state.close()
        out[name] = {"dtype": str(results[-1].dtype), "results": results, "exact": exact}
    return out


class _Unused(torch.nn.Module):
    """``b`` is skipped on the steps listed in ``skip`` (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.skip_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return h if self.skip_b else self.b(h)


def scenario_lowrank_unused(rank: int, world: int) -> dict:
    """Low rank r2, find_unused_parameters=True, ``b`` unused on every rank at step 3."""
    from verl_comm.hooks import register_comm_hook

    model = _Unused()
    ddp = DDP(model, find_unused_parameters=True)
    state = register_comm_hook(ddp, _cfg(gradient_compression="int8", compression_rank=2))
    norms = []
    for step in range(7):
        model.skip_b = step == 3
        g = torch.Generator().manual_seed(10 * step + rank)
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(32, 16, generator=g)).square().mean().backward()
        w = model.b.weight.grad
        norms.append(None if w is None else float(w.norm()))
    state.close()
    del ddp
    return {"b_grad_norms": norms}


def scenario_stats_on_off(rank: int, world: int) -> dict:
    """The same training through register_comm_hook with stats_every=1 and with the
    defaults: gradients compared bit for bit every step."""
    from verl_comm.hooks import register_comm_hook

    out = {}
    for fields in (dict(gradient_compression="int8"), dict(gradient_compression="int8",
                                                           compression_rank=4)):  # fmt: skip
        grads = {}
        for every in (0, 1):
            model = _net()
            ddp = DDP(model)
            state = register_comm_hook(ddp, _cfg(stats_every=every, **fields))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            seq, rel = [], []
            for step in range(4):
                opt.zero_grad(set_to_none=True)
                ddp(_x(rank, step, torch.float32)).square().mean().backward()
                seq.append([p.grad.clone() for p in model.parameters()])
                rel.append(state.metrics().get("comm/rel_error"))
                opt.step()
            grads[every] = (seq, rel)
            state.close()
            del ddp
        out[str(fields)] = grads
    return out


def run_all(rank: int, world: int) -> dict:
    """Every scenario of this module on one rank (one launch for all)."""
    torch.set_num_threads(1)
    return {
        "half_int8": scenario_half_int8(rank, world),
        "mixed_bucket": scenario_mixed_bucket(rank, world),
        "lowrank_unused": scenario_lowrank_unused(rank, world),
        "stats_on_off": scenario_stats_on_off(rank, world),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return spawn(f"{Path(__file__).resolve()}:run_all", 2, timeout_s=240)


@pytest.mark.timeout(400)
def test_half_model_int8_default_residual(results):
    for r in results:
        for api in ("ddp", "reducer"):
            got = r["half_int8"][api]
            assert got["methods"] == ["int8"] and got["finite"], (api, got)
            assert got["residual_dtypes"] and set(got["residual_dtypes"]) == {"torch.float16"}
            for err, bound in got["err"]:
                assert err <= bound, (api, err, bound)


@pytest.mark.timeout(400)
def test_mixed_dtype_bucket_keeps_fp32_precision(results):
    for r in results:
        for name, got in r["mixed_bucket"].items():
            assert got["dtype"] == "torch.float32", name  # promoted, never cast down
            exact = got["exact"]
            plain = got["results"][0]  # iteration 0 is a plain fp32 all-reduce: exact
            torch.testing.assert_close(plain, exact, rtol=1e-6, atol=0)
            last = got["results"][-1]
            assert torch.isfinite(last).all(), name
            if name == "allreduce":
                torch.testing.assert_close(last, exact, rtol=1e-6, atol=0)
            else:  # int8: within one step of each 32-element block's absmax
                blocks = exact.view(-1, 32).abs().amax(1, keepdim=True)
                err = (last - exact).view(-1, 32).abs()
                assert (err <= blocks * INT8_STEP).all(), name


@pytest.mark.timeout(400)
def test_lowrank_parameter_updates_again_after_unused_step(results):
    for r in results:
        norms = r["lowrank_unused"]["b_grad_norms"]
        assert norms[3] is None, norms  # unused everywhere: DDP leaves grad None
        for step in (4, 5, 6):
            assert norms[step] is not None and norms[step] > 0, norms


@pytest.mark.timeout(400)
def test_statistics_on_and_off_same_gradients(results):
    for r in results:
        for fields, grads in r["stats_on_off"].items():
            (off, rel_off), (on, rel_on) = grads[0], grads[1]
            assert all(v is None for v in rel_off), rel_off  # off by default
            assert all(v is not None for v in rel_on[1:]), rel_on  # 0: plain all-reduce
            for step, (a, b) in enumerate(zip(off, on)):
                for x, y in zip(a, b):
                    assert torch.equal(x, y), (fields, step)


# -- save at step 10, kill -9 at step 12, resume from step 10 -------------------------------


class _Layers(torch.nn.Module):
    """Several parameters in several buckets; ``late`` is registered first but used last,
    so a fresh DDP's first bucket layout differs from the one it rebuilds to."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.late = torch.nn.Linear(24, 8)
        self.early = torch.nn.Linear(16, 24)
        self.mid = torch.nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(torch.tanh(self.mid(torch.tanh(self.early(x)))))


def _resume_setup(method_fields: dict):
    from verl_comm.hooks import register_comm_hook

    model = _Layers()
    cfg = _cfg(bucket_cap_mb=0.004, **method_fields)
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = register_comm_hook(ddp, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, opt


def _train_step(ddp, opt, rank: int, step: int) -> bytes:
    g = torch.Generator().manual_seed(1000 * step + rank)
    opt.zero_grad(set_to_none=True)
    ddp(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()
    return b"".join(p.detach().numpy().tobytes() for p in ddp.module.parameters())


def run_crash(rank: int, world: int, tmp: str, fields: dict) -> None:
    """Steps 1-12: save everything after step 10, SIGKILL this process during step 12."""
    import os
    import signal

    model, ddp, state, opt = _resume_setup(fields)
    for step in range(1, 13):
        if step == 12:
            os.kill(os.getpid(), signal.SIGKILL)
        _train_step(ddp, opt, rank, step)
        if step == 10:
            ck = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
            torch.save(ck, Path(tmp) / f"step10_rank{rank}.pt")


def run_compare(rank: int, world: int, tmp: str, fields: dict) -> dict:
    """An uninterrupted run of steps 1-20, then a fresh DDP resumed from the step-10 files."""
    model, ddp, state, opt = _resume_setup(fields)
    straight = [_train_step(ddp, opt, rank, step) for step in range(1, 21)]
    state.close()
    del ddp
    model, ddp, state, opt = _resume_setup(fields)
    ck = torch.load(Path(tmp) / f"step10_rank{rank}.pt", weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
    resumed, paths = [], []
    for step in range(11, 21):
        resumed.append(_train_step(ddp, opt, rank, step))
        paths.append(sorted({s.method for s in state.last_stats.values()}))
    state.close()
    del ddp
    return {"straight": straight[10:], "resumed": resumed, "paths": paths}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "fields",
    [dict(gradient_compression="int8"), dict(gradient_compression="int8", compression_rank=2)],
)
def test_resume_after_kill_is_bit_identical(tmp_path, fields):
    """Bit equality is the documented property of ``state_dict()`` (same CPU, same process
    count): the resumed steps 11-20 equal the uninterrupted run's, step 11 compressed."""
    here = Path(__file__).resolve()
    with pytest.raises(RuntimeError):  # the ranks were killed at step 12
        spawn(f"{here}:run_crash", 2, (str(tmp_path), fields), timeout_s=120)
    assert (tmp_path / "step10_rank0.pt").exists() and (tmp_path / "step10_rank1.pt").exists()
    for r in spawn(f"{here}:run_compare", 2, (str(tmp_path), fields), timeout_s=200):
        want = ["lowrank_int8" if "compression_rank" in fields else "int8"]
        assert r["paths"][0] == want, r["paths"]  # step 11 compresses, as uninterrupted
        for step, (a, b) in enumerate(zip(r["straight"], r["resumed"]), start=11):
            assert a == b, f"step {step} differs from the uninterrupted run"
