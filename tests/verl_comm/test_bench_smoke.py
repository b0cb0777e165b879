"""CI smoke run of the all-reduce benchmark: 2 spawned gloo processes, every collective and
method, tiny sweep; plus failure propagation from a rank (no hang)."""

from __future__ import annotations

import os

import pytest
import torch

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench import report
from verl_comm.bench.cli import main as bench_main


@pytest.mark.timeout(240)
def test_smoke_writes_tables_jsonl_md_png(tmp_path):
    out = tmp_path / "res"
    proc = run_smoke(
        "allreduce_latency.py",
        out,
        timeout=220,
        args=("--plot", str(out / "allreduce_latency.png")),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    check_exit(proc)
    text = proc.stdout
    assert text.startswith("# verl-comm bench allreduce")
    assert "# versions: torch" in text and "# topology:" in text and "# parameters:" in text
    assert text.count("# Avg bus bandwidth") == 12  # 4 all_reduce methods + 2 x 4 other ops
    assert "Out of bounds values : 0 OK" in text and "FAILED" not in text

    recs = report.read_jsonl(out / "allreduce_latency.jsonl")
    meas = report.measurements(recs)
    assert {r["collective"] for r in meas} == {
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "all_to_all",
        "broadcast",
    }
    ar_methods = {r["method"] for r in meas if r["collective"] == "all_reduce"}
    assert ar_methods == {"nccl_fp32", "nccl_bf16", "int8", "bare"}
    assert all(r["wrong"] == 0 for r in meas)
    for r in meas:
        for key in ("benchmark", "collective", "method", "transport", "bytes", "dtype"):
            assert r[key] is not None
        assert r["world_size"] == 2 and r["transport"] == "gloo"
        assert 0 < r["time_us_p50"] <= r["time_us_p99"] * (1 + 1e-9)
        assert r["busbw"] == pytest.approx(
            r["bytes"]
            / (r["time_us_p50"] * 1e-6)
            / 1e9
            * {"all_reduce": 1.0}.get(
                r["collective"], 0.5 if r["collective"] != "broadcast" else 1.0
            )
        )
    assert (out / "allreduce_latency.md").read_text().startswith("| collective")
    assert (out / "allreduce_latency.png").read_bytes()[:4] == b"\x89PNG"

    # regression guard against a doctored "old" run with 2x the bandwidth everywhere
    old = [dict(r, busbw=r["busbw"] * 2) for r in meas]
    report.write_jsonl(old, tmp_path / "old.jsonl")
    assert (
        bench_main(["compare", str(out / "allreduce_latency.jsonl"), str(tmp_path / "old.jsonl")])
        == 3
    )
    assert (
        bench_main(
            ["compare", str(out / "allreduce_latency.jsonl"), str(out / "allreduce_latency.jsonl")]
        )
        == 0
    )


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of nccl without CUDA")
def test_failing_rank_is_reported_not_hung(capsys):
    rc = bench_main(
        [
            "allreduce",
            "--backend",
            "nccl",
            "--nproc",
            "2",
            "-b",
            "8",
            "-e",
            "8",
            "--launch-timeout",
            "90",
        ]
    )
    assert rc == 4
    err = capsys.readouterr().err
    assert "rank" in err and "needs CUDA" in err
