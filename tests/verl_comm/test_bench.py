"""Tests of verl_comm.bench: pure helpers, closed forms, report/compare/summary, CLI errors."""

from __future__ import annotations

import datetime as dt
import json
import math

import pytest
import torch
import torch.distributed as dist

from verl_comm.bench import report, summary
from verl_comm.bench.cli import main as bench_main
from verl_comm.bench.ops import Unsupported, build_case, expected_output, pattern
from verl_comm.bench.sweep import (
    bandwidths,
    busbw_factor,
    element_count,
    iterations_for_budget,
    latency_stats,
    parse_size,
    size_sweep,
)
from verl_comm.distributed.launch import free_port

MiB = 1 << 20


@pytest.mark.parametrize(
    "text,value",
    [("8", 8), ("64K", 65536), ("1M", MiB), ("1G", 1 << 30), ("512MiB", 512 * MiB), (4096, 4096)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "0", "1T", "-5"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="-b/--minbytes"):
        parse_size(text, "-b/--minbytes")


def test_size_sweep_nccl_tests_style():
    assert size_sweep(8, 128, 2) == [8, 16, 32, 64, 128]
    assert size_sweep(8, 100, 4) == [8, 32]
    assert size_sweep(1 << 30, 1 << 30, 2) == [1 << 30]
    assert len(size_sweep(8, 1 << 30, 2)) == 28
    with pytest.raises(ValueError, match="maxbytes"):
        size_sweep(64, 8, 2)
    with pytest.raises(ValueError, match="stepfactor"):
        size_sweep(8, 64, 1.0)


def test_busbw_factors_match_nccl_tests():
    assert busbw_factor("all_reduce", 2) == 1.0
    assert busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert busbw_factor("reduce_scatter", 8) == pytest.approx(0.875)
    assert busbw_factor("all_gather", 4) == pytest.approx(0.75)
    assert busbw_factor("all_to_all", 4) == pytest.approx(0.75)
    assert busbw_factor("broadcast", 8) == 1.0
    algbw, busbw = bandwidths("all_reduce", 512 * MiB, 1.82e-3, 2)
    assert algbw == pytest.approx(512 * MiB / 1.82e-3 / 1e9)
    assert busbw == pytest.approx(
        algbw
    )  # 2 ranks: factor 1; 512 MiB in 1.82 ms measured on 2x H200 NVLink
    assert 290 < busbw < 300
    assert all(math.isnan(x) for x in bandwidths("all_reduce", 8, 0.0, 2))


def test_element_count_rounds_to_world_multiple():
    assert element_count("all_reduce", 8, 4, 3) == 2
    assert element_count("reduce_scatter", 40, 4, 3) == 9
    assert element_count("all_gather", 8, 4, 4) == 0
    with pytest.raises(ValueError, match="--op"):
        element_count("allreduce", 8, 4, 2)


def test_latency_stats_and_budget():
    s = latency_stats([1e-6 * x for x in range(1, 101)])
    assert s["time_us_mean"] == pytest.approx(50.5)
    assert s["time_us_p50"] == pytest.approx(50.5)
    assert s["time_us_p99"] == pytest.approx(99.01)
    with pytest.raises(ValueError):
        latency_stats([])
    assert iterations_for_budget(50, 0.25, 1.2, 3) == 4
    assert iterations_for_budget(50, 0.5, 1.2, 3) == 3
    assert iterations_for_budget(50, 1e-5, 1.2, 3) == 50
    assert iterations_for_budget(50, 0.5, None, 3) == 50


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_closed_forms_match_simulated_collectives(world, dtype):
    count = 6 * world
    c = count // world
    inputs = [pattern(r, 0, count, dtype, "cpu") for r in range(world)]
    total = sum(x.to(torch.int64) for x in inputs)
    for r in range(world):
        assert torch.equal(
            expected_output("all_reduce", r, world, count, dtype, "cpu"), total.to(dtype)
        )
        assert torch.equal(
            expected_output("reduce_scatter", r, world, count, dtype, "cpu"),
            total[r * c : (r + 1) * c].to(dtype),
        )
        gathered = torch.cat([pattern(s, 0, c, dtype, "cpu") for s in range(world)])
        assert torch.equal(expected_output("all_gather", r, world, count, dtype, "cpu"), gathered)
        a2a = torch.cat([inputs[s][r * c : (r + 1) * c] for s in range(world)])
        assert torch.equal(expected_output("all_to_all", r, world, count, dtype, "cpu"), a2a)
        assert torch.equal(expected_output("broadcast", r, world, count, dtype, "cpu"), inputs[0])


@pytest.fixture
def single_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=dt.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"]
)
@pytest.mark.parametrize("method", ["nccl_fp32", "nccl_bf16"])
@pytest.mark.parametrize("inplace", [False, True])
def test_case_check_detects_corruption(single_rank_group, op, method, inplace):
    try:
        case = build_case(op, method, inplace, 12, torch.float32, torch.device("cpu"))
    except Unsupported as exc:
        assert (op, inplace) in {("all_to_all", True), ("broadcast", False)}, str(exc)
        return
    case.fill()
    case.run()
    assert case.count_wrong() == 0
    assert case.nbytes == 48
    case.output.view(-1)[0] += 1  # one wrong element must be counted
    assert case.count_wrong() == 1


