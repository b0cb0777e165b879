"""``benchmarks/profile_ppo.py``: the CPU smoke run (2 gloo ranks, int8 gradients) and its
report: the profiled PPO steps are diagnosed, the records and the table are written."""

import json

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(300)
def test_profile_ppo_smoke_two_ranks_int8(tmp_path):
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    args = ("--set", "gradient_compression=int8")
    check_exit(run_smoke("profile_ppo.py", tmp_path, timeout=280, args=args, launcher=torchrun))
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
    recs = read_jsonl(tmp_path / "profile_ppo.jsonl")
    by = {r["metric"]: r for r in recs}
    for key in ("benchmark", "metric", "value", "unit", "device", "versions", "date", "commit"):
        assert key in by["timing_s/step_p50"]
    assert by["timing_s/step_p50"]["benchmark"] == "profile_ppo"
    assert by["comm/share_of_step"]["value"] == pytest.approx(comm["share_of_step"])
    assert by["comm/bytes_total"]["value"] == comm["bytes_total"]
    md = (tmp_path / "profile_ppo.md").read_text()
    assert "| cpux2_int8 | cpu (2 processes) |" in md
