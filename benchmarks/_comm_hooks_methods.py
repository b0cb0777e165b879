"""The methods of ``benchmarks/comm_hooks.py``: their names, settings and error bounds, and
how each is built (through the API a user calls) and instrumented; the numerics check
that runs before any method is timed. See that script's docstring for the protocol."""

from __future__ import annotations

import argparse
import time
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

TORCH_FIXED = ("none", "torch_allreduce", "torch_bf16", "torch_fp16")
REDUCER = {"reducer_none": {}, "reducer_int8": {"gradient_compression": "int8"}}
OURS_FIXED = {  # name -> CompressionConfig fields
    "ours_bf16": {"gradient_compression": "bf16"},
    "ours_int8": {"gradient_compression": "int8"},
    # int8 reduced inside each host first where the ranks are hosts x local ranks
    "ours_int8_hier": {"gradient_compression": "int8", "hierarchical": "auto"},
    "ours_auto": {"gradient_compression": "int8", "compression_rank": 64, "policy": "auto"},
}
METHODS = (
    "compute_only", "none", "torch_allreduce", "torch_bf16", "torch_powersgd_r32",
    "torch_powersgd_r128",
    "ours_bf16", "ours_int8", "ours_lowrank_int8_r32", "ours_lowrank_int8_r64",
    "ours_lowrank_int8_r128", "ours_auto", "reducer_none", "reducer_int8",
)  # fmt: skip
"""The default set (issue 21's run); ``torch_fp16``, ``torch_powersgd_r<N>``,
``ours_lowrank_int8_r<N>`` and ``ours_auto_r<N>`` (``ours_auto`` at rank N) for any N can be
asked for with ``--methods``."""
BOUNDS = {
    "none": 1e-6,
    "torch_allreduce": 1e-6,
    "reducer_none": 1e-6,
    "bf16": 2e-2,
    "int8": 5e-2,
    "lowrank": 0.1,
}


def _rank_of(name: str, prefix: str) -> int | None:
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def ours_fields(name: str) -> dict | None:
    """CompressionConfig fields of one of our methods (None if ``name`` is not ours)."""
    if name in OURS_FIXED:
        return OURS_FIXED[name]
    if name in REDUCER:
        return REDUCER[name]
    r = _rank_of(name, "ours_lowrank_int8_r")
    if r is not None:
        return {"gradient_compression": "int8", "compression_rank": r}
    r = _rank_of(name, "ours_auto_r")  # policy auto, low rank r the lossiest path it may take
    return None if r is None else {**OURS_FIXED["ours_auto"], "compression_rank": r}


def ours_config(name: str, bucket_cap_mb: float = 25.0):
    """The ``CompressionConfig`` a user would write for one of our methods (None if not
    ours): its fields, every other one the default."""
    fields = ours_fields(name)
    if fields is None:
        return None
    from verl_comm.compression.config import CompressionConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ranks below 64 are asked for
        return CompressionConfig(**fields, bucket_cap_mb=bucket_cap_mb)


def known(name: str) -> bool:
    """Whether ``name`` is a method this benchmark can build."""
    return (
        name == "compute_only"
        or name in TORCH_FIXED
        or ours_fields(name) is not None
        or _rank_of(name, "torch_powersgd_r") is not None
    )


def bound_of(method: str) -> float | None:
    """Relative L2 error bound (None: not checked; low rank: see the module docstring)."""
    if method == "compute_only":
        return None
    if method in BOUNDS:
        return BOUNDS[method]
    if "powersgd" in method or "lowrank" in method or method.startswith("ours_auto"):
        return BOUNDS["lowrank"]
    return BOUNDS["bf16"] if ("bf16" in method or "fp16" in method) else BOUNDS["int8"]


