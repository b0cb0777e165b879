"""The NCCL environment linter: circulating advice, strtoll parsing, interfaces, addresses."""

from __future__ import annotations

import pytest

from verl_comm.nccl import HostInfo, has_errors, lint, nccl_names, strtoll0
from verl_comm.nccl.registry import NEVER_READ, REGISTRY, REMOVED, lookup
from verl_comm.nccl.topology import Interface

HOST = HostInfo(interfaces=[Interface("lo", ["127.0.0.1"]), Interface("eth0", ["10.0.0.5"])])
IB_HOST = HostInfo(interfaces=HOST.interfaces, ib_devices=["mlx5_0", "mlx5_1"])

ADVICE = {
    "NCCL_ASYNC_ERROR_HANDLING": "0",
    "NCCL_SOCKET_TIMEOUT": "1200",
    "NCCL_NSOCKS_PERTHREAD": "8",
    "NCCL_BUFFSIZE": "2097152",
    "NCCL_MIN_NRINGS": "4",
    "NCCL_IB_DISABLE": "1",
}


def _by_var(env, host=HOST):
    findings = lint(env, host=host)
    assert len({f.variable for f in findings}) == len(findings), "one finding per variable"
    return {f.variable: f for f in findings}


def test_circulating_advice_one_correct_finding_each():
    got = _by_var(ADVICE)
    assert set(got) == set(ADVICE)
    f = got["NCCL_ASYNC_ERROR_HANDLING"]
    assert f.severity == "error"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in f.message and "hangs" in f.message
    f = got["NCCL_SOCKET_TIMEOUT"]
    assert f.severity == "error" and "read by nothing" in f.message
    assert "NCCL_SOCKET_RETRY_CNT" in f.fix and "init_process_group(timeout" in f.fix
    f = got["NCCL_NSOCKS_PERTHREAD"]
    assert f.severity == "warning" and "NCCL_SOCKET_NTHREADS" in f.message and "64" in f.fix
    f = got["NCCL_BUFFSIZE"]
    assert f.severity == "warning" and "4 MiB" in f.message and "2 MiB" in f.message
    f = got["NCCL_MIN_NRINGS"]
    assert "NCCL_MIN_NCHANNELS" in f.message and "NCCL_MIN_CTAS" in f.message
    assert "2.17" in f.message and "debugging" in f.message
    f = got["NCCL_IB_DISABLE"]
    assert f.severity == "warning" and "RDMA" in f.message
    # on a host with IB devices, disabling IB is an error naming them
    f = _by_var(ADVICE, IB_HOST)["NCCL_IB_DISABLE"]
    assert f.severity == "error" and "mlx5_0" in f.message


@pytest.mark.parametrize(
    "value, parsed, fix",
    [("2M", 2, "2097152"), ("08", 0, "8"), ("abc", 0, "<integer>"), ("4KB", 4, "4096")],
)
def test_strtoll_surprises_are_errors(value, parsed, fix):
    f = _by_var({"NCCL_BUFFSIZE": value})["NCCL_BUFFSIZE"]
    assert f.severity == "error"
    assert f"reads {parsed}" in f.message or f"as {parsed}" in f.message
    assert f.fix.endswith(fix)


def test_strtoll0_matches_c():
    assert strtoll0("2M") == (2, "M")
    assert strtoll0("08") == (0, "8")
    assert strtoll0("010") == (8, "")
    assert strtoll0("0x1F") == (31, "")
    assert strtoll0("abc") == (0, "abc")
    assert strtoll0("  -12xyz") == (-12, "xyz")
    assert strtoll0("0") == (0, "")
    assert strtoll0("0x") == (0, "x")  # C parses the 0 and stops at x


def test_ranges_and_socket_limit():
    got = _by_var({"NCCL_IB_TIMEOUT": "40", "NCCL_SOCKET_NTHREADS": "16",
                   "NCCL_NSOCKS_PERTHREAD": "8", "MASTER_PORT": "70000"})  # fmt: skip
    assert (
        got["NCCL_IB_TIMEOUT"].severity == "error" and "[1, 31]" in got["NCCL_IB_TIMEOUT"].message
    )
    assert "16 x 8 = 128 > 64" in got["NCCL_SOCKET_NTHREADS"].message
    assert "NCCL_NSOCKS_PERTHREAD" not in got  # valid once NTHREADS is set
    assert got["MASTER_PORT"].severity == "error"
    assert _by_var({"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"}) == {}


