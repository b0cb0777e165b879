"""``nvidia-smi topo -m`` parsing on captured outputs; interfaces; NVLink checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_comm.nccl.topology import (
    check_nvlinks,
    detect_host,
    expected_nvlinks,
    parse_ip_addr,
    parse_topo_matrix,
)

DATA = Path(__file__).parent / "data"


def _topo(name):
    return parse_topo_matrix((DATA / name).read_text())


def test_h200_pair_nv18():
    t = _topo("topo_2xh200_nv18.txt")  # tabs and nvidia-smi's ANSI-underlined header
    assert t.devices == ["GPU0", "GPU1", "NIC0", "NIC1"]
    assert t.gpus == ["GPU0", "GPU1"] and t.nics == ["NIC0", "NIC1"]
    assert t.links["GPU0"]["GPU1"] == "NV18" and t.links["GPU1"]["GPU1"] == "X"
    assert t.nvlinks("GPU0", "GPU1") == 18 and t.nvlinks("GPU0", "NIC0") == 0
    assert t.links["NIC0"]["NIC1"] == "PIX"
    assert t.nic_names == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert t.cpu_affinity["GPU1"] == "0-15" and t.numa_affinity["GPU0"] == "0"
    assert check_nvlinks(t, "NVIDIA H200") == []
    assert check_nvlinks(t, "NVIDIA A100-SXM4-80GB") == []  # 18 >= 12


def test_a100_nvswitch_full_and_degraded():
    full = _topo("topo_8xa100_sxm_nv12.txt")
    assert len(full.gpus) == 8 and len(full.nics) == 4
    assert all(full.nvlinks(a, b) == 12 for a in full.gpus for b in full.gpus if a != b)
    assert check_nvlinks(full, "NVIDIA A100-SXM4-80GB") == []
    assert full.numa_affinity["GPU5"] == "1" and full.cpu_affinity["GPU5"] == "64-127,192-255"
    bad = check_nvlinks(_topo("topo_8xa100_sxm_degraded.txt"), "NVIDIA A100-SXM4-80GB")
    assert len(bad) == 1 and bad[0].startswith("GPU2-GPU5: NV11 (11 NVLinks), 12 expected")
    # on H200 the full count is 18: NV12 everywhere would be reported for all 28 pairs
    assert len(check_nvlinks(full, "NVIDIA H200")) == 28


def test_pcie_box_space_separated():
    t = _topo("topo_4xpcie.txt")
    assert t.links["GPU0"]["GPU1"] == "PIX" and t.links["GPU0"]["GPU2"] == "NODE"
    assert t.links["GPU2"]["GPU3"] == "SYS" and t.nics == []
    assert t.cpu_affinity["GPU3"] == "32-63,96-127" and t.numa_affinity["GPU3"] == "1"
    assert check_nvlinks(t, "NVIDIA H100 PCIe") == []  # PCIe cards: no NVLink expected
    assert len(check_nvlinks(t, "NVIDIA H100 80GB HBM3")) == 6


def test_expected_nvlinks_by_platform():
    assert expected_nvlinks("NVIDIA A100-SXM4-40GB") == 12
    assert expected_nvlinks("NVIDIA H100 80GB HBM3") == 18
    assert expected_nvlinks("NVIDIA H200") == 18
    assert expected_nvlinks("NVIDIA H200 NVL") is None
    assert expected_nvlinks("NVIDIA H100 PCIe") is None
    assert expected_nvlinks("NVIDIA GeForce RTX 4090") is None


@pytest.mark.parametrize(
    "text, err",
    [
        ("no matrix here", "no header"),
        ("\tGPU0\tGPU1\nGPU0\t X \tQQ\nGPU1\tQQ\t X \n", "'QQ'"),
        ("\tGPU0\tGPU1\nGPU0\t X \n", "1 link cells"),
    ],  # fmt: skip
)
def test_bad_topo_text_raises(text, err):
    with pytest.raises(ValueError, match=err):
        parse_topo_matrix(text)


def test_parse_ip_addr():
    text = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
        "2: eth0    inet 10.0.0.5/24 brd 10.0.0.255 scope global eth0\\ valid_lft forever\n"
        "2: eth0    inet6 fe80::1/64 scope link \\       valid_lft forever\n"
        "5: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\n"
        "7: veth1@if6    inet6 fe80::2/64 scope link\n"
    )
    got = {i.name: i.addresses for i in parse_ip_addr(text)}
    assert got == {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5", "fe80::1"],
                   "docker0": ["172.17.0.1"], "veth1": ["fe80::2"]}  # fmt: skip


def test_detect_host_lists_loopback():
    host = detect_host(timeout_s=5)
    lo = [i for i in host.interfaces if i.name == "lo"]
    assert lo and "127.0.0.1" in lo[0].addresses
