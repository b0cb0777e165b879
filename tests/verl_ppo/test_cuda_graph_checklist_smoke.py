"""CI smoke run of benchmarks/checklist.py (CPU, tiny model) into a tmp dir."""

from __future__ import annotations

import os

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(240)
def test_checklist_smoke(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": "", **os.environ}
    check_exit(run_smoke("checklist.py", tmp_path, timeout=230, env=env))
    rows = read_jsonl(tmp_path / "checklist.jsonl")
    got = {(x["item"], x["method"]) for x in rows}
    assert got == {
        ("rollout", "eager_dynamic_cache"),
        ("rollout", "static_cache"),
        ("train_fwd_bwd", "padded"),
        ("train_fwd_bwd", "packed"),
    }
    for x in rows:
        assert x["metric"] == "tokens_per_s" and x["value"] > 0 and x["unit"].startswith("tokens/s")
        for k in ("benchmark", "device", "versions", "date", "commit"):
            assert x[k]
    assert x["numerics"]["rollout_rel_err_static"] < 1e-4
    assert x["numerics"]["logp_abs_err_packed"] < 1e-4
    assert "| rollout | static_cache |" in (tmp_path / "checklist.md").read_text()