def _config_of(name: str, bucket_cap_mb: float = 25.0) -> dict:
    """The settings a method runs with (our methods: the full ``CompressionConfig``)."""
    cfg = ours_config(name, bucket_cap_mb)
    if cfg is not None:
        return cfg.model_dump()
    r = _rank_of(name, "torch_powersgd_r")
    if r is not None:
        return {"matrix_approximation_rank": r, "start_powerSGD_iter": 2,
                "min_compression_rate": 2, "use_error_feedback": True, "warm_start": True}  # fmt: skip
    return {}


def non_default(name: str, bucket_cap_mb: float = 25.0) -> dict:
    """The settings of a method that differ from its API's defaults (ours:
    ``CompressionConfig``; torch's PowerSGD: ``PowerSGDState``; other torch hooks: none)."""
    cfg = ours_config(name, bucket_cap_mb)
    if cfg is not None:
        return cfg.model_dump(exclude_defaults=True)
    if _rank_of(name, "torch_powersgd_r") is not None:
        import inspect

        sig = inspect.signature(psgd.PowerSGDState.__init__).parameters
        conf = _config_of(name)
        return {k: v for k, v in conf.items() if sig[k].default != v}
    return {}


# --------------------------------------------------------------- outputs
class Probe:
    """Times each bucket from its hook call to its Future's completion, when ``on``.

    The completion time is taken in a ``Future.then`` callback that only reads the clock
    (no collective). Meaningful on CPU; on CUDA a Future completes when the work is
    enqueued."""

    def __init__(self) -> None:
        self.on = False
        self.spans: list[tuple[float, float]] = []

    def wrap(self, hook):
        def probed(state, bucket):
            if not self.on:
                return hook(state, bucket)
            t0 = time.perf_counter()
            fut = hook(state, bucket)

            def done(f):
                self.spans.append((t0, time.perf_counter()))
                return f.value()

            return fut.then(done)

        return probed


class Capture:
    """Inputs and pre-step state of our low-rank buckets on the numerics step (then off)."""

    def __init__(self) -> None:
        self.on = False
        self.items: list[dict] = []

    def wrap(self, hook):
        def capturing(state, bucket):
            if self.on and getattr(state, "config", None) and state.config.method == "lowrank_int8":
                state.flush()
                idx = int(bucket.index())
                bs = state.buckets.get(idx)
                lr = None if bs is None else bs.lowrank
                self.items.append({
                    "index": idx,
                    "params": list(bucket.parameters()),
                    "input": bucket.buffer().detach().clone(),
                    "gen": state.generator.get_state(),
                    "qs": [] if lr is None else [None if q is None else q.clone() for q in lr.qs],
                    "res": [] if lr is None else [None if r is None else r.clone() for r in lr.residuals],
                    "rest": None if lr is None or lr.rest_residual is None else lr.rest_residual.clone(),
                })  # fmt: skip
            return hook(state, bucket)

        return capturing


class ProbedDDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose ``register_comm_hook`` puts the benchmark's probe and capture around the hook
    it is given (pass-throughs while off): torch's hooks are registered with DDP's own API,
    ours with ``verl_comm.hooks.register_comm_hook``, all through this one point."""

    wrap = staticmethod(lambda hook: hook)

    def register_comm_hook(self, state, hook):  # noqa: D102 - DDP's
        super().register_comm_hook(state, self.wrap(hook))


class Method:
    """One model, its DDP wrapper (or reducer), optimizer and hook state, each built through
    the API a user calls: ``register_comm_hook(ddp, CompressionConfig(...))`` for our DDP
    hooks, ``make_reducer(module, CompressionConfig(...))`` (the trainer's DeepSpeed path)
    for ``reducer_*``, DDP's ``register_comm_hook`` for torch's; every setting the record
    does not name is the library's default."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        from verl_comm.hooks import register_comm_hook
        from verl_comm.reducer import make_reducer

        self.name, self.device = name, device
        self.loss_scale = args.loss_scale
        torch.manual_seed(0)
        layers = [torch.nn.Linear(args.dim, args.dim, device=device) for _ in range(args.layers)]
        self.module = torch.nn.Sequential(*layers)
        self.state = None
        self.reducer = None
        self.settle_steps = 0  # extra warm-up steps while policy auto settled its plan
        self.probe = Probe()
        self.capture = Capture()
        ids = [device.index] if device.type == "cuda" else None
        cfg = ours_config(name, args.bucket_cap_mb)
        if name in REDUCER:
            self.reducer = make_reducer(self.module, cfg)
            self.reducer.hook = self.probe.wrap(self.capture.wrap(self.reducer.hook))
            self.state = self.reducer.state
            self.model = self.module
            self.opt = torch.optim.SGD(self.module.parameters(), lr=0.0)
            return
        self.model = ProbedDDP(self.module, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)
        self.model.wrap = lambda hook: self.probe.wrap(self.capture.wrap(hook))
        if name == "torch_allreduce":
            self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name == "torch_bf16":
            self.model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif name == "torch_fp16":
            self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name.startswith("torch_powersgd_r"):
            self.state = psgd.PowerSGDState(process_group=None, **_config_of(name))
            self.model.register_comm_hook(self.state, psgd.powerSGD_hook)
        elif cfg is not None:
            self.state = register_comm_hook(self.model, cfg)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.0)

    def settling(self) -> bool:
        """Whether our hook state's ``policy: auto`` may still change its paths (its
        decisions or trial steps are not done): ``CommHookState.auto_settling``."""
        return bool(getattr(self.state, "auto_settling", False))

    def step(self, x: torch.Tensor) -> None:
        """zero_grad, forward (bf16 autocast on CUDA), backward, reduction, SGD step."""
        self.opt.zero_grad(set_to_none=True)
        ctx = self.model.no_sync() if self.name == "compute_only" else nullcontext()
        with ctx:
            with torch.autocast(
                self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"
            ):
                out = self.model(x)
            (out.float().square().mean() * self.loss_scale).backward()
        if self.reducer is not None:
            self.reducer.finalize()
        self.opt.step()

    def wire_bytes(self, world: int) -> tuple[int, str]:
        """Bytes one rank sends per step, and whether measured or analytic."""
        from verl_comm.compression import ring_allreduce_wire_bytes as ring

        params = list(self.module.parameters())
        n = sum(p.numel() for p in params)
        if self.name == "compute_only":
            return 0, "analytic"
        if self.name in ("none", "torch_allreduce"):
            return ring(n, world, 4), "analytic"
        if self.name in ("torch_bf16", "torch_fp16"):
            return ring(n, world, 2), "analytic"
        if self.name.startswith("torch_powersgd"):
            r = self.state.matrix_approximation_rank
            total = 0
            for p in params:
                if p.dim() > 1:
                    rows, cols = p.shape[0], p[0].numel()
                    if psgd._should_compress(rows, cols, r, 2)[0]:
                        total += ring(r * (rows + cols), world, 4)
                        continue
                total += ring(p.numel(), world, 4)
            return total, "analytic"
        self.state.flush()
        return sum(s.wire_bytes for s in self.state.last_stats.values()), "measured"

    def ef_bytes(self) -> int:
        """Bytes of error-feedback state (residuals, warm-start factors) on this rank."""
        if self.state is None:
            return 0
        if isinstance(self.state, psgd.PowerSGDState):
            dicts = (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict)
            return sum(t.numel() * t.element_size() for d in dicts for t in d.values())
        return int(self.state.ef_state_nbytes())

    def close(self) -> None:
        """Drop the model (before destroy_process_group) and stop the hook's worker."""
        if self.reducer is not None:
            self.reducer.remove()
        if hasattr(self.state, "close"):
            self.state.close()
        del self.model, self.module, self.opt, self.state, self.reducer


