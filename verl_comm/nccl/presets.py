"""NCCL environment presets: tables of (variable, value, reason) applied before
``init_process_group``.

Modelled on torchtitan's ``distributed/utils.py``: a preset never overrides a variable the
user set; it warns and keeps the user's value. NCCL reads its environment once, at
communicator init, so :func:`apply_preset` must run before the first process group (and
before spawning children that inherit the environment).

Every network preset includes ``pytorch-safety``. Non-environment advice of a preset
(explicit process-group timeout, eager init with ``device_id``) is in
:attr:`Preset.init_options` and honoured by :func:`verl_comm.distributed.init_distributed`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from verl_comm.nccl.registry import LINTED_NAMES, LINTED_PREFIXES


@dataclass(frozen=True)
class PresetEntry:
    """One row of a preset: set ``variable`` to ``value`` because ``reason``."""

    variable: str
    value: str
    reason: str


@dataclass(frozen=True)
class Preset:
    """A named environment table.

    Attributes:
        name: preset name, e.g. ``"cloud-tcp"``.
        summary: when to use it.
        entries: the rows, applied in order.
        init_options: advice for ``init_process_group`` that is not an environment
            variable: ``(option, value, reason)``, e.g. ``("timeout_s", "600", ...)``.
    """

    name: str
    summary: str
    entries: tuple[PresetEntry, ...]
    init_options: tuple[tuple[str, str, str], ...] = field(default=())

    def as_env(self) -> dict[str, str]:
        """The preset as ``{variable: value}``."""
        return {e.variable: e.value for e in self.entries}


_SAFETY = (
    PresetEntry(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "1",
        "tear down on a timed-out or failed collective: a dead peer fails the job instead of "
        "hanging it (torchrun's own setting; Ray/mp.spawn launches do not set it)",
    ),
    PresetEntry(
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "2000",
        "flight recorder: keep the last 2000 collective events per rank",
    ),
    PresetEntry(
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "1",
        "dump the flight recorder when a collective times out: shows which rank is stuck where",
    ),
    PresetEntry(
        "TORCH_NCCL_ENABLE_MONITORING",
        "1",
        "heartbeat monitor kills a process whose watchdog itself is stuck",
    ),
    PresetEntry("NCCL_DEBUG", "WARN", "production log level: warnings and errors only"),
)
_SAFETY_INIT = (
    ("timeout_s", "600", "explicit process-group timeout, passed to every sub-group too"),
    ("device_id", "local_rank", "eager NCCL init: communicator errors surface at init"),
)
_NO_DOCKER = "^docker,lo,veth,virbr"

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "pytorch-safety",
            "timeouts that fire, flight recorder and dump on timeout; safe everywhere",
            _SAFETY,
            _SAFETY_INIT,
        ),
        Preset(
            "nvlink-single-node",
            "one node, GPUs joined by NVLink (NVSwitch or direct): keep traffic on NVLink",
            _SAFETY
            + (
                PresetEntry(
                    "NCCL_SOCKET_IFNAME",
                    "lo",
                    "single node: bootstrap over loopback, never a docker bridge or a down NIC",
                ),
                PresetEntry("GLOO_SOCKET_IFNAME", "lo", "same for gloo side groups"),
                PresetEntry(
                    "NCCL_NVLS_ENABLE",
                    "0",
                    "NVLink SHARP needs NVSwitch multicast through the fabric manager; it "
                    "fails where multicast is not granted (containers, VMs, 2-GPU boxes)",
                ),
            ),
            _SAFETY_INIT,
        ),
        Preset(
            "cloud-tcp",
            "nodes joined by a TCP/IP network (no IB/RoCE): more sockets per connection",
            _SAFETY
            + (
                PresetEntry(
                    "NCCL_SOCKET_IFNAME",
                    _NO_DOCKER,
                    "never use docker/veth bridges or loopback for inter-node traffic",
                ),
                PresetEntry(
                    "NCCL_SOCKET_NTHREADS",
                    "4",
                    "4 helper threads per connection: one TCP stream cannot fill 25-100 Gb/s",
                ),
                PresetEntry(
                    "NCCL_NSOCKS_PERTHREAD",
                    "4",
                    "4 sockets per thread: 16 streams in all (threads x sockets <= 64)",
                ),
                PresetEntry(
                    "NCCL_SOCKET_RETRY_CNT",
                    "60",
                    "ride out slow node start-up: 60 retries, linearly growing sleeps",
                ),
            ),
            _SAFETY_INIT,
        ),
        Preset(
            "ib-multinode",
            "nodes joined by InfiniBand or RoCE: RDMA with GPUDirect",
            _SAFETY
            + (
                PresetEntry(
                    "NCCL_SOCKET_IFNAME",
                    _NO_DOCKER,
                    "bootstrap/out-of-band traffic on a routable interface",
                ),
                PresetEntry("NCCL_IB_DISABLE", "0", "keep the IB/RoCE verbs transport (RDMA) on"),
                PresetEntry(
                    "NCCL_IB_TIMEOUT",
                    "22",
                    "4.096 us x 2^22 = 17 s per retry instead of 4.3 s: fewer spurious "
                    "'retry counter exceeded' errors on large or congested fabrics",
                ),
                PresetEntry("NCCL_IB_RETRY_CNT", "7", "the IB maximum number of retries"),
            ),
            _SAFETY_INIT,
        ),
        Preset(
            "aws-efa",
            "AWS instances with EFA (p4d/p5) through the aws-ofi-nccl plugin",
            _SAFETY
            + (
                PresetEntry("FI_PROVIDER", "efa", "libfabric: use the EFA provider"),
                PresetEntry("FI_EFA_USE_DEVICE_RDMA", "1", "GPUDirect RDMA over EFA (p4d, p5)"),
                PresetEntry("FI_EFA_FORK_SAFE", "1", "dataloader workers fork after EFA init"),
                PresetEntry(
                    "NCCL_SOCKET_IFNAME",
                    _NO_DOCKER,
                    "bootstrap on the instance's ENI, not a docker bridge",
                ),
            ),
            _SAFETY_INIT,
        ),
    )
}


def get_preset(name: str) -> Preset:
    """Return the preset called ``name``.

    Raises:
        KeyError: unknown name; the message lists the presets.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(
            f"unknown NCCL preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None


def comm_env(env: Mapping[str, str]) -> dict[str, str]:
    """The communication-relevant part of ``env`` (the variables the linter owns), sorted."""
    return {
        k: env[k]
        for k in sorted(env)
        if k.startswith(LINTED_PREFIXES) or k in LINTED_NAMES or k.startswith("FI_")
    }


def apply_preset(name: str, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the preset's variables in ``env`` (default ``os.environ``) where the user has not.

    Call before ``init_process_group``: NCCL reads its environment at communicator init.

    Args:
        name: one of :data:`PRESETS`.
        env: the mapping to update in place; ``None`` means ``os.environ``.

    Returns:
        The effective communication environment after applying (``{variable: value}``, the
        user's own values included), for the run's metadata.

    Raises:
        KeyError: unknown preset name (the message lists the choices).

    Warns:
        UserWarning: once per variable the user set to another value; the user's value is kept.
    """
    preset = get_preset(name)
    target = os.environ if env is None else env
    for e in preset.entries:
        current = target.get(e.variable)
        if current is None:
            target[e.variable] = e.value
        elif current != e.value:
            warnings.warn(
                f"NCCL preset {name!r}: keeping your {e.variable}={current!r} "
                f"(the preset would set {e.value!r}: {e.reason})",
                UserWarning,
                stacklevel=2,
            )
    return comm_env(target)
