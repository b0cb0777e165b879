"""CI smoke run of benchmarks/article_layout.py (4 gloo ranks, rollout TP4 from PP2 x DP2)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_article_layout_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/article_layout.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [
        json.loads(x) for x in (tmp_path / "article_layout.smoke.jsonl").read_text().splitlines()
    ]
    eng = {x["metric"]: x["value"] for x in recs if x["method"] == "engine"}
    naive = {x["metric"]: x["value"] for x in recs if x["method"] == "naive_allgather"}
    assert eng["reshard_bytes_per_rank"] == eng["lower_bound_bytes"] > 0
    assert naive["reshard_bytes_per_rank"] > eng["reshard_bytes_per_rank"]
