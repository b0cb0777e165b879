"""CI smoke runs of benchmarks/reward_curve.py and benchmarks/compression_effect.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script, tmp_path):
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=880,
    )


@pytest.mark.timeout(900)
def test_reward_curve_smoke(tmp_path):
    r = _run("reward_curve.py", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "reward_curve.smoke.jsonl").read_text().splitlines()]
    assert {x["metric"] for x in recs} >= {"reward_mean", "eval_reward"}
    assert (tmp_path / "reward_curve.smoke.png").stat().st_size > 1000


@pytest.mark.timeout(900)
def test_compression_effect_smoke(tmp_path):
    r = _run("compression_effect.py", tmp_path)
    assert r.returncode in (0, 1), r.stderr[-2000:]  # 1 = learned worse (a finding, not a crash)
    recs = [
        json.loads(x)
        for x in (tmp_path / "compression_effect.smoke.jsonl").read_text().splitlines()
    ]
    ratio = [x["value"] for x in recs if x["metric"] == "compression_ratio"]
    assert {x["gradient_compression"] for x in recs} == {"none", "int8"}
    assert max(ratio) > 3.0  # int8 really compressed the actor's gradients