def test_unknown_names_get_did_you_mean():
    got = _by_var({"NCCL_SOCKETNTHREADS": "4", "NCCL_IB_HCAS": "mlx5", "NCCL_ZZZ_QQQ": "1",
                   "TORCH_NCCL_BLOCKING_WAITT": "1", "OMP_NUM_THREADS": "4"})  # fmt: skip
    assert got["NCCL_SOCKETNTHREADS"].fix == "did you mean NCCL_SOCKET_NTHREADS?"
    assert got["NCCL_IB_HCAS"].fix == "did you mean NCCL_IB_HCA?"
    assert got["TORCH_NCCL_BLOCKING_WAITT"].fix == "did you mean TORCH_NCCL_BLOCKING_WAIT?"
    assert got["NCCL_ZZZ_QQQ"].fix == "check the spelling"
    assert "OMP_NUM_THREADS" not in got  # not ours to lint


def test_removed_and_renamed_names():
    got = _by_var(
        {"NCCL_IB_GDR_LEVEL": "PHB", "NCCL_LL_THRESHOLD": "0", "NCCL_TREE_THRESHOLD": "0"}
    )
    assert "NCCL_NET_GDR_LEVEL" in got["NCCL_IB_GDR_LEVEL"].fix
    assert "2.5" in got["NCCL_LL_THRESHOLD"].message and "2.5" in got["NCCL_TREE_THRESHOLD"].message
    assert all(f.severity == "error" for f in got.values())


