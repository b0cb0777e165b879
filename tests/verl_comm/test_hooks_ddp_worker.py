"""Worker processes for the multi-process hook tests (gloo, CPU); not a test module itself.

``spawn_session(world, scenarios, out_dir)`` runs :func:`run_session` on W ranks through the
library launcher (:func:`verl_comm.distributed.launch.spawn`); each rank joins a gloo group,
runs the named scenarios in order and returns a dict of plain results. Test files load this
module by path and assert on the results. Everything has a timeout: the process group (60 s),
the ranks (caller's).
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from verl_comm.distributed.launch import spawn

HERE = Path(__file__).resolve()


# -- launcher (runs in the pytest process) -------------------------------------------------


def spawn_session(
    world: int,
    scenarios: list[str],
    out_dir: Path,
    timeout_s: float = 240.0,
    script: Path = HERE,
) -> list[dict]:
    """Run ``scenarios`` (``name:key=value,...`` specs of ``script``'s ``SCENARIOS``) on
    ``world`` gloo ranks through the library launcher; return the per-rank result dicts.

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or ``timeout_s``
            passed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONHASHSEED": "0"}
    return spawn(run_session, world, (str(script), scenarios, str(out_dir)), timeout_s=60,
                 deadline_s=timeout_s, env=env)  # fmt: skip


# -- model and data ------------------------------------------------------------------------


class Net(nn.Module):
    """Hard-case model: a 0-dim gain, 1-dim biases, three same-shape matrices, a matrix
    too small for low rank, odd sizes (not multiples of W x B), a frozen layer used in the
    forward and a layer never used (needs find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(33, 48)
        self.blocks = nn.ModuleList([nn.Linear(48, 48, bias=False) for _ in range(3)])
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.frozen = nn.Linear(48, 48)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(48, 48)
        self.out = nn.Linear(48, 5)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b(h)) + h
        h = self.frozen(h * self.gain)
        return self.out(h)


def batch(step: int, rank: int, dtype: torch.dtype = torch.float32, n: int = 16):
    """Deterministic (x, y) of this rank and step (different data per rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 33, generator=g).to(dtype), torch.randn(n, 5, generator=g).to(dtype)


def param_hash(model: nn.Module) -> str:
    """sha256 over the bytes of all parameters (bit-identity across ranks)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """all_gather of equal-shape tensors (fp32 transport for 16-bit dtypes)."""
    t32 = t.detach().float().contiguous()
    out = [torch.empty_like(t32) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t32)
    return out


# -- float64 references of the algorithms --------------------------------------------------


def sim_int8_allreduce(xs: list[torch.Tensor], block: int) -> torch.Tensor:
    """float64 simulation of the two-step int8 all-reduce (average) of flat ``xs``."""
    w, n = len(xs), xs[0].numel()
    unit = w * block
    n_pad = -(-n // unit) * unit

    def q(v: torch.Tensor) -> torch.Tensor:
        v = v.view(-1, block)
        s = v.abs().amax(1, keepdim=True) / 127
        safe = torch.where(s > 0, s, torch.ones_like(s))
        return (torch.round(v / safe) * s).view(-1)

    acc = torch.zeros(n_pad, dtype=torch.float64)
    for x in xs:
        v = torch.zeros(n_pad, dtype=torch.float64)
        v[:n] = x.double()
        acc += q(v)
    return (q(acc) / w)[:n]


def sim_payload(xs: list[torch.Tensor], block: int, mode: str) -> torch.Tensor:
    """float64 simulation of one low-rank payload's average in wire ``mode``."""
    if mode == "int8":
        return sim_int8_allreduce(xs, block)
    w = len(xs)
    if mode == "bf16":  # each rank sends bf16(x / W); the sum is rounded to bf16
        parts = [(x.double() / w).to(torch.bfloat16).double() for x in xs]
        return sum(parts).to(torch.bfloat16).double()
    return sum(x.double() for x in xs) / w


def ref_lowrank(inputs, lr_states, gen_state, plan, block, wire=None) -> torch.Tensor:
    """float64 reference of lowrank_int8_allreduce (error feedback, warm start) over ranks.

    ``inputs``: per rank the flat bucket; ``lr_states``: per rank (qs, residuals, rest
    residual) before the step; ``gen_state``: the generator state before the step.
    """
    w = len(inputs)
    n = inputs[0].numel()
    out = torch.zeros(n, dtype=torch.float64)
    gen = torch.Generator()
    gen.set_state(gen_state)
    ms = []  # per rank, per group (k, n, m)
    for r in range(w):
        flat = inputs[r].double()
        per = []
        for gi, g in enumerate(plan.groups):
            mat = torch.stack([flat[s.offset : s.offset + s.numel].view(g.n, g.m) for s in g.slots])
            res = lr_states[r][1][gi] if lr_states[r][1] else None
            if res is not None:
                mat = mat + res.double()
            per.append(mat)
        ms.append(per)
    qs0 = []
    for gi, g in enumerate(plan.groups):
        q_prev = lr_states[0][0][gi] if lr_states[0][0] else None
        if q_prev is None:
            q_prev = torch.randn(g.k, g.m, g.rank, generator=gen)
        qs0.append(q_prev.double())
    if plan.groups:
        p_flat = [
            torch.cat([(ms[r][gi] @ qs0[gi]).reshape(-1) for gi in range(len(plan.groups))])
            for r in range(w)
        ]
        p_avg = sim_payload(p_flat, block, wire.p if wire else "int8")
        ps, o = [], 0
        for g in plan.groups:
            p = p_avg[o : o + g.k * g.n * g.rank].view(g.k, g.n, g.rank)
            o += p.numel()
            ps.append(torch.linalg.qr(p).Q)
        q_flat = [
            torch.cat([(ms[r][gi].mT @ ps[gi]).reshape(-1) for gi in range(len(plan.groups))])
            for r in range(w)
        ]
        q_avg = sim_payload(q_flat, block, wire.q if wire else "int8")
        o = 0
        for gi, g in enumerate(plan.groups):
            q = q_avg[o : o + g.k * g.m * g.rank].view(g.k, g.m, g.rank)
            o += q.numel()
            approx = ps[gi] @ q.mT
            for i, s in enumerate(g.slots):
                out[s.offset : s.offset + s.numel] = approx[i].reshape(-1)
    if plan.rest:
        rest = []
        for r in range(w):
            x = torch.cat([inputs[r][s.offset : s.offset + s.numel].double() for s in plan.rest])
            rr = lr_states[r][2]
            rest.append(x + (rr.double() if rr is not None else 0))
        avg = sim_payload(rest, block, wire.rest if wire else "int8")
        o = 0
        for s in plan.rest:
            out[s.offset : s.offset + s.numel] = avg[o : o + s.numel]
            o += s.numel
    return out


# -- scenarios -----------------------------------------------------------------------------


def _capture(hook, state, log):
    """Wrap ``hook`` to log each bucket's input, pre-step state and output."""

    def wrapped(state, bucket):
        if state.config.policy == "auto" and state.iteration == state._measure_at:
            # policy auto's measurement step (plain all-reduces, each held until the last
            # bucket: verl_comm.hooks.measure): waiting here would never end; not logged,
            # the step's replica hashes are still compared
            return hook(state, bucket)
        idx = bucket.index()
        state.flush()  # earlier buckets off the worker: the snapshot below is this bucket's
        bs = state.buckets.get(idx)
        sig = tuple(tuple(p.shape) for p in bucket.parameters())
        if bs is not None and bs.signature[2] != sig:
            bs = None  # DDP rebuilt its buckets: the hook resets this state
        entry = {
            "index": idx,
            "input": bucket.buffer().detach().clone(),
            "params": [id(p) for p in bucket.parameters()],
            "iteration": state.iteration,
            "gen": state.generator.get_state(),
            "res": None if bs is None or bs.residual is None else bs.residual.clone(),
            "lr": (
                ([], [], None)
                if bs is None
                else (
                    [None if q is None else q.clone() for q in bs.lowrank.qs],
                    [None if r is None else r.clone() for r in bs.lowrank.residuals],
                    None if bs.lowrank.rest_residual is None else bs.lowrank.rest_residual.clone(),
                )
            ),
        }
        fut = hook(state, bucket)
        entry["output"] = fut.wait().detach().clone()
        entry["path"] = (
            state._pending[-1].method if state._pending else state.last_stats[idx].method
        )
        log.append(entry)
        return fut

    return wrapped


def _eps(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]


def _check_bucket(method, entry, state, dtype, world) -> dict:
    """Compare one captured bucket with the exact average / the float64 reference."""
    from verl_comm.hooks._core import bucket_plan

    inputs = gather(entry["input"])
    out = entry["output"].double()
    mean = sum(x.double() for x in inputs) / world
    scale = sum(x.double().abs() for x in inputs) / world
    path = entry["path"]
    block = state.config.quant_block
    res: dict = {"path": path}
    if path == "allreduce":
        if dtype == torch.float32:
            res["rel_close"] = bool(torch.allclose(out, mean, rtol=1e-5, atol=1e-7))
        else:
            res["rel_close"] = bool(((out - mean).abs() <= 2 * _eps(dtype) * scale + 1e-6).all())
    elif path in ("fp16", "bf16"):
        eps = _eps(torch.float16 if path == "fp16" else torch.bfloat16)
        bound = (world + 1) * eps * scale + 2 * _eps(dtype) * mean.abs() + 1e-7
        res["ratio"] = float(((out - mean).abs() / bound).max())
    elif path == "int8":
        r_old = entry["res"]
        v = [x.double() for x in inputs]
        if r_old is not None:
            v = [x + g.double() for x, g in zip(v, gather(r_old))]
        n = out.numel()
        unit = world * block
        n_pad = -(-n // unit) * unit
        absmax = torch.zeros(n_pad // block, dtype=torch.float64)
        for vi in v:
            pad = torch.zeros(n_pad, dtype=torch.float64)
            pad[:n] = vi
            absmax += pad.view(-1, block).abs().amax(1)
        # rank error <= s_i / 2 each, owner requant error <= s_sum / 2, s_sum <= sum s_i
        per_el = (absmax / 127).repeat_interleave(block)[:n] / world
        bound = per_el * (1 + 1e-4) + 2 * _eps(dtype) * mean.abs() + 1e-7
        target = sum(v) / world
        res["ratio"] = float(((out - target).abs() / bound).max())
    elif path == "lowrank_int8":
        bs = state.buckets[entry["index"]]
        plan = bucket_plan(state, bs, out.numel())
        lr = entry["lr"]
        # gather each rank's pre-step residuals (Q is identical on every rank)
        qs, resids = lr[0], []
        for gi in range(len(plan.groups)):
            rg = lr[1][gi] if lr[1] and lr[1][gi] is not None else None
            resids.append(None if rg is None else gather(rg))
        rest = gather(lr[2]) if lr[2] is not None else None
        all_lr = [
            (
                qs,
                [None if x is None else x[r] for x in resids],
                None if rest is None else rest[r],
            )
            for r in range(world)
        ]
        ref = ref_lowrank(inputs, all_lr, entry["gen"], plan, block, bs.wire)
        res["wire"] = None if bs.wire is None else (bs.wire.p, bs.wire.q, bs.wire.rest)
        res["rel_err"] = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
        res["n_groups"] = len(plan.groups)
        res["rest"] = plan.rest_numel
    return res


def scenario_compare(
    rank,
    world,
    tmp,
    method,
    dtype=torch.float32,
    no_sync=False,
    static_graph=False,
    policy="fixed",
    steps=4,
):
    """DDP + hook vs DDP without, per bucket checks, replica hashes, hard-case params."""
    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import make_hook

    rank_ = 4 if method == "lowrank_int8" else None
    comp = {"none": "none", "lowrank_int8": "int8"}.get(method, method)
    cfg = CompressionConfig(
        gradient_compression=comp,
        compression_rank=rank_,
        start_iter=1,
        quant_block=32,
        residual_dtype="float32",
        policy=policy,
        bucket_cap_mb=0.01,
    )
    torch.manual_seed(0)
    model = Net().to(dtype)
    ref = Net().to(dtype)
    kw = dict(bucket_cap_mb=0.01)
    if static_graph:
        kw["static_graph"] = True
    else:
        kw["find_unused_parameters"] = True
    ddp = DDP(model, **kw)
    ddp_ref = DDP(ref, **kw)
    hook, state = make_hook(cfg)
    log: list = []
    ddp.register_comm_hook(state, _capture(hook, state, log))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    frozen0 = model.frozen.weight.detach().clone()
    unused0 = model.unused.weight.detach().clone()
    out: dict = {"hashes": [], "grad_close": [], "buckets": [], "paths": set()}
    for step in range(steps):
        ref.load_state_dict(model.state_dict())
        log.clear()
        for m in (ddp, ddp_ref):
            if no_sync:
                x, y = batch(step + 100, rank, dtype)
                with m.no_sync():
                    nn.functional.mse_loss(m(x), y).backward()
            x, y = batch(step, rank, dtype)
            nn.functional.mse_loss(m(x), y).backward()
        for e in log:
            chk = _check_bucket(method, e, state, dtype, world)
            chk["step"] = step
            out["paths"].add(chk["path"])
            out["buckets"].append(chk)
        if method == "none":
            ok = all(
                torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
                for p, q in zip(model.parameters(), ref.parameters())
                if p.grad is not None
            )
            out["grad_close"].append(ok)
        out["unused_grad_none"] = model.unused.weight.grad is None
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out["hashes"].append(param_hash(model))
    out["frozen_unchanged"] = bool(torch.equal(model.frozen.weight, frozen0))
    out["unused_unchanged"] = bool(torch.equal(model.unused.weight, unused0))
    # error-feedback residual of the never-used parameter stays exactly zero
    uid = id(model.unused.weight)
    unused_norm = 0.0
    for e in log:
        if uid in e["params"]:
            bs = state.buckets[e["index"]]
            off = 0
            params = dict((id(p), p) for p in model.parameters())
            for pid in e["params"]:
                if pid == uid:
                    break
                off += params[pid].numel()
            if bs.residual is not None:
                unused_norm += float(bs.residual[off : off + unused0.numel()].norm())
            if bs.plan is not None:
                for gi, g in enumerate(bs.plan.groups):
                    for i, s in enumerate(g.slots):
                        if (
                            s.offset == off
                            and gi < len(bs.lowrank.residuals)
                            and bs.lowrank.residuals[gi] is not None
                        ):
                            unused_norm += float(bs.lowrank.residuals[gi][i].norm())
    out["unused_residual_norm"] = unused_norm
    out["finite"] = all(torch.isfinite(p).all() for p in model.parameters())
    out["stats"] = [s.to_dict() for s in state.last_stats.values()]
    out["decisions"] = {
        i: (None if b.decision is None else b.decision.compress) for i, b in state.buckets.items()
    }
    out["ef_bytes"] = state.ef_state_nbytes()
    del ddp, ddp_ref, model, ref
    return out


def scenario_nonfinite(rank, world, tmp, method, mode):
    """A NaN gradient on rank 1 in one parameter at step 1: skip zeroes exactly that
    bucket on every rank and training continues; raise errors on every rank."""
    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import register_comm_hook

    comp = {"none": "none", "lowrank_int8": "int8"}.get(method, method)
    cfg = CompressionConfig(
        gradient_compression=comp,
        compression_rank=4 if method == "lowrank_int8" else None,
        start_iter=1,
        quant_block=32,
        nonfinite=mode,
        bucket_cap_mb=0.01,
    )
    torch.manual_seed(0)
    model = Net()
    poison = {"on": False}

    def nan_hook(g):
        return torch.full_like(g, float("nan")) if poison["on"] and rank == 1 else g

    model.blocks[2].weight.register_hook(nan_hook)
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    state = register_comm_hook(ddp, cfg)  # the one-call helper
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: dict = {"hashes": [], "error": None}
    for step in range(3):
        poison["on"] = step == 1
        x, y = batch(step, rank)
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
        except RuntimeError as e:
            out["error"] = str(e)
            out["error_step"] = step
            break
        if step == 1:
            out["stats"] = [s.to_dict() for s in state.last_stats.values()]
            out["poisoned_grad_zero"] = bool((model.blocks[2].weight.grad == 0).all())
            out["other_grads_finite"] = all(
                torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
            )
            out["other_grad_nonzero"] = bool(model.inp.weight.grad.abs().sum() > 0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["hashes"].append(param_hash(model))
    out["events"] = list(state.nonfinite_events)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    del ddp, model
    return out


def _ckpt_model(rank, cfg):
    from verl_comm.hooks import make_hook

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    hook, state = make_hook(cfg)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, opt


def _ckpt_cfg(method):
    from verl_comm.compression import CompressionConfig

    return CompressionConfig(
        gradient_compression="int8",
        compression_rank=4 if method == "lowrank_int8" else 0,
        start_iter=1,
        quant_block=32,
        warm_start=True,
        bucket_cap_mb=0.01,
    )


def _ckpt_train(model, ddp, opt, rank, steps) -> list[str]:
    """One DDP step (MSE on ``batch(step, rank)``, optimizer step) per entry of ``steps``;
    the parameter hash after each."""
    hashes = []
    for step in steps:
        x, y = batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        hashes.append(param_hash(model))
    return hashes


def scenario_ckpt_save(rank, world, tmp, method, k=3, n=6):
    """Train k steps, save model/optimizer/hook state, continue to n (hashes recorded)."""
    model, ddp, state, opt = _ckpt_model(rank, _ckpt_cfg(method))
    hashes = _ckpt_train(model, ddp, opt, rank, range(min(k, n)))
    if k < n:  # saved before step k
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
            Path(tmp) / f"ckpt_{method}_rank{rank}.pt",
        )
    hashes += _ckpt_train(model, ddp, opt, rank, range(k, n))
    del ddp, model
    return {"hashes": hashes}


def scenario_ckpt_load(rank, world, tmp, method, k=3, n=6):
    """Fresh process: load the step-k checkpoint and train to n (hashes recorded)."""
    model, ddp, state, opt = _ckpt_model(rank, _ckpt_cfg(method))
    ck = torch.load(Path(tmp) / f"ckpt_{method}_rank{rank}.pt", weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["hook"])
    hashes = _ckpt_train(model, ddp, opt, rank, range(k, n))
    del ddp, model
    return {"hashes": hashes}


# -- convergence ---------------------------------------------------------------------------


class TinyMLP(nn.Module):
    """Student MLP for the teacher-student regression of the convergence runs."""

    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, d_out),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


CONV_SETTINGS = {
    "none": dict(gradient_compression="none"),
    "fp16": dict(gradient_compression="fp16"),
    "bf16": dict(gradient_compression="bf16"),
    "int8": dict(gradient_compression="int8"),
    "int8_no_ef": dict(gradient_compression="int8", error_feedback=False),
    "lowrank_int8_r4": dict(gradient_compression="int8", compression_rank=4),
    "lowrank_int8_r8": dict(gradient_compression="int8", compression_rank=8),
    "lowrank_int8_r4_no_ef": dict(
        gradient_compression="int8", compression_rank=4, error_feedback=False
    ),
}


def scenario_convergence(rank, world, tmp, steps, seeds, settings):
    """Teacher-student regression, Adam, ``steps`` steps per (setting, seed); returns the
    mean training loss over the last 20 steps and the evaluation loss at the end."""
    import warnings

    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import make_hook

    results = {}
    for seed in range(seeds):
        tg = torch.Generator().manual_seed(12345)
        teacher = TinyMLP()
        with torch.no_grad():
            for p in teacher.parameters():
                p.copy_(torch.randn(p.shape, generator=tg) / p.shape[-1] ** 0.5)
        xe = torch.randn(512, 32, generator=tg)
        with torch.no_grad():
            ye = teacher(xe)
        for name in settings:
            torch.manual_seed(seed)
            model = TinyMLP()
            ddp = DDP(model, bucket_cap_mb=0.004)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = CompressionConfig(bucket_cap_mb=0.004, **CONV_SETTINGS[name])
            hook, state = make_hook(cfg)
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
            g = torch.Generator().manual_seed(1000 * seed + rank)
            losses = []
            for _ in range(steps):
                x = torch.randn(32, 32, generator=g)
                with torch.no_grad():
                    y = teacher(x)
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
            with torch.no_grad():
                ev = float(nn.functional.mse_loss(model(xe), ye))
            rel = [s.rel_error for s in state.last_stats.values() if s.rel_error is not None]
            results[(name, seed)] = {
                "train_loss": sum(losses[-20:]) / 20,
                "eval_loss": ev,
                "initial_loss": losses[0],
                "wire_bytes": sum(s.wire_bytes for s in state.last_stats.values()),
                "plain_bytes": sum(s.plain_bytes for s in state.last_stats.values()),
                "rel_error": sum(rel) / len(rel) if rel else None,
                "hash": param_hash(model),
            }
            del ddp, model
    return results


SCENARIOS = {
    "compare": scenario_compare,
    "nonfinite": scenario_nonfinite,
    "ckpt_save": scenario_ckpt_save,
    "ckpt_load": scenario_ckpt_load,
    "convergence": scenario_convergence,
}

_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse(spec: str):
    """``name:key=value,key=value`` -> (name, kwargs)."""
    name, _, rest = spec.partition(":")
    kw = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if v in _DTYPE:
            kw[k] = _DTYPE[v]
        elif v in ("True", "False"):
            kw[k] = v == "True"
        elif v.lstrip("-").isdigit():
            kw[k] = int(v)
        elif "+" in v:
            kw[k] = v.split("+")
        else:
            kw[k] = v
    return name, kw


def run_session(rank: int, world: int, script: str, specs: list[str], out: str) -> dict:
    """One rank of a session, in the gloo group (60 s timeout) ``spawn`` made: each
    ``name:key=value,...`` spec's function of ``script``'s ``SCENARIOS`` (this file's or
    ``test_hooks_async_worker.py``'s), its result or its traceback per spec."""
    scenarios = SCENARIOS
    if Path(script).resolve() != HERE:
        spec = importlib.util.spec_from_file_location(Path(script).stem, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        scenarios = module.SCENARIOS
    results = {}
    for spec_text in specs:
        name, kw = _parse(spec_text)
        try:
            results[spec_text] = scenarios[name](rank, world, out, **kw)
        except Exception:
            results[spec_text] = {"exception": traceback.format_exc()}
    gc.collect()
    dist.barrier()
    return results
