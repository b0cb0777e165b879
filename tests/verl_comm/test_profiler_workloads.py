"""Synthetic PPO-like workloads with injected delays on 2 gloo ranks: the report must
attribute each injected delay within 10% and name the right symptom; a clean workload
must yield no diagnosis.

The ranks run :func:`_worker` of this file through the library launcher
(:func:`verl_comm.distributed.launch.spawn`); each rank writes one profile per workload into
a folder.

Ground truth is measured by the workload itself (``perf_counter`` around each injected
delay). On a shared, overloaded machine a ``sleep`` can overshoot by tens of ms, which
makes a "clean" workload genuinely jittery (so can a 4 KB gloo all-reduce that stalls for
tens of ms); a workload whose sleeps overshot, or whose small all-reduce took, more than
``DISTURBED_S`` on any rank is run again (up to ``ATTEMPTS`` times), and its tests are
skipped, saying so, only if every attempt was disturbed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from verl_comm.distributed.launch import spawn

STEPS = 10
GEN_S = 0.05
REWARD_SLEEP_S = 0.12
JITTER_S = 0.25
JITTER_STEPS = (3, 7)
SLOW_GEN_S = 0.25
SLOW_GEN_STEP = 5
UPDATE_S = 0.06  # stands for forward/backward compute (a sleep: steady on a busy CPU)
BIG_NUMEL = 16_000_000  # 64 MB fp32 all-reduce on gloo: ~50-150 ms on a busy CPU
DISTURBED_S = 0.02  # below 10% of every injected delay, far below the symptom limits
ATTEMPTS = 3


class _Naps:
    """``time.sleep`` with the actual duration measured (ground truth and disturbance)."""

    def __init__(self) -> None:
        self.overshoot = 0.0

    def __call__(self, seconds: float) -> float:
        t0 = time.perf_counter()
        time.sleep(seconds)
        took = time.perf_counter() - t0
        self.overshoot = max(self.overshoot, took - seconds)
        return took


def _workload(name: str, out: Path, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from verl_comm.profiler import VerlProfiler

    prof = VerlProfiler(output_dir=out / name)
    rec = prof.recorder
    small = torch.ones(1024)
    big = torch.ones(BIG_NUMEL) if name == "big_allreduce" else None
    w = torch.randn(64, 64)
    nap = _Naps()
    truth: dict[str, list[float]] = {
        "all_reduce_s": [],
        "reward_s": [],
        "jitter_s": [],
        "gen_s": [],
    }
    dist.barrier()
    with prof:
        for step in range(STEPS):
            with prof.phase("gen"):
                slow = name == "slow_rollout" and step == SLOW_GEN_STEP
                truth["gen_s"].append(nap(SLOW_GEN_S if slow else GEN_S))
            with prof.phase("reward"):
                truth["reward_s"].append(nap(REWARD_SLEEP_S if name == "reward_sleep" else 0.002))
            with prof.phase("update_actor"):
                (w @ w).sum()
                # the oversized all-reduce dwarfs a short backward on any machine speed
                nap(UPDATE_S if big is None else 0.01)
                if name == "jitter" and step in JITTER_STEPS:
                    truth["jitter_s"].append(nap(JITTER_S))
                t = big if big is not None else small
                t0 = time.perf_counter()
                with rec.timed("all_reduce", t.numel() * 4, world, "hook/none"):
                    dist.all_reduce(t)
                took = time.perf_counter() - t0
                truth["all_reduce_s"].append(took)
                if big is None:  # a 4 KB all-reduce slower than DISTURBED_S: a stalled machine
                    nap.overshoot = max(nap.overshoot, took)
            prof.step()
    return {**truth, "overshoot_s": nap.overshoot}


def _worker(rank: int, world: int, out: Path, names: list[str]) -> None:
    """One rank, in the gloo group (60 s timeout) ``spawn`` made: each workload of ``names``,
    its ground truth written to ``out/measured_rank{rank}.json``."""
    measured = {n: _workload(n, out, rank, world) for n in names}
    (out / f"measured_rank{rank}.json").write_text(json.dumps(measured))


WORKLOADS = ["clean", "reward_sleep", "big_allreduce", "jitter", "slow_rollout"]


def _spawn(out: Path, names: list[str]) -> None:
    spawn(_worker, 2, (out, names), timeout_s=60, deadline_s=150, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """name -> (run folder, rank-0 ground truth, disturbance in s) of the least disturbed attempt."""
    best: dict[str, tuple[Path, dict, float]] = {}
    todo = list(WORKLOADS)
    for attempt in range(ATTEMPTS):
        out = tmp_path_factory.mktemp(f"profiles{attempt}")
        _spawn(out, todo)
        truth = [json.loads((out / f"measured_rank{r}.json").read_text()) for r in range(2)]
        for name in todo:
            overshoot = max(t[name]["overshoot_s"] for t in truth)
            if name not in best or overshoot < best[name][2]:
                best[name] = (out / name, truth[0][name], overshoot)
        todo = [n for n in WORKLOADS if best[n][2] > DISTURBED_S]
        if not todo:
            break
    return best


def _get(profiled, name: str) -> tuple[dict, dict]:
    path, truth, overshoot = profiled[name]
    if overshoot > DISTURBED_S:
        pytest.skip(
            f"machine too loaded: in {ATTEMPTS} attempts the '{name}' workload's sleeps "
            f"overshot by {overshoot * 1e3:.0f} ms (> {DISTURBED_S * 1e3:.0f} ms)"
        )
    return _report(path), truth


def _report(path: Path) -> dict:
    from verl_comm.profiler.cli import report

    (res,) = report(path)
    return res


@pytest.mark.timeout(600)
def test_clean_workload_has_no_diagnosis(profiled):
    res, truth = _get(profiled, "clean")
    assert res["diagnosis"]["found"] == [], res["diagnosis"]
    m = res["metrics"]
    assert m["steps"]["n"] == STEPS and m["run"]["ranks"] == 2
    assert m["phases"]["gen"]["per_step_s"] == pytest.approx(sum(truth["gen_s"]) / STEPS, rel=0.1)


@pytest.mark.timeout(600)
def test_reward_sleep_is_attributed_and_named(profiled):
    res, truth = _get(profiled, "reward_sleep")
    injected = sum(truth["reward_s"]) / STEPS
    assert injected == pytest.approx(REWARD_SLEEP_S, rel=0.1)
    m = res["metrics"]
    assert m["phases"]["reward"]["per_step_s"] == pytest.approx(injected, rel=0.1)
    assert m["host_share"] > 0.3
    assert 2 in res["diagnosis"]["found"]
    assert 3 not in res["diagnosis"]["found"]
    sym = res["diagnosis"]["symptoms"][1]
    assert "reward" in sym["evidence"] and any("async" in r for r in sym["remedy"])


@pytest.mark.timeout(600)
def test_oversized_allreduce_is_attributed_and_named(profiled):
    res, truth = _get(profiled, "big_allreduce")
    injected = sum(truth["all_reduce_s"]) / STEPS
    m = res["metrics"]
    assert m["comm"]["per_step_s"] == pytest.approx(injected, rel=0.1)
    assert m["comm"]["bytes_total"] == STEPS * BIG_NUMEL * 4
    assert m["comm"]["torch_ops"]  # torch's own c10d/gloo records were read too
    # ... with their bytes (record_shapes on CPU): the big all-reduce and small ones
    assert STEPS * BIG_NUMEL * 4 <= m["comm"]["torch_input_bytes"] < 1.01 * STEPS * BIG_NUMEL * 4
    assert 3 in res["diagnosis"]["found"], res["diagnosis"]["symptoms"][2]["evidence"]
    assert 2 not in res["diagnosis"]["found"]
    assert any("int8" in r for r in res["diagnosis"]["symptoms"][2]["remedy"])


@pytest.mark.timeout(600)
def test_jittery_step_is_attributed_and_named(profiled):
    res, truth = _get(profiled, "jitter")
    assert 1 in res["diagnosis"]["found"]
    v = res["diagnosis"]["symptoms"][0]["values"]
    assert v["slowest_step"] in JITTER_STEPS
    assert v["excess_phase"] == "update_actor"
    injected = truth["jitter_s"][JITTER_STEPS.index(v["slowest_step"])]
    assert v["slowest_excess_s"] == pytest.approx(injected, rel=0.1)
    assert v["excess_phase_s"] == pytest.approx(injected, rel=0.1)
    assert 3 not in res["diagnosis"]["found"] and 2 not in res["diagnosis"]["found"]


@pytest.mark.timeout(600)
def test_slow_rollout_is_named(profiled):
    res, truth = _get(profiled, "slow_rollout")
    assert 4 in res["diagnosis"]["found"]
    r = res["metrics"]["rollout"]
    assert r["max"] == pytest.approx(truth["gen_s"][SLOW_GEN_STEP], rel=0.1)
    assert r["p50"] == pytest.approx(GEN_S, rel=0.1)
    assert any("resharding" in c for c in res["diagnosis"]["symptoms"][3]["likely_causes"])


@pytest.mark.timeout(600)
def test_report_cli_json_text_png_and_chrome_trace(profiled, capsys):
    from verl_comm.profiler.cli import main

    first = profiled["big_allreduce"][0].parent
    runs = sorted(p.parent.name for p in first.glob("*/profile_rank0.json"))
    assert main(["report", str(first), "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert sorted(Path(d["run"]["dir"]).name for d in docs) == runs
    assert main(["report", str(first)]) == 0
    text = capsys.readouterr().out
    assert "=== runs compared" in text and text.count("=== profile report") == len(runs)
    run = profiled["big_allreduce"][0]
    assert main(["report", str(run), "--save"]) == 0
    text = capsys.readouterr().out
    assert "diagnosis:" in text and "3. communication-bound" in text
    assert (run / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "found" in json.loads((run / "report.json").read_text())["diagnosis"]
    trace = json.loads((run / "trace_rank1.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"phase::gen", "phase::reward", "phase::update_actor"} <= names
    assert all("ph" in e for e in trace["traceEvents"])
