"""CI smoke runs of benchmarks/reward_curve.py and benchmarks/compression_effect.py."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(900)
def test_reward_curve_smoke(tmp_path):
    check_exit(run_smoke("reward_curve.py", tmp_path, timeout=880))
    recs = read_jsonl(tmp_path / "reward_curve.smoke.jsonl")
    assert {x["metric"] for x in recs} >= {"reward_mean", "eval_reward"}
    assert (tmp_path / "reward_curve.smoke.png").stat().st_size > 1000


@pytest.mark.timeout(900)
def test_compression_effect_smoke(tmp_path):
    r = run_smoke("compression_effect.py", tmp_path, timeout=880)
    check_exit(r, ok=(0, 1))  # 1 = learned worse (a finding, not a crash)
    recs = read_jsonl(tmp_path / "compression_effect.smoke.jsonl")
    ratio = [x["value"] for x in recs if x["metric"] == "compression_ratio"]
    assert {x["gradient_compression"] for x in recs} == {"none", "int8"}
    assert max(ratio) > 3.0  # int8 really compressed the actor's gradients
