"""CI run of ``benchmarks/reward_latency.py --smoke`` into a temporary folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_reward_latency_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "reward_latency.py"), "--smoke", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    recs = [
        json.loads(line) for line in (tmp_path / "reward_latency.jsonl").read_text().splitlines()
    ]
    got = {(r["mode"], r["metric"]) for r in recs}
    modes = ("remote", "local", "local_async", "cached")
    assert got == {(m, k) for m in modes for k in ("latency_mean_ms", "latency_p99_ms")}
    for r in recs:
        assert r["benchmark"] == "reward_latency" and r["unit"] == "ms" and r["numerics_ok"]
        assert r["value"] > 0 and r["device"].startswith("cpu") and r["commit"] and r["date"]
        assert {"torch", "transformers"} <= set(r["versions"])
    by = {(r["mode"], r["metric"]): r["value"] for r in recs}
    # Cache hits skip the model: far below a model forward, whatever the machine load.
    assert by[("cached", "latency_mean_ms")] < by[("local", "latency_mean_ms")]
    md = (tmp_path / "reward_latency.md").read_text()
    assert "| local_async |" in md and "Target local_async" in md
