"""Worker processes of ``test_auto_trial.py`` (gloo, CPU); not a test module.

Launched through ``test_hooks_ddp_worker.spawn_session``, which reads :data:`SCENARIOS`.
"""

from __future__ import annotations

import hashlib
import time
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def scenario_trial(rank, world, tmp, steps=14, slow_s=0.15):
    """``policy: auto`` (int8, two buckets) with 2 trial steps per plan, where every int8
    chain sleeps ``slow_s`` on top of its work: the paths each bucket took per iteration,
    the trial as kept, a state_dict round trip of it, and a hash of the weights."""
    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import _core, direct, make_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = CompressionConfig(gradient_compression="int8", policy="auto", start_iter=1,
                                quant_block=32, bucket_cap_mb=0.01, auto_trial_steps=2)  # fmt: skip
    hook, state = make_hook(cfg, timeout_s=60)
    paths: list[tuple[int, int, str]] = []
    real, real_int8 = _core.run_path, _core.PATHS["int8"]

    def run_path(st, bs, path, fn, buf, coll, keep):
        paths.append((st.iteration, buf.numel(), path))
        return real(st, bs, path, fn, buf, coll, keep)

    real_direct = direct.run_direct_cast

    def run_direct(st, buf, index, shapes, method, *rest):  # a step of casts: torch's order
        paths.append((st.iteration, buf.numel(), f"direct {method}"))
        return real_direct(st, buf, index, shapes, method, *rest)

    def slow_int8(*a, **k):
        time.sleep(slow_s)
        return real_int8(*a, **k)

    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, hook)
    _core.run_path, _core.PATHS["int8"] = run_path, slow_int8
    direct.run_direct_cast = run_direct
    settling = []
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(steps):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank + step))
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            settling.append(state.auto_settling)
    finally:
        _core.run_path, _core.PATHS["int8"] = real, real_int8
        direct.run_direct_cast = real_direct
    t = state._trial
    sd = state.state_dict()
    fresh = make_hook(cfg, timeout_s=60)[1]
    fresh.load_state_dict(sd)
    out = {
        "paths": paths,
        "sizes": {i: b.signature[0] for i, b in state.buckets.items()},
        "start": t.start,
        "steps": t.steps,
        "names": t.names,
        "plans": t.plans,
        "times_s": t.times_s,
        "chosen": t.chosen,
        "settling": settling,
        "note": state.auto_note(),
        "ef_bytes": state.ef_state_nbytes(),
        "restored": (fresh._trial.chosen, fresh._trial.plans) if fresh._trial else None,
        "hash": hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        ).hexdigest(),
    }
    fresh.close()
    state.close()
    del ddp, model
    return out


SCENARIOS = {"trial": scenario_trial}
