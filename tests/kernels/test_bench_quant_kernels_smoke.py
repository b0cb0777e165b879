"""CI smoke run of benchmarks/quant_kernels.py (CPU: Triton interpreter + torch references)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl

METRICS = {
    "copy",
    "quantize",
    "quantize_sr",
    "quantize_ef",
    "dequant_sum_requant",
    "dequantize",
    "torch_quantize",
    "torch_quantize_ef",
    "torch_dequant_sum_requant",
    "torch_dequantize",
}
KEYS = {
    "benchmark",
    "metric",
    "dtype",
    "block",
    "value",
    "unit",
    "device",
    "versions",
    "date",
    "commit",
}


@pytest.mark.timeout(180)
def test_quant_kernels_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    check_exit(run_smoke("quant_kernels.py", tmp_path, timeout=170, env=env))
    records = read_jsonl(tmp_path / "quant_kernels.jsonl")
    assert {r["metric"] for r in records} == METRICS
    for r in records:
        assert KEYS <= r.keys() and r["benchmark"] == "quant_kernels" and r["unit"] == "GB/s"
        assert r["value"] > 0 and r["numerics_ok"] is True
    assert all("ratio_to_copy" in r for r in records if r["metric"] != "copy")
    assert any("speedup_vs_torch" in r for r in records)
    md = (tmp_path / "quant_kernels.md").read_text()
    assert "| metric |" in md and "## Targets" in md
