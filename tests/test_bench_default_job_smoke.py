"""CI smoke run of benchmarks/default_job.py (tiny model, 2 seeds x 2 steps)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_default_job_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/default_job.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert r.returncode in (0, 1), r.stderr[-3000:]  # 1 = target missed (a tiny random model)
    recs = [json.loads(x) for x in (tmp_path / "default_job.smoke.jsonl").read_text().splitlines()]
    seeds = [x for x in recs if x["metric"] == "eval_gain"]
    assert [x["seed"] for x in seeds] == [0, 1]
    for x in seeds:
        assert x["config"] == "configs/default.yaml" and x["wall_s"] > 0 and x["cpu_s"] > 0
        assert x["summary_line"].startswith("done | eval ")
    assert len({x["run_id"] for x in recs}) == 1
    assert {x["step"] for x in recs if x["metric"] == "eval_reward"} == {0, 2}
    assert (tmp_path / "default_job.smoke.png").stat().st_size > 1000
    assert "Target (issue 17)" in (tmp_path / "default_job.smoke.md").read_text()
