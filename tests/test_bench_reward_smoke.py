"""CI run of ``benchmarks/reward_latency.py --smoke`` (the real trainer loop, tiny policy)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_reward_latency_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "reward_latency.py"), "--smoke", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=380, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = [
        json.loads(line) for line in (tmp_path / "reward_latency.jsonl").read_text().splitlines()
    ]
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
