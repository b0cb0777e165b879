"""CI smoke run of benchmarks/checklist.py (CPU, tiny model) into a tmp dir."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_checklist_smoke(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "checklist.py"),
            "--smoke",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env={"CUDA_VISIBLE_DEVICES": "", **__import__("os").environ},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "checklist.jsonl").read_text().splitlines()]
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
