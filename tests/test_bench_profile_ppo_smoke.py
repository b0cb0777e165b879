"""``benchmarks/profile_ppo.py``: the CPU smoke run (2 gloo ranks, int8 gradients) and its
report: the profiled PPO steps are diagnosed, the records and the table are written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_profile_ppo_smoke_two_ranks_int8(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "benchmarks" / "profile_ppo.py"), "--smoke", "--out", str(tmp_path),
         "--set", "gradient_compression=int8"],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    run = tmp_path / "profile" / "cpux2_int8"
    assert {"report.txt", "report.json", "report.png", "profile_rank0.json",
            "profile_rank1.json"} <= {p.name for p in run.iterdir()}  # fmt: skip
    assert not list(run.glob("trace_rank*.json"))  # large traces removed unless --keep-traces
    doc = json.loads((run / "report.json").read_text())
    run_meta = doc["metrics"]["run"]
    assert run_meta["world_size"] == 2 and run_meta["ranks"] == 2  # rank 1's file waited for
    assert run_meta["missing_ranks"] == []
    comm = doc["metrics"]["comm"]
    # every profiled step compresses (warm-up covers start_iter): int8 hook records only
    assert {k.split()[0] for k in comm["by_tag"]} == {"int8", "bucket_reduce"}
    assert 0 < comm["bytes_total"] < comm["payload_bytes"]  # int8 wire bytes < fp32 payload
    phases = doc["metrics"]["phases"]
    # old_log_prob is absent: algorithm.old_log_prob=auto bypasses that forward with one
    # epoch and one mini-batch (the smoke shape), as the README table says
    assert {"gen", "ref", "values", "update_critic", "update_actor"} <= set(phases)
    assert "old_log_prob" not in phases
    recs = [json.loads(x) for x in (tmp_path / "profile_ppo.jsonl").read_text().splitlines()]
    by = {r["metric"]: r for r in recs}
    for key in ("benchmark", "metric", "value", "unit", "device", "versions", "date", "commit"):
        assert key in by["timing_s/step_p50"]
    assert by["timing_s/step_p50"]["benchmark"] == "profile_ppo"
    assert by["comm/share_of_step"]["value"] == pytest.approx(comm["share_of_step"])
    assert by["comm/bytes_total"]["value"] == comm["bytes_total"]
    md = (tmp_path / "profile_ppo.md").read_text()
    assert "| cpux2_int8 | cpu (2 processes) |" in md