def _lowrank_reference(m: Method, world: int) -> float | None:
    """Relative L2 distance of our low-rank result from a float64 run of the same
    algorithm (same inputs, Q, residuals and RNG; exact all-reduces) over all its
    low-rank buckets; None when no bucket took the low-rank path (policy auto)."""
    from verl_comm.compression.collective import ProcessGroupCollective
    from verl_comm.compression.lowrank import LowRankBucketState
    from verl_comm.compression.lowrank import lowrank_int8_allreduce as lowrank
    from verl_comm.compression.lowrank_plan import FactorWire
    from verl_comm.hooks._core import bucket_plan

    st = m.state
    st.flush()  # CUDA: the step's per-bucket paths are read after the device got there
    cfg = st.config
    coll = ProcessGroupCollective(None)
    err_sq = ref_sq = 0.0
    d64 = torch.float64
    for it in m.capture.items:
        bs = st.buckets[it["index"]]
        if bs.meta[0] != "lowrank_int8" or st.last_stats[it["index"]].method != "lowrank_int8":
            continue  # a plain bucket under policy auto: compared with `none` instead
        plan = bucket_plan(st, bs, it["input"].numel())
        lr64 = LowRankBucketState(
            qs=[None if q is None else q.to(d64) for q in it["qs"]],
            residuals=[None if r is None else r.to(d64) for r in it["res"]],
            rest_residual=None if it["rest"] is None else it["rest"].to(d64),
        )
        gen = torch.Generator().manual_seed(0)
        gen.set_state(it["gen"])
        ref = lowrank(
            it["input"].to(d64), plan, lr64, coll, block=cfg.quant_block,
            error_feedback=cfg.error_feedback, warm_start=cfg.warm_start, generator=gen,
            wire=FactorWire("exact", "exact", "exact"), stats=False,
        ).out  # fmt: skip
        out = torch.cat([p.grad.reshape(-1) for p in it["params"]]).to(d64)
        err_sq += float((out - ref).square().sum())
        ref_sq += float(ref.square().sum())
    if ref_sq == 0:
        return None
    return (err_sq / ref_sq) ** 0.5


def _check(methods: dict[str, Method], world: int) -> dict[str, dict]:
    """Each method's gradient vs ``none``'s (ours low rank: vs its float64 reference)."""
    ref = [p.grad for p in methods["none"].module.parameters()]
    ref_sq = sum(float(g.double().square().sum()) for g in ref)
    out = {}
    for name, m in methods.items():
        bound = bound_of(name)
        if bound is None:
            out[name] = {"ok": True, "rel_error": None, "why": "not checked (no communication)"}
            continue
        grads = [p.grad for p in m.module.parameters()]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        err_sq = sum(float((g.double() - r.double()).square().sum()) for g, r in zip(grads, ref))
        rel = (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else float("inf")
        fp = torch.tensor(
            [float(g.double().sum()) for g in grads] + [float(g.double().norm()) for g in grads],
            dtype=torch.float64,
            device=grads[0].device,
        )
        allfp = [torch.zeros_like(fp) for _ in range(world)]
        dist.all_gather(allfp, fp)
        # bit-equality is the property: every rank applies the same reduced bytes, so the
        # replicas' gradients are identical on any CPU (a mismatch is a hook bug, not rounding)
        same = all(torch.equal(allfp[0], f) for f in allfp[1:])
        info = {"vs_none": rel}
        ref_rel = _lowrank_reference(m, world) if m.capture.items else None
        if ref_rel is not None:  # ours, low rank: the float64 run of the same algorithm
            rel = ref_rel
            info["reference"] = "float64 run of the same algorithm"
            ok = finite and same and rel <= bound
        elif "powersgd" in name:
            norm = sum(float(g.double().square().sum()) for g in grads) ** 0.5
            ratio = norm / ref_sq**0.5 if ref_sq > 0 else float("inf")
            info.update(norm_ratio=ratio, reference="norm within 0.5-2x of the exact average")
            ok = finite and same and 0.5 <= ratio <= 2.0
        else:
            ok = finite and same and rel <= bound
        why = "" if ok else f"finite={finite} replicas_identical={same} rel={rel:.3g} {info}"
        out[name] = {"ok": ok, "rel_error": rel, "bound": bound, "why": why, **info}
    return out
