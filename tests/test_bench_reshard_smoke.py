"""CI run of ``benchmarks/reshard.py --smoke`` (CPU gloo, 2 processes) into a temporary folder."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(300)
def test_reshard_benchmark_smoke(tmp_path):
    check_exit(run_smoke("reshard.py", tmp_path, timeout=280))
    every = read_jsonl(tmp_path / "reshard.jsonl")
    recs = [r for r in every if r["metric"] == "time_s"]
    counted = [r for r in every if r["metric"] == "bytes_counted_per_rank"]
    # beside each engine time record: the bytes counted at the transport calls
    assert sorted((r["train_layout"], r["method"]) for r in counted) == sorted(
        (r["train_layout"], r["method"]) for r in recs if r["method"].startswith("engine")
    )
    for r in counted:
        assert r["unit"] == "B" and r["counts_pairwise_mismatches"] == []
        assert r["value"] == r["bytes_planned_per_rank"] == r["lower_bound_bytes"], r
    pairs = {(r["train_layout"], r["rollout_layout"]) for r in recs}
    assert pairs == {("PP2", "TP2"), ("ZeRO3-DP2", "TP2"), ("DP2", "TP2")}
    assert {r["method"] for r in recs} == {"engine", "engine_p2p", "naive_allgather"}
    for r in recs:
        assert r["benchmark"] == "reshard" and r["unit"] == "s" and r["numerics_ok"]
        assert r["time_s"] > 0 and r["device"].startswith("cpu") and r["commit"] and r["date"]
        assert r["peak_extra_bytes"] > 0 and "torch" in r["versions"]
        assert r["repeats"] >= 5 and r["time_min_s"] <= r["time_s"] <= r["time_max_s"]
    by = {(r["train_layout"], r["method"]): r for r in recs}
    for train in ("PP2", "ZeRO3-DP2", "DP2"):
        eng, naive = by[(train, "engine")], by[(train, "naive_allgather")]
        assert eng["bytes_per_rank"] == eng["lower_bound_bytes"]
        assert eng["bytes_per_rank"] <= naive["bytes_per_rank"]
    # PP2 -> TP2: naive fetches the other stage; the engine only its TP half of it.
    assert (
        by[("PP2", "engine")]["bytes_per_rank"]
        < 0.6 * by[("PP2", "naive_allgather")]["bytes_per_rank"]
    )
    assert by[("DP2", "engine")]["bytes_per_rank"] == 0
    for r in recs:  # the engine's pack / wire / unpack split, each within its wall time
        if r["method"].startswith("engine"):
            assert all(0 <= r[k] <= r["time_s"] for k in ("pack_s", "wire_s", "unpack_s")), r
        else:
            assert r["wire_s"] is None
    md = (tmp_path / "reshard.md").read_text()
    assert "| PP2 -> TP2 | engine |" in md and "Targets" in md
