"""CI run of ``benchmarks/packing.py --smoke`` (tiny model, CPU: the dense-mask packed path)."""

import pytest

from tests._bench_smoke import check_exit, run_smoke
from verl_comm.bench.report import read_jsonl


@pytest.mark.timeout(300)
def test_packing_benchmark_smoke(tmp_path):
    check_exit(run_smoke("packing.py", tmp_path, timeout=280))
    recs = read_jsonl(tmp_path / "packing.smoke.jsonl")
    assert len({r["run_id"] for r in recs}) == 1
    rates = {r["method"]: r for r in recs if r["metric"] == "update_tokens_per_s"}
    assert set(rates) == {"padded", "packed"}
    for r in rates.values():
        assert r["benchmark"] == "packing" and r["unit"] == "tokens/s" and r["commit"]
        assert 0 < r["min"] <= r["value"] <= r["max"]
    # the CPU fp32 paths agree to float rounding (the check the run itself makes first)
    errs = {r["method"]: r for r in recs if r["metric"] == "loss_abs_err"}
    assert errs["packed"]["value"] <= 1e-4 * abs(errs["packed"]["loss_fp32"])
    assert (tmp_path / "packing.smoke.md").exists()
