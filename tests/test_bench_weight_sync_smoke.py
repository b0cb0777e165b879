"""CI run of ``benchmarks/weight_sync.py --smoke`` (4 gloo processes, loopback)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(400)
def test_weight_sync_benchmark_smoke(tmp_path):
    check_exit(run_smoke("weight_sync.py", tmp_path, timeout=380))
    recs = read_jsonl(tmp_path / "async_rollout.jsonl")
    assert {r["metric"] for r in recs} == {"pause_vs_transfer", "delta_bytes_vs_full"}
    assert {(r["round"], r["wire"]) for r in recs} == {
        (k, w) for k in range(3) for w in ("full", "delta")
    }
    for r in recs:
        assert r["benchmark"] == "async_rollout" and r["numerics_ok"] and r["unit"] == "ratio"
        assert r["commit"] and r["date"] and r["run_id"] and "torch" in r["versions"]
        assert r["value"] >= 0 and r["bytes"] > 0 and 0 < r["transfer_s"] and r["wall_s"] > 0
    first = [r for r in recs if r["metric"] == "delta_bytes_vs_full" and r["first_sync"]]
    assert first[0]["value"] == 1.0  # the first delta sync is a full one
    later = [r for r in recs if r["metric"] == "delta_bytes_vs_full" and not r["first_sync"]]
    assert all(0 < r["value"] < 1 for r in later)  # lr 1e-6: a few percent of bf16 change
    assert "| delta | delta_bytes_vs_full |" in (tmp_path / "async_rollout.md").read_text()
