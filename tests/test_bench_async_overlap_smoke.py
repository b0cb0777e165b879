"""CI smoke run of benchmarks/gpu/async_overlap.py (CPU, gloo, tiny model, 1 round)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


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
    spread = next(x for x in recs if x["workload"] == "spread")
    steps = [s for run in spread["raw"] for s in run["steps"]]
    # EOS forced at lengths in the smoke's 2..16: shorter on average, not all at the cap
    assert all(s["response/length_mean"] < 16 and s["response/clip_ratio"] < 1 for s in steps)
    assert "async / colocated" in (tmp_path / "async_overlap.smoke.md").read_text()
