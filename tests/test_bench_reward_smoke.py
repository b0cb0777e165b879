"""CI run of ``benchmarks/reward_latency.py --smoke`` (the real trainer loop, tiny policy)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(400)
def test_reward_latency_smoke(tmp_path):
    check_exit(run_smoke("reward_latency.py", tmp_path, timeout=380))
    recs = read_jsonl(tmp_path / "reward_latency.jsonl")
    got = {(r["mode"], r["metric"]) for r in recs}
    metrics = ("reward_exposed_s", "step_s", "gen_s", "scoring_s")
    want = {(m, k) for m in ("async", "sync") for k in metrics} | {("async/sync", "exposed_ratio")}
    assert got == want
    assert len({r["run_id"] for r in recs}) == 1
    for r in recs:
        assert r["benchmark"] == "reward_latency" and r["numerics_ok"] and r["value"] > 0
        assert r["device"].startswith("cpu") and r["commit"] and r["date"]
        assert {"torch", "transformers"} <= set(r["versions"])
    by = {(r["mode"], r["metric"]): r["value"] for r in recs}
    for m in ("async", "sync"):  # the reward phase is part of the measured step
        assert by[(m, "reward_exposed_s")] < by[(m, "step_s")]
    md = (tmp_path / "reward_latency.md").read_text()
    assert "| async |" in md and "| sync |" in md and "Exposed reward time" in md
