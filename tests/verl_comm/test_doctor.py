"""``verl-comm doctor``: report contents, exit codes and deadlines (gloo on CPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from verl_comm import doctor
from verl_comm.nccl.topology import HostInfo, check_nvlinks, parse_topo_matrix

DATA = Path(__file__).parent / "data"

NCCL_LOG = """\
h200:1234:1250 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
h200:1234:1250 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h200:1234:1250 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read
h200:1235:1251 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/direct pointer/read
h200:1235:1251 [1] NCCL INFO Channel 00 : 1[1] -> 0[0] via SHM/direct/direct
h200:1235:1251 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/0
h200:1235:1251 [1] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
"""


def test_parse_transports_counts_each_channel_line():
    got = doctor.parse_transports(NCCL_LOG)
    assert got["nccl_version"] == "2.28.9+cuda13.0"
    assert got["channels"] == {
        "P2P/CUMEM/read": 2,
        "P2P/direct pointer/read": 1,
        "SHM/direct/direct": 1,
        "NET/Socket/0": 1,
    }
    assert doctor.parse_transports("no nccl here") == {"channels": {}, "nccl_version": None}


def _run(capsys, argv):
    t0 = time.monotonic()
    rc = doctor.main(argv)
    return rc, capsys.readouterr().out, time.monotonic() - t0


@pytest.mark.timeout(180)
def test_doctor_gloo_two_processes_passes(capsys, monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_TIMEOUT", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    args = ["--nproc", "2", "--backend", "gloo", "--timeout", "20", "--iters", "3",
            "--bw-bytes", str(1 << 20), "--json"]  # fmt: skip
    rc, out, _ = _run(capsys, args)
    report = json.loads(out)
    assert rc == 0, out
    assert report["ok"] and report["versions"]["torch"]
    assert report["kernels"]["status"] in ("passed", "not available")
    d = report["distributed"]
    assert [r["ok"] for r in d["ranks"]] == [True, True]
    cases = d["ranks"][0]["steps"]["allreduce_correctness"]["cases"]
    assert {(c["dtype"], c["numel"]) for c in cases} == {
        (dt, n) for dt in ("float32", "bfloat16") for n in (1, 1023, (1 << 20) + 3)
    }
    assert all(c["ok"] for c in cases)
    assert d["latency_us"] > 0 and d["bandwidth"]["busbw_GBps"] > 0
    assert d["bandwidth"]["busbw_GBps"] == pytest.approx(d["bandwidth"]["algbw_GBps"])  # n=2


@pytest.mark.timeout(120)
def test_doctor_fails_fast_on_bad_interface_and_lint_error(capsys, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nonexistent0")
    monkeypatch.setenv("NCCL_SOCKET_TIMEOUT", "1200")
    rc, out, wall = _run(capsys, ["--nproc", "2", "--backend", "gloo", "--timeout", "5"])
    assert rc == 1
    assert "[FAIL] env lint" in out and "NCCL_SOCKET_TIMEOUT" in out
    assert "[FAIL] distributed" in out and "InterfaceError" in out
    assert "GLOO_SOCKET_IFNAME" in out
    assert "doctor: FAILED" in out


@pytest.mark.timeout(60)
def test_doctor_kills_workers_at_the_deadline(capsys):
    # deadline = startup + 4 x timeout = 0.2 + 4 x 0.05 = 0.4 s: too short to even import torch
    t0 = time.monotonic()
    d = doctor.check_distributed(2, "gloo", 0.05, 0.2, 1 << 10, 1)
    assert time.monotonic() - t0 < 10
    assert not d["ok"]
    assert all("killed at the 0.4 s deadline" in r["error"] for r in d["ranks"])


def test_doctor_without_distributed_check_reports_text(capsys, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_TIMEOUT", raising=False)
    rc, out, _ = _run(capsys, ["--nproc", "0"])
    assert "[PASS] versions" in out and "topology" in out and "kernels self-test" in out
    assert "distributed" not in out
    assert rc == (0 if "[FAIL]" not in out else 1)


def test_topology_check_fails_on_degraded_nvlink():
    topo = parse_topo_matrix((DATA / "topo_8xa100_sxm_degraded.txt").read_text())
    name = "NVIDIA A100-SXM4-80GB"
    host = HostInfo(gpu_names=[name] * 8, topo=topo, nvlink_problems=check_nvlinks(topo, name))
    got = doctor.check_topology(host)
    assert not got["ok"] and got["nvlinks"]["GPU2-GPU5"] == 11 and got["nvlinks"]["GPU0-GPU1"] == 12
    h200 = parse_topo_matrix((DATA / "topo_2xh200_nv18.txt").read_text())
    got = doctor.check_topology(HostInfo(gpu_names=["NVIDIA H200"] * 2, topo=h200))
    assert got["ok"] and got["nvlinks"] == {"GPU0-GPU1": 18}
