"""CI run of ``benchmarks/comm_hooks.py --smoke`` (CPU, gloo, 2 ranks) into a tmp folder."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(300)
def test_comm_hooks_smoke(tmp_path):
    check_exit(run_smoke("comm_hooks.py", tmp_path, timeout=280))
    recs = read_jsonl(tmp_path / "comm_hooks.jsonl")
    times = {r["hook"]: r for r in recs if r["metric"] == "step_time" and r["rank"] == "max"}
    # torch's bf16_compress_hook needs CUDA: every other method is measured on CPU
    expected = {
        "compute_only", "none", "torch_allreduce", "torch_powersgd_r32", "torch_powersgd_r128", "ours_bf16",
        "ours_int8", "ours_lowrank_int8_r32", "ours_lowrank_int8_r64",
        "ours_lowrank_int8_r128", "ours_auto", "reducer_none", "reducer_int8",
    }  # fmt: skip
    assert set(times) == expected
    assert len({r["run_id"] for r in recs}) == 1  # one run: every method side by side
    for r in recs:
        assert r["benchmark"] == "comm_hooks" and r["transport"] == "gloo"
        assert r["world_size"] == 2 and r["api"] == "public"
        assert r["device"].startswith("cpu") and r["commit"] and r["date"] and r["versions"]
    for h, r in times.items():
        assert r["numerics_ok"] and r["value"] > 0 and r["unit"] == "ms", h
        assert {x["rank"] for x in recs if x["hook"] == h and x["metric"] == "step_time"} == {
            "max", 0, 1,
        }  # fmt: skip
    assert times["ours_int8"]["non_default"] == {"gradient_compression": "int8"}
    assert times["torch_powersgd_r32"]["non_default"] == {
        "matrix_approximation_rank": 32, "start_powerSGD_iter": 2,
    }  # fmt: skip
    wire = {r["hook"]: r["value"] for r in recs if r["metric"] == "wire_bytes_per_step"}
    assert wire["compute_only"] == 0
    assert wire["ours_bf16"] * 2 == wire["none"]  # bf16 halves the fp32 ring bytes
    assert wire["torch_allreduce"] == wire["none"]  # the same fp32 all-reduce, from Python
    assert 0 < wire["ours_int8"] < 0.3 * wire["none"]  # int8 + scales ~0.26x fp32
    assert times["reducer_none"]["rel_error"] == 0 or times["reducer_none"]["rel_error"] < 1e-6
    lowrank = [h for h in times if "lowrank" in h]
    assert all(times[h]["reference"] == "float64 run of the same algorithm" for h in lowrank)
    md = (tmp_path / "comm_hooks.md").read_text()
    assert "| ours_int8 |" in md and "transport gloo" in md and recs[0]["run_id"] in md


@pytest.mark.timeout(300)
def test_two_gpu_launch_dry_run_on_cpu(tmp_path):
    """Issue 21's launch (one pass per transport label, 2 ranks) on CPU/gloo: the records
    carry world_size 2, their transport label and one run_id for both passes."""
    args = ("--transport", "nvlink,socket", "--methods", "none,ours_int8,ours_lowrank_int8_r32",
            "--rounds", "2")  # fmt: skip
    check_exit(run_smoke("comm_hooks.py", tmp_path, timeout=280, args=args))
    recs = read_jsonl(tmp_path / "comm_hooks.jsonl")
    assert {r["transport"] for r in recs} == {"nvlink", "socket"}
    assert {r["world_size"] for r in recs} == {2} and len({r["run_id"] for r in recs}) == 1
    assert {r["hook"] for r in recs} == {"none", "ours_int8", "ours_lowrank_int8_r32"}