def test_torch_async_error_handling_zero_is_an_error_and_one_is_fine():
    assert (
        _by_var({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})[
            "TORCH_NCCL_ASYNC_ERROR_HANDLING"
        ].severity
        == "error"
    )
    assert _by_var({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}
    dep = _by_var({"NCCL_ASYNC_ERROR_HANDLING": "1"})["NCCL_ASYNC_ERROR_HANDLING"]
    assert dep.severity == "warning" and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in dep.message


@pytest.mark.parametrize("value", ["^lo", "=lo", "nonexistent0", "lo,eth9"])
def test_gloo_ifname_nccl_syntax_and_missing_interfaces(value):
    f = _by_var({"GLOO_SOCKET_IFNAME": value})["GLOO_SOCKET_IFNAME"]
    assert f.severity == "error" and "lo, eth0" in f.message and f.fix.endswith("eth0")


def test_nccl_ifname_prefix_exclude_exact():
    assert _by_var({"NCCL_SOCKET_IFNAME": "eth"}) == {}
    assert _by_var({"NCCL_SOCKET_IFNAME": "^docker,lo"}) == {}
    assert _by_var({"NCCL_SOCKET_IFNAME": "=eth0"}) == {}
    for bad in ("=eth", "ens", "^lo,eth"):
        f = _by_var({"NCCL_SOCKET_IFNAME": bad})["NCCL_SOCKET_IFNAME"]
        assert f.severity == "error" and "interfaces here: lo, eth0" in f.message


@pytest.mark.parametrize("addr", ["172.17.0.3", "169.254.10.1", "fe80::1"])
def test_master_addr_docker_bridge_or_link_local(addr):
    f = _by_var({"MASTER_ADDR": addr})["MASTER_ADDR"]
    assert f.severity == "warning"
    assert _by_var({"MASTER_ADDR": "10.1.2.3"}) == {}


def test_debug_only_variables_flagged():
    got = _by_var({"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_MIN_CTAS": "8",
                   "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"})  # fmt: skip
    for name in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_CTAS"):
        assert got[name].severity == "warning" and "debugging-only" in got[name].message
    assert got["NCCL_DEBUG"].severity == "info"
    assert "NCCL_DEBUG_SUBSYS" not in got  # goes with NCCL_DEBUG
    assert _by_var({"NCCL_DEBUG": "WARN"}) == {}
    assert _by_var({"NCCL_DEBUG": "LOUD"})["NCCL_DEBUG"].severity == "error"


def test_has_errors_and_order():
    findings = lint({**ADVICE, "NCCL_DEBUG": "INFO"}, host=HOST)
    assert has_errors(findings)
    sev = [f.severity for f in findings]
    assert sev == sorted(sev, key=["error", "warning", "info"].index)
    assert not has_errors(lint({"NCCL_DEBUG": "WARN"}, host=HOST))


def test_registry_covers_nccl_230_names():
    names = nccl_names()
    assert len(names) == 245 and "NCCL_BUFFSIZE" in names and "NCCL_MIN_CTAS" in names
    for name in names:  # every name NCCL reads is known, none linted as unknown
        assert lookup(name) is not None
    for name, spec in REGISTRY.items():
        if spec.owner == "nccl":
            assert name in names, f"{name} is not read by NCCL 2.30"
        if spec.successor:
            assert lookup(spec.successor) is not None
    for name in list(NEVER_READ) + list(REMOVED):
        assert name not in names
    assert REGISTRY["NCCL_BUFFSIZE"].default.startswith("4194304")
    for spec in REGISTRY.values():  # data/env_registry.csv is consistent
        assert spec.owner in ("nccl", "torch", "gloo", "launcher", "libfabric"), spec
        assert spec.kind in ("int", "bool", "str", "ifname", "level", "enum"), spec
        assert spec.section in ("production", "debug") and spec.doc, spec
        assert (spec.kind == "enum") == bool(spec.choices), spec
        if spec.min_value is not None and spec.max_value is not None:
            assert spec.min_value <= spec.max_value, spec


def test_rules_are_a_table_whose_every_row_fires_and_cites_a_source():
    from verl_comm.nccl.lint import RULES, SEVERITIES, matching_rule

    host_ifs = HostInfo(
        interfaces=[Interface("lo", ["127.0.0.1"]), Interface("eth0", ["10.0.0.5"])]
    )
    cases = [
        ("NCCL_SOCKET_TIMEOUT", "1200", {}, HOST),
        ("NCCL_LL_THRESHOLD", "0", {}, HOST),
        ("NCCL_BUFSIZE", "1", {}, HOST),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", {}, HOST),
        ("NCCL_NSOCKS_PERTHREAD", "8", {}, HOST),
        ("NCCL_MIN_NRINGS", "4", {}, HOST),
        ("NCCL_BUFFSIZE", "08", {}, HOST),
        ("NCCL_BUFFSIZE", "2M", {}, HOST),
        ("NCCL_SOCKET_NTHREADS", "65", {}, HOST),
        ("NCCL_SOCKET_FAMILY", "AF_UNIX", {}, HOST),
        ("NCCL_P2P_LEVEL", "NVX", {}, HOST),
        ("NCCL_SOCKET_NTHREADS", "16", {"NCCL_NSOCKS_PERTHREAD": "8"}, HOST),
        ("NCCL_SOCKET_IFNAME", "ib", {}, host_ifs),
        ("GLOO_SOCKET_IFNAME", "^lo", {}, host_ifs),
        ("GLOO_SOCKET_IFNAME", "eth9", {}, host_ifs),
        ("MASTER_ADDR", "169.254.3.4", {}, HOST),
        ("MASTER_ADDR", "172.17.0.2", {}, HOST),
        ("NCCL_IB_DISABLE", "1", {}, IB_HOST),
        ("NCCL_IB_DISABLE", "1", {}, HOST),
        ("NCCL_BUFFSIZE", "2097152", {}, HOST),
        ("NCCL_DEBUG_SUBSYS", "INIT", {}, HOST),
        ("NCCL_DEBUG", "INFO", {}, HOST),
    ]
    fired = set()
    for name, value, env, host in cases:
        hit = matching_rule(name, value, {**env, name: value}, host)
        assert hit is not None, (name, value)
        fired.add(RULES.index(hit[0]))
    assert fired == set(range(len(RULES))), sorted(set(range(len(RULES))) - fired)
    for rule in RULES:
        assert rule.severity in SEVERITIES and rule.source and "FACTS" not in rule.source
    assert matching_rule("NCCL_BUFFSIZE", "4194304", {}, HOST) is None
