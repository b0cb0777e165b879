"""CI smoke run of benchmarks/article_layout.py (4 gloo ranks: PP2 x DP2 pipeline training, TP4 rollout)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1500)
def test_article_layout_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/article_layout.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1480,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [
        json.loads(x) for x in (tmp_path / "article_layout.smoke.jsonl").read_text().splitlines()
    ]
    assert {x["train_engine"] for x in recs} == {"deepspeed_pipeline"}
    assert len({x["run_id"] for x in recs}) == 1
    eng = {x["metric"]: x["value"] for x in recs if x["method"] == "engine"}
    naive = {x["metric"]: x["value"] for x in recs if x["method"] == "naive_allgather"}
    assert eng["bytes_per_rank"] == eng["lower_bound_bytes"] > 0
    assert eng["bytes_over_lower_bound"] == 1.0
    assert naive["bytes_per_rank"] > eng["bytes_per_rank"]
    assert 0 < eng["peak_param_bytes_per_rank"] < eng["full_param_bytes"]
    assert (
        "| 4 | PP2xDP2 | TP4xDP1 | engine |" in (tmp_path / "article_layout.smoke.md").read_text()
    )
