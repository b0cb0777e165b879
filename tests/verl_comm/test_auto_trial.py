"""``policy: auto``'s trial steps on CPU hosts (verl_comm.hooks.trial)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from verl_comm.compression import CompressionConfig
from verl_comm.hooks import trial

HERE = Path(__file__).resolve()
_spec = importlib.util.spec_from_file_location(
    "verl_comm_hooks_ddp_worker", HERE.with_name("test_hooks_ddp_worker.py")
)
launcher = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launcher)


def _state(decisions: dict, steps: int = 3, iteration: int = 3):
    cfg = CompressionConfig(gradient_compression="int8", policy="auto", auto_trial_steps=steps)
    buckets = {i: SimpleNamespace(decision=d) for i, d in decisions.items()}
    return SimpleNamespace(config=cfg, buckets=buckets, iteration=iteration, _measure_at=1,
                           _last_end_s=10.0, _trial=None)  # fmt: skip


def _dec(path: str, options: tuple[str, ...]):
    return SimpleNamespace(path=path, options={m: 0.0 for m in options})


def test_candidates_are_the_model_plan_then_each_path_everywhere_it_applies():
    opts = ("allreduce", "bf16", "int8")
    st = _state(
        {0: _dec("allreduce", opts), 1: _dec("int8", opts), 2: _dec("int8", ("allreduce", "int8"))}
    )
    t = trial._build(st)
    assert t.names == ["model", "all allreduce", "all bf16", "all int8"]
    assert t.plans[0] == {0: "allreduce", 1: "int8", 2: "int8"}
    assert t.plans[2] == {0: "bf16", 1: "bf16", 2: "int8"}  # bucket 2 may not take bf16
    assert (t.start, t.stop, t.ends) == (3, 3 + 3 * 4, {2: 10.0})
    assert [t.path(1, it) for it in (3, 5, 6, 8, 9, 14)] == [
        "int8",
        "int8",
        "allreduce",
        "allreduce",
        "bf16",
        "int8",
    ]
    assert t.path(1, 15) is None  # after the trials, before the agreement: the decision's


def test_no_trial_when_one_plan_or_switched_off():
    assert trial._build(_state({0: _dec("int8", ("int8",))})) is None
    assert trial._build(_state({0: _dec("int8", ("allreduce", "int8"))}, steps=0)) is None


def test_step_times_are_medians_of_each_candidates_own_steps():
    st = _state({0: _dec("allreduce", ("allreduce", "int8"))}, steps=3)
    t = trial._build(st)  # plans: model (allreduce), all int8; iterations 3-5 and 6-8
    ends = [10.0, 11.0, 12.5, 13.5, 14.0, 14.4, 14.9]  # iterations 2..8
    t.ends = {2 + k: v for k, v in enumerate(ends)}
    assert t.step_times() == pytest.approx([1.0, 0.5])
    saved = trial.saved(t)
    assert saved is None  # not kept yet: a trial cut short runs again after a load
    t.chosen, t.times_s = 1, [1.0, 0.5]
    back = trial.restored(trial.saved(t), measure_at=7)
    assert (back.chosen, back.plans, back.measure_at) == (1, t.plans, 7)
    assert back.path(0, 100) == "int8"
    assert "kept all int8" in trial.describe(back)


def test_explicit_trial_steps_refused_where_they_cannot_apply():
    import torch

    cfg = CompressionConfig(gradient_compression="int8", policy="auto", auto_trial_steps=2)
    with pytest.raises(
        ValueError, match="auto_trial_steps=2.*remove auto_trial_steps or set it to 0"
    ):
        trial.refuse_explicit(cfg, torch.device("cuda"))
    trial.refuse_explicit(
        CompressionConfig(gradient_compression="int8", policy="auto"), torch.device("cuda")
    )
    with pytest.raises(ValueError):
        CompressionConfig(gradient_compression="int8", auto_trial_steps=-1)


@pytest.mark.timeout(300)
def test_trial_keeps_the_fastest_plan_the_same_on_every_rank(tmp_path):
    """Every int8 chain sleeps 0.15 s (the two buckets run on two lanes at once): the trial must run each plan on its iterations, then
    keep a plan without int8, agreed by both ranks, and a state_dict keeps it."""
    per_rank = launcher.spawn_session(2, ["trial"], tmp_path, timeout_s=240,
                                      script=HERE.with_name("test_auto_trial_worker.py"))  # fmt: skip
    res = []
    for r, d in enumerate(per_rank):
        assert "exception" not in d["trial"], f"rank {r}:\n{d['trial']['exception']}"
        res.append(d["trial"])
    a = res[0]
    assert a["names"][0] == "model" and "all int8" in a["names"] and len(a["plans"]) >= 2
    size_of = {n: i for i, n in a["sizes"].items()}
    stop = a["start"] + a["steps"] * len(a["plans"])
    for it, numel, path in a["paths"]:
        if it < a["start"]:
            continue  # DDP's first layout, the measurement and decision steps
        idx = size_of[numel]
        k = (it - a["start"]) // a["steps"] if it < stop else a["chosen"]
        plan = a["plans"][k]
        want = plan[idx]
        if all(p in ("fp16", "bf16") for p in plan.values()):
            want = f"direct {want}"  # a step that casts every bucket: torch's order
        assert path == want, (it, idx, path, plan)
    assert any(it >= stop for it, _, _ in a["paths"])  # the kept plan ran
    assert "all bf16" in a["names"] and any(p.startswith("direct") for _, _, p in a["paths"])
    assert "int8" not in a["plans"][a["chosen"]].values(), a
    assert a["ef_bytes"] == 0  # the int8 residuals of the trial were freed with the plan
    assert a["times_s"][a["names"].index("all int8")] > min(a["times_s"]) + 0.1
    assert "kept" in a["note"] and a["restored"] == (a["chosen"], a["plans"])
    assert a["settling"][stop - 1] and not a["settling"][stop]
    for b in res[1:]:
        assert (b["chosen"], b["times_s"], b["plans"], b["hash"]) == (
            a["chosen"],
            a["times_s"],
            a["plans"],
            a["hash"],
        )
