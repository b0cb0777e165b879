"""CI smoke run of benchmarks/default_job.py (tiny model, 2 seeds x 2 steps)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(900)
def test_default_job_smoke(tmp_path):
    r = run_smoke("default_job.py", tmp_path, timeout=880)
    check_exit(r, ok=(0, 1))  # 1 = target missed (a tiny random model)
    recs = read_jsonl(tmp_path / "default_job.smoke.jsonl")
    seeds = [x for x in recs if x["metric"] == "eval_gain"]
    assert [x["seed"] for x in seeds] == [0, 1]
    for x in seeds:
        assert x["config"] == "configs/default.yaml" and x["wall_s"] > 0 and x["cpu_s"] > 0
        assert x["summary_line"].startswith("done | eval ")
    assert len({x["run_id"] for x in recs}) == 1
    assert {x["step"] for x in recs if x["metric"] == "eval_reward"} == {0, 2}
    assert (tmp_path / "default_job.smoke.png").stat().st_size > 1000
    assert "Target: every seed" in (tmp_path / "default_job.smoke.md").read_text()
