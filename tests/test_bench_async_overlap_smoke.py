"""``benchmarks/gpu/async_overlap.py``: the CPU smoke run (gloo, tiny model, 1 round: 1
training + 1 rollout process against 1 colocated) and the refusal of too few GPUs."""

import importlib.util
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
