"""``benchmarks/comm_hooks_report.py``: the issue-28 line of a shaped-link run (auto against
the fastest fixed method of the same run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "comm_hooks_report", ROOT / "benchmarks" / "comm_hooks_report.py"
)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _t(**ms):
    return {h: {"value": v, "min_ms": v * 0.9, "max_ms": v * 1.1} for h, v in ms.items()}


def test_auto_against_fastest_fixed_method():
    t = _t(compute_only=100.0, none=1000.0, ours_int8=600.0, torch_fp16=580.0, ours_auto_r8=620.0)
    t["ours_auto_r8"]["auto_choice"] = "bucket 0 int8"
    lines = report.auto_vs_fastest(t)
    # compute_only (no communication) is not a method auto could pick; torch_fp16 is fastest
    assert "(torch_fp16): 1.069 (620.0 vs 580.0 ms" in lines[0] and "MISSED" in lines[0]
    assert lines[1] == "  - ours_auto_r8 chose: bucket 0 int8"
    ok = report.auto_vs_fastest(_t(none=1000.0, ours_int8=600.0, ours_auto=629.0))
    assert "1.048" in ok[0] and ok[0].endswith("met)")


def test_auto_not_timed_is_reported_not_measured():
    t = _t(none=1000.0)
    t["ours_auto_r8"] = {"value": None, "status": "numerics_failed: rel=0.2"}
    (line,) = report.auto_vs_fastest(t)
    assert "not measured (numerics_failed: rel=0.2)" in line
