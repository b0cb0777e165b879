"""Distributed failures become clear errors in bounded time (gloo, 1-3 processes).

Each scenario runs as separate processes (``data/dist_scenarios.py``) on a fresh TCP port.
All jobs start together once per module (torch imports are the slow part on a loaded
machine), a file barrier lines the ranks up after import, every test has a pytest-timeout
and the launcher kills whatever outlives its deadline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from verl_comm.distributed.launch import free_port

SCRIPT = Path(__file__).parent / "data" / "dist_scenarios.py"
GRACE_S = 1.0  # DistContext.report_grace_s: after a timeout, ranks report their position


JOBS = {
    # name: (scenario, ranks launched, world size, timeout_s)
    "ifname": ("bad_ifname", [0], 2, 5.0),
    "no_master": ("rendezvous", [1], 2, 3.0),
    "missing_rank": ("rendezvous", [0, 1], 3, 3.0),
    "one_rank_only": ("one_rank_only", [0, 1], 2, 3.0),
    "subgroup": ("subgroup_timeout", [0, 1], 2, 3.0),
    "rank0_long": ("rank0_long_no_helper", [0, 1], 2, 2.0),
    "debug_suite": ("debug_suite", [0, 1], 2, 2.0),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[int, dict]]:
    """Run every job of :data:`JOBS` concurrently; ``results[job][rank]`` is a RESULT dict."""
    env = dict(os.environ)
    for name in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    procs: dict[tuple[str, int], subprocess.Popen] = {}
    for job, (scenario, ranks, world, timeout_s) in JOBS.items():
        port, sync = free_port(), tmp_path_factory.mktemp(job)
        for r in ranks:
            cmd = [
                sys.executable,
                str(SCRIPT),
                scenario,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--timeout",
                str(timeout_s),
                "--sync-dir",
                str(sync),
                "--launched",
                str(len(ranks)),
            ]
            procs[job, r] = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
    out: dict[str, dict[int, dict]] = {job: {} for job in JOBS}
    try:
        for (job, r), p in procs.items():
            stdout, stderr = p.communicate(timeout=150)
            line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                line = (
                    'RESULT {"ok": false, "error_type": "NoResult", "message": '
                    + json.dumps(stderr[-3000:])
                    + "}"
                )
            out[job][r] = json.loads(line[len("RESULT ") :])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _err(res: dict, error_type: str) -> str:
    assert not res["ok"], f"should have failed: {res}"
    assert res["error_type"] == error_type, res
    return res["message"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("value", ["nonexistent0", "^lo"])
def test_gloo_socket_ifname_is_checked(results, value):
    res = results["ifname"][0][value]
    msg = _err(res, "InterfaceError")
    assert "GLOO_SOCKET_IFNAME" in msg
    for name in [n for _, n in socket.if_nameindex()]:
        assert name in msg  # the interfaces that do exist are listed
    assert res["op_s"] < 2.0


@pytest.mark.timeout(200)
def test_master_never_started_names_address(results):
    res = results["no_master"][1]  # rank 0 (the store) never starts
    msg = _err(res, "RendezvousError")
    assert "MASTER_ADDR:MASTER_PORT=127.0.0.1:" in msg and "rank 0 is not running" in msg
    assert 3.0 - 0.5 < res["elapsed_s"] < 3.0 + 2.0


@pytest.mark.timeout(200)
def test_missing_rank_says_how_many_joined(results):
    for res in results["missing_rank"].values():
        msg = _err(res, "RendezvousError")
        assert "2/3 ranks joined" in msg and "missing ranks [2]" in msg, msg
        assert 3.0 - 0.5 < res["elapsed_s"] < 3.0 + 2.0


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "case, expect",
    [
        ("mismatch_op", ["rank 0: all_reduce shape=[4]", "rank 1: broadcast shape=[4]"]),
        ("mismatch_shape", ["rank 0: all_reduce shape=[4]", "rank 1: all_reduce shape=[8]"]),
        ("one_rank_only", ["rank 0: all_reduce", "rank 1: destroy_process_group"]),
    ],
)
def test_fingerprint_names_mismatch_fast(results, case, expect):
    for res in results["debug_suite"].values():  # every rank gets the error, within 1 s
        msg = _err(res[case], "CollectiveMismatchError")
        for piece in expect:
            assert piece in msg, msg
        assert res[case]["op_s"] < 1.0


@pytest.mark.timeout(200)
def test_without_debug_mode_timeout_names_collective(results):
    res = results["one_rank_only"][0]
    msg = _err(res, "CollectiveTimeoutError")
    assert "all_reduce on the default group (2 ranks)" in msg and "timeout of 3 s" in msg
    assert 2.5 < res["op_s"] < 3.0 + GRACE_S + 2.0


@pytest.mark.timeout(200)
def test_without_debug_mode_timeout_names_sequence_number_and_missing_rank(results):
    res = results["one_rank_only"][0]  # rank 1 skipped the all-reduce after a barrier
    msg = _err(res, "CollectiveTimeoutError")
    assert "all_reduce on the default group (2 ranks) (its collective #1 there)" in msg, msg
    assert "Ranks [0] reached collective #1; rank(s) [1] did not report reaching it" in msg, msg
    assert 2.5 < res["op_s"] < 3.0 + GRACE_S + 2.0


@pytest.mark.timeout(200)
def test_subgroup_timeout_names_the_deadline_that_fired(results):
    res = results["subgroup"][0]  # a 1.5 s sub-group in a job of 3 s
    own = res["own"]
    assert own["error_type"] == "CollectiveTimeoutError", own
    assert "within the sub-group's own timeout of 1.5 s" in own["message"], own["message"]
    assert "3 s" not in own["message"]
    assert 1.0 < res["own_op_s"] < 1.5 + GRACE_S + 2.0  # its own deadline fired


@pytest.mark.timeout(200)
def test_subgroup_gets_the_configured_timeout(results):
    res = results["subgroup"][0]
    msg = _err(res, "CollectiveTimeoutError")
    assert "sub-group [0, 1]" in msg
    assert 2.5 < res["op_s"] < 3.0 + GRACE_S + 2.0  # 3 s, not torch's 30 min default


@pytest.mark.timeout(200)
def test_rank0_only_section_longer_than_timeout_suggests_helper(results):
    res = results["rank0_long"][1]
    msg = _err(res, "CollectiveTimeoutError")
    assert "rank0_section" in msg and "rank(s) [0] did not report reaching it" in msg
    assert 1.5 < res["op_s"] < 2.0 + GRACE_S + 2.0


@pytest.mark.timeout(200)
def test_rank0_section_helper_widens_the_deadline(results):
    for res in results["debug_suite"].values():
        assert res["section_long"]["ok"], res["section_long"]
        assert res["section_sum"] == [3.0, 3.0, 3.0]
        assert res["section_long"]["op_s"] > 2.0  # outlived the 2 s collective timeout


@pytest.mark.timeout(200)
def test_rank0_section_failure_reaches_waiting_ranks(results):
    res0, res1 = results["debug_suite"][0], results["debug_suite"][1]
    assert _err(res0["section_raises"], "OSError") == "disk full"
    msg = _err(res1["section_raises"], "Rank0SectionError")
    assert "rank 0 failed in section 'checkpoint'" in msg and "disk full" in msg
    assert res1["section_raises"]["op_s"] < 2.0


@pytest.mark.timeout(200)
def test_nan_on_one_rank_is_named_before_reduce(results):
    for res in results["debug_suite"].values():
        assert res["plain_has_nan"]  # the plain all-reduce spread rank 1's NaN to rank 0
        msg = _err(res["nan"], "NonFiniteError")
        assert "rank 1: 1 NaN/Inf value(s), first at flat index 3" in msg
        assert "grad bucket 0" in msg and "rank 0:" not in msg


@pytest.mark.timeout(200)
def test_healthy_collectives_pass_all_checks(results):
    for res in results["debug_suite"].values():
        assert res["healthy"]["ok"], res["healthy"]
        assert res["sum"] == [0.0, 3.0, 6.0, 9.0, 12.0]