def test_unsupported_combinations_are_explicit(single_rank_group):
    with pytest.raises(Unsupported, match="all_reduce method"):
        build_case("all_gather", "int8", True, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(Unsupported, match="in-place only"):
        build_case("broadcast", "nccl_fp32", False, 8, torch.float32, torch.device("cpu"))


def _rec(
    method="nccl_fp32", transport="socket", nbytes=MiB, busbw=10.0, p50=100.0, p99=120.0, **kw
):
    r = {
        "benchmark": "allreduce_latency",
        "metric": "busbw",
        "value": busbw,
        "unit": "GB/s",
        "collective": "all_reduce",
        "method": method,
        "transport": transport,
        "bytes": nbytes,
        "dtype": "float",
        "inplace": True,
        "world_size": 2,
        "time_us_mean": p50,
        "time_us_p50": p50,
        "time_us_p99": p99,
        "algbw": busbw,
        "busbw": busbw,
        "wrong": 0,
        "device": "x",
        "versions": {},
        "date": "d",
        "commit": "c",
    }
    r.update(kw)
    return r


def test_compare_flags_drops_above_20_percent():
    old = [_rec(nbytes=MiB, busbw=100.0), _rec(nbytes=2 * MiB, busbw=100.0), _rec(nbytes=4 * MiB)]
    new = [_rec(nbytes=MiB, busbw=81.0), _rec(nbytes=2 * MiB, busbw=79.0), _rec(method="int8")]
    flagged, text = report.compare(new, old)
    assert [f["bytes"] for f in flagged] == [2 * MiB]
    assert "REGRESSION" in text and "matched" in text
    flagged, _ = report.compare(old, old)
    assert flagged == []


def test_compare_cli_exit_codes(tmp_path):
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    report.write_jsonl([_rec(busbw=100.0)], old)
    report.write_jsonl([_rec(busbw=50.0)], new)
    assert bench_main(["compare", str(new), str(old)]) == 3
    assert bench_main(["compare", str(old), str(old)]) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        report.read_jsonl(bad)


def test_stability_summary_spread_and_jitter():
    recs = [_rec(p50=p, p99=2 * p, repeat=i) for i, p in enumerate([100.0, 110.0, 90.0])]
    (s,) = report.stability_summary(recs)
    assert s["repeats"] == 3
    assert s["p50_spread"] == pytest.approx(20.0 / 100.0)
    assert s["p99_over_p50_median"] == pytest.approx(2.0)
    assert "stability" in report.stability_text([s])
    assert report.stability_summary([recs[0]]) == []


def test_summary_targets():
    recs = [
        _rec("nccl_fp32", "nvlink", 512 * MiB, busbw=296.0),
        _rec("nccl_fp32", "nvlink", 1024 * MiB, busbw=300.0),
        _rec("nccl_bf16", "socket", 32 * MiB, p50=6000.0),
        _rec("int8", "socket", 32 * MiB, p50=3000.0),
        _rec("nccl_bf16", "socket", 64 * MiB, p50=12000.0),
        _rec("int8", "socket", 64 * MiB, p50=7000.0),
        _rec("nccl_fp32", "nvlink", 8, p50=66.0),
        _rec("bare", "nvlink", 8, p50=63.0),
    ]
    t = {row["name"].split()[0]: row for row in summary.targets(recs)}
    assert t["NVLink"]["met"] is True and t["NVLink"]["value"] == pytest.approx(296.0)
    assert t["socket"]["met"] is False and t["socket"]["value"] == pytest.approx(12 / 7)
    assert t["8"]["met"] is True and t["8"]["value"] == pytest.approx(66 / 63)
    cross = summary.crossovers(recs, "nccl_bf16")
    assert cross == [{"transport": "socket", "baseline": "nccl_bf16", "from_bytes": 32 * MiB}]
    md = summary.markdown_summary(recs)
    assert "| socket | int8 |" in md and "**no**" in md


def test_table_layout_has_nccl_tests_columns():
    head = report.table_header("all_reduce", "nccl_fp32", "nvlink")
    for col in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert col in head
    assert "out-of-place" in head and "in-place" in head
    row = report.table_row(8, 2, "float", "sum", -1, None, _rec(nbytes=8))
    assert row.split()[:5] == ["8", "2", "float", "sum", "-1"] and "N/A" in row
    foot = report.table_footer([_rec(busbw=2.0), _rec(busbw=4.0, wrong=3)])
    assert "3 FAILED" in foot and "3 GB/s" in foot


def test_cli_rejects_bad_arguments(capsys):
    assert bench_main(["allreduce", "-b", "12Q"]) == 2
    assert bench_main(["allreduce", "--op", "allreduce"]) == 2
    assert bench_main(["allreduce", "-b", "1M", "-e", "8"]) == 2
    err = capsys.readouterr().err
    assert "-b/--minbytes" in err and "--op" in err and "maxbytes" in err


def test_markdown_and_jsonl_roundtrip(tmp_path):
    recs = [_rec(), _rec(method="int8", wrong=None)]
    p = report.write_jsonl(recs, tmp_path / "a" / "x.jsonl")
    assert report.read_jsonl(p) == json.loads(json.dumps(recs))
    md = report.markdown(recs)
    assert md.count("\n") == 4 and "N/A" in md


def test_failing_method_is_contained_and_records_kept(
    single_rank_group, tmp_path, monkeypatch, capsys
):
    from verl_comm.bench.int8 import Int8AllReduce
    from verl_comm.bench.runner import BenchConfig, run_rank

    def broken(self, inp, out, group):
        def call():
            raise RuntimeError("kernel did not compile")

        return call

    monkeypatch.setattr(Int8AllReduce, "make", broken)
    jsonl = tmp_path / "r.jsonl"
    cfg = BenchConfig(
        backend="gloo",
        nproc=1,
        minbytes=8,
        maxbytes=64,
        factor=8,
        iters=2,
        warmup=1,
        methods=["int8", "nccl_fp32"],
        jsonl=str(jsonl),
    )
    with pytest.raises(RuntimeError, match="all_reduce int8: RuntimeError: kernel did not compile"):
        run_rank(cfg)
    out = capsys.readouterr().out
    assert "# FAILED: all_reduce int8" in out
    recs = report.read_jsonl(jsonl)
    assert {r["method"] for r in recs} == {"nccl_fp32"} and len(recs) == 4  # 2 sizes x 2 places
    assert all(r["wrong"] == 0 for r in recs)


def test_wrong_elements_fail_the_run(tmp_path, capsys):
    import argparse

    from verl_comm.bench.cli import _outputs

    args = argparse.Namespace(jsonl=None, md=None, out=None, plot=None, compare=None, append=False)
    assert _outputs([_rec()], args) == 0
    assert _outputs([_rec(), _rec(wrong=5)], args) == 1
    assert "5 wrong elements" in capsys.readouterr().err
