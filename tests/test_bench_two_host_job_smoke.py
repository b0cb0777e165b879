"""CI smoke run of benchmarks/two_host_job.sh: the tiny model, two steps, none and int8, on two
network namespaces joined by a shaped veth pair (torchrun --nnodes=2, one rank per host).

Making namespaces needs root and iproute2; elsewhere the test is skipped with the reason
(shown by ``pytest -rs``), never passed."""

import os
import shutil
import subprocess
import sys

import pytest

from tests._bench_smoke import REPO
from verl_comm.bench.report import read_jsonl


def _why_not() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed: cannot make network namespaces"
    if os.geteuid() != 0:
        return "not root: cannot make network namespaces"
    return None


@pytest.mark.timeout(1500)
def test_two_host_job_smoke(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(why)
    env = {**os.environ, "PYTHON": sys.executable, "JOB_S": "1200"}
    r = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "two_host_job.sh"), "--smoke", str(tmp_path), "200"],
        capture_output=True, text=True, timeout=1450, cwd=REPO, env=env,
    )  # fmt: skip
    if r.returncode == 3:
        pytest.skip(f"network namespaces cannot be made here: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    recs = read_jsonl(tmp_path / "two_host_job.smoke.jsonl")
    assert len({x["run_id"] for x in recs}) == 1
    by = {(x["method"], x["metric"]): x for x in recs}
    assert set(by) == {(m, k) for m in ("none", "int8") for k in ("step_time_s", "eval_end")}
    for m in ("none", "int8"):
        t = by[(m, "step_time_s")]
        assert t["link_mbit"] == 200 and t["transport"] == "shaped_veth" and t["nnodes"] == 2
        assert t["min_s"] <= t["value"] <= t["max_s"] and t["value"] > 0
        assert set(t["step_times_s"]) == {"1", "2"} and t["timed_steps"] == [2]
        assert 0.0 <= by[(m, "eval_end")]["value"] <= 1.0
        assert t["summary_line"].startswith("done | eval ")
    assert by[("int8", "step_time_s")]["gradient_compression"] == "int8"
    assert "| int8 | int8 |" in (tmp_path / "two_host_job.smoke.md").read_text()
