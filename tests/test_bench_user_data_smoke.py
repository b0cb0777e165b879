"""CI run of ``benchmarks/user_data.py --smoke``: parquet start-up, a slow custom reward in a
process pool, and the tiny job from exported files against the built-in task."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(600)
def test_user_data_smoke(tmp_path):
    check_exit(run_smoke("user_data.py", tmp_path, timeout=580))
    recs = read_jsonl(tmp_path / "user_data.jsonl")
    assert len({r["run_id"] for r in recs}) == 1 and {r["part"] for r in recs} == {
        "load", "reward", "job"
    }  # fmt: skip
    for r in recs:
        assert r["benchmark"] == "user_data" and r["numerics_ok"] and r["smoke"]
        assert r["commit"] and r["date"] and "torch" in r["versions"]
    by = {(r["metric"], r["mode"]): r for r in recs}
    added = next(r for r in recs if r["metric"] == "startup_added_s")
    assert added["value"] > 0 and added["target"] == 10.0
    one, pool = by["reward_exposed_s", "workers_1"], by["reward_exposed_s", "workers_8"]
    # one worker: the last chunk's 8 responses x 50 ms are exposed, at the least
    assert one["value"] >= 8 * 0.05 and pool["value"] < one["value"]
    assert by["max_abs_reward_diff", "files vs builtin"]["value"] == 0.0
    md = (tmp_path / "user_data.md").read_text()
    assert "startup_added_s" in md and "reward_exposed_s" in md and "job `files`" in md
