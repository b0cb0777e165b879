"""CI smoke run of benchmarks/checkpoint_bytes.py (tiny model, one rank)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(600)
def test_checkpoint_bytes_smoke(tmp_path):
    check_exit(run_smoke("checkpoint_bytes.py", tmp_path, timeout=580))
    recs = read_jsonl(tmp_path / "checkpoint_bytes.smoke.jsonl")
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
