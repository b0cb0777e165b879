"""CI smoke run of benchmarks/async_learning.py (tiny model, 1 seed x 2 steps, async mode)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(900)
def test_async_learning_smoke(tmp_path):
    r = run_smoke("async_learning.py", tmp_path, timeout=880)
    check_exit(r, ok=(0, 1))  # 1 = target missed (a tiny random model)
    (rec,) = read_jsonl(tmp_path / "async_rollout.smoke.jsonl")
    assert rec["metric"] == "eval_gain" and rec["benchmark"] == "async_rollout"
    assert rec["staleness_per_step"] == [0.0, 1.0]  # batch 1 from the weights of step 0
    assert rec["eval_end"] - rec["eval_start"] == pytest.approx(rec["value"])
    first, second = rec["sync_bytes_sent_per_rank"]
    assert second < first  # delta after the first full sync
    assert "Target (issue 31)" in (tmp_path / "async_learning.smoke.md").read_text()
