"""CI smoke run of benchmarks/checkpoint_bytes.py (tiny model, one rank)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_checkpoint_bytes_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_bytes.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [
        json.loads(x) for x in (tmp_path / "checkpoint_bytes.smoke.jsonl").read_text().splitlines()
    ]
    assert len({x["run_id"] for x in recs}) == 1
    roles = {x["role"]: x for x in recs if x["metric"] == "role_bytes"}
    assert set(roles) == {"actor"}  # the default job is GRPO: no critic
    for x in roles.values():
        # weights + two AdamW moments, plus pickle framing well under 1%
        assert 0 <= x["overhead_bytes"] < 0.01 * x["floor_bytes"], x
    total = next(x["value"] for x in recs if x["metric"] == "checkpoint_bytes")
    assert total >= sum(x["value"] for x in roles.values())
    assert next(x["value"] for x in recs if x["metric"] == "hf_export_bytes") > 0
    assert "| **whole checkpoint** |" in (tmp_path / "checkpoint_bytes.smoke.md").read_text()
