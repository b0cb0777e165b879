"""``benchmarks/gpu/async_overlap.py``: the CPU smoke runs (gloo, tiny model, 1 round) at
``--gpus 1`` (1 training + 1 rollout process against 1 colocated) and ``--gpus 2`` (against 2
colocated ranks, both wires), the refusal of too few GPUs, and the sync pairing."""

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "async_overlap_bench", REPO / "benchmarks" / "gpu" / "async_overlap.py"
)
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)
from _overlap_sync import versions  # noqa: E402  (on sys.path once the benchmark is loaded)


@pytest.mark.timeout(600)
def test_async_overlap_smoke(tmp_path):
    r = run_smoke("gpu/async_overlap.py", tmp_path, timeout=580)
    check_exit(r)
    recs = read_jsonl(tmp_path / "async_rollout.smoke.jsonl")
    assert {x["workload"] for x in recs} == {"fixed", "spread"}
    for x in recs:
        assert x["metric"] == "tokens_per_s_vs_colocated" and x["numerics_ok"]
        assert x["value"] == pytest.approx(x["async_tokens_per_s"] / x["colocated_tokens_per_s"])
        assert x["async_staleness_max"] <= 1
        assert x["gpus"] == 1 and x["sync_wire"] == "full"
        assert x["async_overrides"]["rollout.sync_wire"] == "full"
    spread = next(x for x in recs if x["workload"] == "spread")
    steps = [s for run in spread["raw"] for s in run["steps"]]
    # EOS forced at lengths in the smoke's 2..16: shorter on average, not all at the cap
    assert all(s["response/length_mean"] < 16 and s["response/clip_ratio"] < 1 for s in steps)
    assert "async / colocated" in (tmp_path / "async_overlap.smoke.md").read_text()


NEW_FIELDS = (
    "colocated_tokens_per_s_per_gpu", "async_tokens_per_s_per_gpu", "colocated_step_s_median",
    "async_step_s_median", "sync_pause_s_median", "pause_vs_step", "sync_own_pause_vs_step",
    "sync_bytes_first", "sync_bytes_median", "sync_time_s_median", "link_bytes_per_s",
    "sync_line_s_median", "sync_time_vs_line_rate",
)  # fmt: skip


@pytest.mark.timeout(600)
def test_async_overlap_smoke_two_gpus(tmp_path):
    """``--gpus 2`` on the CPU: colocated 2 ranks vs async 1 + 1, full and delta wires."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the smoke is the CPU's, always
    check_exit(
        run_smoke("gpu/async_overlap.py", tmp_path, timeout=580, args=["--gpus", "2"], env=env)
    )
    recs = read_jsonl(tmp_path / "async_rollout.smoke.jsonl")
    assert sorted(x["sync_wire"] for x in recs) == ["delta", "full"]
    assert len({x["run_id"] for x in recs}) == 1
    for x in recs:
        assert x["gpus"] == 2 and x["workload"] == "fixed" and x["numerics_ok"]
        assert x["async_overrides"]["rollout.sync_wire"] == x["sync_wire"]
        for k in NEW_FIELDS:
            assert isinstance(x[k], float) and math.isfinite(x[k]) and x[k] >= 0, (k, x[k])
        colo, run = x["raw"][0], x["raw"][1]
        assert colo["training_ranks"] == 2 and run["training_ranks"] == 1
        assert x["colocated_tokens_per_s_per_gpu"] == pytest.approx(x["colocated_tokens_per_s"] / 2)
        (link,) = x["link"]
        assert link["transport"] == "gloo" and link["bytes"] == 4 << 20
        assert x["sync_versions"][0][0]["version"] == 0 and len(x["sync_versions"][0]) == 3
    full, delta = sorted(recs, key=lambda x: x["sync_wire"] != "full")
    assert full["sync_changed_frac_median"] == 1.0 and "delta_bytes_vs_full" not in full
    assert delta["full_bytes"] == full["sync_bytes_median"] == delta["sync_bytes_first"]
    assert 0 < delta["delta_bytes_vs_full"] < 1 and delta["full_bytes_from"] == "full wire launches"
    md = (tmp_path / "async_overlap.smoke.md").read_text()
    assert "sync_time_vs_line_rate" in md and "delta_bytes_vs_full" in md
    assert md.count("**met**") + md.count("**missed**") == 9


def test_refuses_too_few_gpus(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(bench, "run_ranks", launch)
    assert bench.main(["--gpus", "2", "--out", str(tmp_path)]) == 2
    assert "--gpus 2 needs 2 visible GPUs, this machine shows 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_gpu_env_first_visible(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,0,2")
    assert bench._gpu_env(2) == ({"CUDA_VISIBLE_DEVICES": "3,1"}, None)
    assert bench._gpu_env(1) == ({"CUDA_VISIBLE_DEVICES": "3"}, None)


def test_sync_versions_pairing():
    """Step k publishes version k; a batch's pause/transfer are those of its version's
    switch, counted once; the last version has bytes only."""
    steps = [
        {"async/sync_bytes_sent": 100.0, "async/weights_version": 0.0,
         "async/sync_pause_s": 5.0, "async/sync_transfer_s": 1.0},
        {"async/sync_bytes_sent": 10.0, "async/weights_version": 0.0,
         "async/sync_pause_s": 5.0, "async/sync_transfer_s": 1.0},
        {"async/sync_bytes_sent": 12.0, "async/weights_version": 1.0,
         "async/sync_pause_s": 0.5, "async/sync_transfer_s": 0.2},
    ]  # fmt: skip
    got = versions({"steps": steps, "training_ranks": 2})
    assert [v["version"] for v in got] == [0, 1, 2]
    assert [v["bytes"] for v in got] == [200.0, 20.0, 24.0]
    assert [v["pause_s"] for v in got] == [5.0, 0.5, None]
    assert [v["transfer_s"] for v in got] == [1.0, 0.2, None]
