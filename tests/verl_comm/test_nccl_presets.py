"""NCCL presets: tables, never overriding the user, clean under the linter."""

from __future__ import annotations

import os
import warnings

import pytest

from verl_comm.nccl import PRESETS, HostInfo, apply_preset, get_preset, lint
from verl_comm.nccl.registry import lookup
from verl_comm.nccl.topology import Interface

HOST = HostInfo(interfaces=[Interface("lo", ["127.0.0.1"]), Interface("eth0", ["10.0.0.5"])])
NAMES = ("pytorch-safety", "nvlink-single-node", "cloud-tcp", "ib-multinode", "aws-efa")


def test_preset_names_and_reasons():
    assert tuple(PRESETS) == NAMES
    for preset in PRESETS.values():
        assert preset.entries and preset.summary
        for e in preset.entries:
            assert e.reason and isinstance(e.value, str)
            spec = lookup(e.variable)
            assert spec is not None, f"{preset.name}: {e.variable} is read by nothing"
            assert spec.section == "production", f"{preset.name}: {e.variable} is debug-only"


@pytest.mark.parametrize("name", NAMES)
def test_presets_are_clean_under_the_linter(name):
    assert lint(PRESETS[name].as_env(), host=HOST) == []


def test_every_preset_includes_pytorch_safety():
    safety = PRESETS["pytorch-safety"].as_env()
    assert safety["TORCH_NCCL_ASYNC_ERROR_HANDLING"] != "0"
    assert safety["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert int(safety["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    init = {option: value for option, value, _ in PRESETS["pytorch-safety"].init_options}
    assert init == {"timeout_s": "600", "device_id": "local_rank"}
    for preset in PRESETS.values():
        assert safety.items() <= preset.as_env().items()


def test_cloud_tcp_socket_limits():
    env = PRESETS["cloud-tcp"].as_env()
    assert int(env["NCCL_SOCKET_NTHREADS"]) * int(env["NCCL_NSOCKS_PERTHREAD"]) <= 64


def test_apply_preset_sets_missing_and_keeps_user_values():
    env = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_NTHREADS": "4", "OMP_NUM_THREADS": "2"}
    with pytest.warns(UserWarning, match="keeping your NCCL_DEBUG='INFO'"):
        effective = apply_preset("cloud-tcp", env)
    assert env["NCCL_DEBUG"] == "INFO"  # the user's value is kept
    assert env["NCCL_NSOCKS_PERTHREAD"] == "4" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert effective["NCCL_DEBUG"] == "INFO" and "OMP_NUM_THREADS" not in effective
    assert effective == {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
    # same value as the preset: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_preset("cloud-tcp", env | {"NCCL_DEBUG": "WARN"})


def test_apply_preset_defaults_to_os_environ(monkeypatch):
    for e in PRESETS["nvlink-single-node"].entries:
        monkeypatch.delenv(e.variable, raising=False)
    effective = apply_preset("nvlink-single-node")
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and effective["NCCL_SOCKET_IFNAME"] == "lo"


def test_unknown_preset_lists_choices():
    with pytest.raises(KeyError, match="cloud-tcp"):
        get_preset("fast")
    with pytest.raises(KeyError, match="unknown NCCL preset 'fast'"):
        apply_preset("fast", {})
