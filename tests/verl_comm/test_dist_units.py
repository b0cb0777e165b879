"""In-process parts of verl_comm.distributed: messages, fingerprints, argument checks."""

from __future__ import annotations

import pytest
import torch

from verl_comm.distributed import (
    CollectiveTimeoutError,
    DistributedError,
    InterfaceError,
    PeerLostError,
    check_socket_interfaces,
    fingerprint,
    init_distributed,
    new_group,
    translate,
)
from verl_comm.distributed.errors import describe_group


def test_fingerprint_names_op_shape_dtype_and_args():
    fp = fingerprint("all_reduce", torch.zeros(2, 3, dtype=torch.bfloat16), op="SUM")
    assert fp == "all_reduce shape=[2, 3] dtype=bfloat16 op=SUM"
    assert fingerprint("barrier", None) == "barrier"
    a = fingerprint("broadcast", torch.zeros(4), src=0)
    assert a != fingerprint("broadcast", torch.zeros(4), src=1)


def test_translate_classifies_backend_errors():
    e = translate(RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete"),
                  "all_reduce", describe_group(None, 2), 3.0, 1)  # fmt: skip
    assert isinstance(e, CollectiveTimeoutError)
    assert "rank 1: all_reduce on the default group (2 ranks)" in str(e)
    assert "timeout of 3 s" in str(e) and "rank0_section" in str(e) and "fingerprint=True" in str(e)
    e = translate(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), "broadcast",
                  describe_group([0, 2], 3), 5.0, 0)  # fmt: skip
    assert isinstance(e, PeerLostError) and "sub-group [0, 2]" in str(e)
    e = translate(RuntimeError("invalid argument"), "all_gather", "g", 5.0, 0)
    assert type(e) is DistributedError and "invalid argument" in str(e)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": "mpi", "timeout_s": 3}, "backend must be 'gloo' or 'nccl'"),
        ({"backend": "gloo", "timeout_s": 0}, "timeout_s must be positive"),
        ({"backend": "gloo", "timeout_s": 3, "rank": 2, "world_size": 2}, "outside"),
    ],
)
def test_init_distributed_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_distributed(**kwargs)


def test_init_distributed_needs_rank_from_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK is not set"):
        init_distributed("gloo", 3.0, world_size=2)


def test_new_group_requires_positive_timeout():
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        new_group([0, 1], 0)


def test_socket_interface_check():
    check_socket_interfaces("gloo", {"GLOO_SOCKET_IFNAME": "lo"})
    check_socket_interfaces("gloo", {"NCCL_SOCKET_IFNAME": "zzz"})  # gloo ignores NCCL's
    with pytest.raises(InterfaceError, match="NCCL_SOCKET_IFNAME='zzz' matches no interface"):
        check_socket_interfaces("nccl", {"NCCL_SOCKET_IFNAME": "zzz"})
    with pytest.raises(InterfaceError, match="GLOO_SOCKET_IFNAME.*lo"):
        check_socket_interfaces("gloo", {"GLOO_SOCKET_IFNAME": "^lo"})
