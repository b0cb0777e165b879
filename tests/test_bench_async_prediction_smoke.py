"""CI run of ``benchmarks/async_prediction.py --smoke``: the GPU prediction from the
committed records, labelled as a prediction, checked against its own model."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(300)
def test_async_prediction_smoke(tmp_path):
    check_exit(run_smoke("async_prediction.py", tmp_path, timeout=280))
    recs = read_jsonl(tmp_path / "async_rollout.smoke.jsonl")
    assert {(r["gpus"], r["bound"]) for r in recs} == {
        (n, b) for n in (2, 4, 8) for b in ("linear", "overhead")
    }
    for r in recs:
        assert r["metric"] == "tokens_per_s_vs_colocated" and r["prediction"] is True
        assert r["train_gpus"] + r["rollout_gpus"] == r["gpus"]
        assert r["step_s"] == max(r["rollout_s"], r["train_s"])
        ratio = r["tokens_per_s_per_gpu"] / r["colocated_tokens_per_s_per_gpu"]
        assert r["value"] == pytest.approx(ratio, rel=1e-12)
    # generation that does not slow with the batch can only help: optimistic >= linear
    by = {(r["gpus"], r["bound"]): r["value"] for r in recs}
    assert all(by[(n, "overhead")] >= by[(n, "linear")] for n in (2, 4, 8))
    assert "PREDICTION (not measured)" in (tmp_path / "async_prediction.smoke.md").read_text()
