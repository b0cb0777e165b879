"""CI smoke run of benchmarks/article_layout.py (4 gloo ranks: PP2 x DP2 pipeline training, TP4 rollout)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(1500)
def test_article_layout_smoke(tmp_path):
    check_exit(run_smoke("article_layout.py", tmp_path, timeout=1480))
    recs = read_jsonl(tmp_path / "article_layout.smoke.jsonl")
    assert {x["train_engine"] for x in recs} == {"deepspeed_pipeline"}
    assert len({x["run_id"] for x in recs}) == 1
    eng = {x["metric"]: x["value"] for x in recs if x["method"] == "engine"}
    naive = {x["metric"]: x["value"] for x in recs if x["method"] == "naive_allgather"}
    # counted at the transport calls == planned == lower bound (means over ranks of integers)
    assert eng["bytes_counted_per_rank"] == eng["bytes_per_rank"] == eng["lower_bound_bytes"] > 0
    assert "bytes_counted_per_rank" not in naive  # the naive all-gather is not counted
    step = next(x for x in recs if x["method"] == "engine" and x["metric"] == "step_time")
    assert step["repeats"] == 1 and step["min"] <= step["value"] <= step["max"]
    assert step["phases_s"] and all(v >= 0 for v in step["phases_s"].values())
    assert eng["bytes_over_lower_bound"] == 1.0
    assert naive["bytes_per_rank"] > eng["bytes_per_rank"]
    assert 0 < eng["peak_param_bytes_per_rank"] < eng["full_param_bytes"]
    assert (
        "| 4 | PP2xDP2 | TP4xDP1 | engine |" in (tmp_path / "article_layout.smoke.md").read_text()
    )
