"""Linter for NCCL / torch / gloo / launcher environment variables.

``lint(env)`` returns at most one :class:`Finding` per variable, so a report reads one line
per variable the user set. The rules are data: :data:`RULES`, one :class:`Rule` row each
(variable, condition, severity, message, fix, source), tried in order; the first row whose
variable and condition match gives the variable's finding (rows are ordered so that harmful
values come before spelling and style). Each row's ``source`` names where a reader can check
the fact: the NCCL user guide's environment-variable page, an upstream file and version
(NCCL 2.30 ``src/misc/param.cc``: integers are read with ``strtoll(s, NULL, 0)``, so ``2M``
is 2, ``08`` is 0 and ``abc`` is 0, all silently; ``src/transport/net_socket.cc``:
``MAX_SOCKETS 64``), torch's ``ProcessGroupNCCL.hpp`` / ``ProcessGroupGloo.cpp``, or an RFC.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import cached_property

from verl_comm.nccl.registry import (
    INT_KINDS,
    LINTED_NAMES,
    LINTED_PREFIXES,
    NEVER_READ,
    REGISTRY,
    REMOVED,
    EnvVar,
    known_names,
    lookup,
    strtoll0,
)
from verl_comm.nccl.topology import HostInfo, detect_host

SEVERITIES = ("error", "warning", "info")
_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
_DOCKER_NET = ipaddress.ip_network("172.17.0.0/16")


@dataclass(frozen=True)
class Finding:
    """One problem with one variable.

    Attributes:
        severity: ``"error"`` (wrong or harmful: ``verl-comm nccl lint`` exits 1),
            ``"warning"`` (probably not what was meant) or ``"info"``.
        variable: the variable name.
        message: what the reader really does with the value.
        fix: what to write instead (or ``"unset VAR"``).
    """

    severity: str
    variable: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict."""
        return asdict(self)


def _linted(name: str) -> bool:
    return name.startswith(LINTED_PREFIXES) or name in LINTED_NAMES


def _suggest_int(value: str) -> str:
    s = value.strip().upper()
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        for tail in (suffix + "IB", suffix + "B", suffix):
            if s.endswith(tail) and s[: -len(tail)].isdigit():
                return str(int(s[: -len(tail)]) * mult)
    return "<integer>"


def _best_iface(names: list[str]) -> str:
    good = [n for n in names if not n.startswith(("lo", "docker", "veth", "ifb", "virbr"))]
    return (good or names)[0]


@dataclass(frozen=True)
class Var:
    """One variable's value and what the rules may look at.

    Attributes:
        name, value: the variable and its text.
        env: every variable being linted (for rules on pairs of variables).
        host: interfaces and IB devices of the host.
        spec: the registry entry, or None for a name no reader knows.
    """

    name: str
    value: str
    env: Mapping[str, str]
    host: HostInfo
    spec: EnvVar | None

    @cached_property
    def parsed(self) -> int:
        """The value as NCCL reads it (``strtoll(s, NULL, 0)``)."""
        return strtoll0(self.value)[0]

    @cached_property
    def rest(self) -> str:
        """What ``strtoll`` did not consume."""
        return strtoll0(self.value)[1]

    @property
    def upper(self) -> str:
        """The stripped, upper-cased value (enums and levels)."""
        return self.value.strip().upper()

    @property
    def range_text(self) -> str:
        """``[min, max]`` of the registry entry, ``-inf``/``inf`` when unbounded."""
        lo, hi = self.spec.min_value, self.spec.max_value
        return f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"

    # interface lists -------------------------------------------------------------------
    @property
    def avail(self) -> str:
        """This host's interfaces, comma-separated."""
        return ", ".join(self.host.interface_names)

    @property
    def best_iface(self) -> str:
        """The interface to suggest (the first that is not loopback or virtual)."""
        return _best_iface(self.host.interface_names)

    @property
    def missing_ifaces(self) -> list[str]:
        """Names in a gloo-style exact list that this host lacks."""
        return [p for p in self.value.split(",") if p and p not in self.host.interface_names]

    @property
    def nccl_ifaces_chosen(self) -> list[str]:
        """The interfaces NCCL's ``[^][=]prefix,list`` syntax selects on this host."""
        exclude = self.value.startswith("^")
        spec = self.value[1:] if exclude else self.value
        exact = spec.startswith("=")
        parts = [p for p in (spec[1:] if exact else spec).split(",") if p]

        def hit(p: str, iface: str) -> bool:
            return iface == p if exact else iface.startswith(p)

        return [i for i in self.host.interface_names if any(hit(p, i) for p in parts) != exclude]

    @property
    def address(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The value as an IP address, or None (a host name)."""
        try:
            return ipaddress.ip_address(self.value.strip("[]"))
        except ValueError:
            return None


def _leading_zero(v: Var) -> bool:
    digits = v.value.strip().lstrip("+-")
    return len(digits) > 1 and digits.isdigit() and digits[0] == "0"


def _out_of_range(v: Var) -> bool:
    lo, hi = v.spec.min_value, v.spec.max_value
    return (lo is not None and v.parsed < lo) or (hi is not None and v.parsed > hi)


def _unknown_hint(name: str) -> str:
    close = difflib.get_close_matches(name, sorted(known_names()), n=1, cutoff=0.75)
    return f"did you mean {close[0]}?" if close else "check the spelling"


@dataclass(frozen=True)
class Rule:
    """One lint rule: a row of :data:`RULES`.

    Attributes:
        variable: which variables it is about: a name, a tuple of names, or a
            :class:`Kind` (a described class of variables, e.g. every integer variable).
        condition: ``Var -> bool``, true when the value is a problem.
        severity: ``"error"``, ``"warning"`` or ``"info"`` (see :class:`Finding`).
        message: ``Var -> str``, what the reader really does with the value.
        fix: ``Var -> str``, what to write instead.
        source: where the fact can be checked (a document, an upstream file and version).
    """

    variable: str | tuple[str, ...] | Kind
    condition: Callable[[Var], bool]
    severity: str
    message: Callable[[Var], str]
    fix: Callable[[Var], str]
    source: str

    def matches(self, v: Var) -> bool:
        """Whether this row is about ``v`` and its condition holds."""
        if isinstance(self.variable, Kind):
            about = self.variable.test(v)
        elif isinstance(self.variable, tuple):
            about = v.name in self.variable
        else:
            about = v.name == self.variable
        return about and self.condition(v)

    def finding(self, v: Var) -> Finding:
        """The :class:`Finding` of this row for ``v``."""
        return Finding(self.severity, v.name, self.message(v), self.fix(v))


@dataclass(frozen=True)
class Kind:
    """A class of variables a rule is about, with its description."""

    description: str
    test: Callable[[Var], bool]

    def __str__(self) -> str:
        return self.description


NEVER_READ_VARS = Kind("a name no reader reads (NEVER_READ)", lambda v: v.name in NEVER_READ)
REMOVED_VARS = Kind("a name removed from NCCL (REMOVED)", lambda v: v.name in REMOVED)
UNKNOWN_VARS = Kind(
    "an unregistered NCCL_* / TORCH_NCCL_* / TORCH_FR_* name",
    lambda v: v.spec is None and v.name.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_FR_")),
)
DEPRECATED_VARS = Kind(
    "a deprecated alias", lambda v: v.spec is not None and bool(v.spec.successor)
)
INT_VARS = Kind(
    "an integer or 0/1 variable", lambda v: v.spec is not None and v.spec.kind in INT_KINDS
)
ENUM_VARS = Kind("an enum variable", lambda v: v.spec is not None and v.spec.kind == "enum")
LEVEL_VARS = Kind(
    "a topology-level variable", lambda v: v.spec is not None and v.spec.kind == "level"
)
DEBUG_VARS = Kind(
    "a debugging-only variable", lambda v: v.spec is not None and v.spec.section == "debug"
)

NCCL_GUIDE = "NCCL user guide, Environment Variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html)"
NCCL_PARAM = "NCCL v2.30 src/misc/param.cc (ncclLoadParam: strtoll(str, nullptr, 0), no error)"
NCCL_SOCKET = "NCCL v2.30 src/transport/net_socket.cc (MAX_SOCKETS 64; NSOCKS_PERTHREAD, SOCKET_NTHREADS auto per NIC)"
REGISTRY_CSV = "verl_comm/nccl/data/env_registry.csv (ranges and choices from the NCCL user guide)"
TORCH_NCCL = "torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (TORCH_NCCL_ASYNC_ERROR_HANDLING; NCCL_ASYNC_ERROR_HANDLING its deprecated alias), torch 2.x"
TORCH_GLOO = "torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (GLOO_SOCKET_IFNAME: comma-separated exact interface names), torch 2.x"

RULES: tuple[Rule, ...] = (
    Rule(
        NEVER_READ_VARS, lambda v: True, "error",
        lambda v: f"{v.name} is read by nothing (NCCL ignores unknown names silently): "
        "setting it changes no timeout",
        lambda v: f"unset {v.name}; {NEVER_READ[v.name]}",
        f"{NCCL_GUIDE} (no such variable); {NCCL_PARAM}: only declared parameters are read",
    ),
    Rule(
        REMOVED_VARS, lambda v: True, "error",
        lambda v: f"{v.name} was removed in NCCL {REMOVED[v.name][0]}; NCCL 2.30 does not read it",
        lambda v: f"unset {v.name}" + (f"; use {REMOVED[v.name][1]}" if REMOVED[v.name][1] else ""),
        "NCCL 2.5 release notes (LL/tree thresholds replaced by NCCL_PROTO / NCCL_ALGO); "
        + NCCL_GUIDE,
    ),
    Rule(
        UNKNOWN_VARS, lambda v: True, "warning",
        lambda v: f"{v.name} is not read by NCCL "
        f"{'' if v.name.startswith('NCCL_') else 'or torch '}(unknown names are ignored silently)",
        lambda v: _unknown_hint(v.name),
        f"{NCCL_PARAM}: only declared parameters are read; {NCCL_GUIDE}",
    ),
    # harmful values first: they matter more than spelling
    Rule(
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
        lambda v: v.spec is not None and v.parsed == 0, "error",
        lambda v: f"{v.name}=0 disables the ProcessGroupNCCL watchdog's abort: a timed-out or "
        "failed collective no longer fails, so a dead peer hangs the job"
        + (f" ({v.name} is torch's deprecated alias of {v.spec.successor})" if v.spec.successor else ""),
        lambda v: "unset it, or TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down) / 3 (abort, raise)",
        TORCH_NCCL,
    ),
    Rule(
        "NCCL_NSOCKS_PERTHREAD",
        lambda v: v.spec is not None and "NCCL_SOCKET_NTHREADS" not in v.env, "warning",
        lambda v: f"{v.name}={v.value} without NCCL_SOCKET_NTHREADS: on generic NICs NCCL "
        "auto-selects 0 helper threads, so no extra sockets are opened (auto only on AWS 2x8, "
        "GCP 4x1)",
        lambda v: "set NCCL_SOCKET_NTHREADS too (threads x sockets <= 64), e.g. 4 and 4, or "
        "unset both",
        NCCL_SOCKET,
    ),
    Rule(
        DEPRECATED_VARS, lambda v: True, "warning",
        lambda v: f"{v.name} is deprecated: {v.spec.doc}; use {v.spec.successor}"
        + ("; debugging only" if v.spec.section == "debug" else ""),
        lambda v: f"unset {v.name}"
        + ("" if v.spec.section == "debug" else f"; set {v.spec.successor}"),
        f"{NCCL_GUIDE} (deprecated names); {TORCH_NCCL}",
    ),
    Rule(
        INT_VARS, _leading_zero, "error",
        lambda v: f"{v.name}={v.value!r}: a leading 0 means octal to strtoll(s, 0), so NCCL "
        f"reads {v.parsed}" + (f" (it stops at {v.rest.strip()!r})" if v.rest.strip() else ""),
        lambda v: f"drop the leading zeros: {v.name}={int(v.value.strip(), 10)}",
        NCCL_PARAM,
    ),
    Rule(
        INT_VARS, lambda v: bool(v.rest.strip()), "error",
        lambda v: f"{v.name}={v.value!r} is parsed with strtoll(s, 0) as {v.parsed} ("
        + ("no digits at all" if v.rest == v.value else f"it stops at {v.rest.strip()!r}")
        + "); NCCL says nothing",
        lambda v: f"write a plain integer, e.g. {v.name}={_suggest_int(v.value)}",
        NCCL_PARAM,
    ),
    Rule(
        INT_VARS, _out_of_range, "error",
        lambda v: f"{v.name}={v.parsed} is outside the valid range {v.range_text} ({v.spec.doc})",
        lambda v: f"use a value in {v.range_text} or unset {v.name} (default {v.spec.default})",
        REGISTRY_CSV,
    ),
    Rule(
        ENUM_VARS, lambda v: v.upper not in v.spec.choices, "error",
        lambda v: f"{v.name}={v.value!r} is not one of {', '.join(v.spec.choices)}",
        lambda v: f"{v.name}={v.spec.choices[0]}",
        REGISTRY_CSV,
    ),
    Rule(
        LEVEL_VARS,
        lambda v: v.upper not in _LEVELS and bool(v.rest.strip() or not v.value.strip()),
        "error",
        lambda v: f"{v.name}={v.value!r} is not a level",
        lambda v: "one of " + ", ".join(_LEVELS),
        f"{NCCL_GUIDE} (NCCL_P2P_LEVEL: LOC, NVL, PIX, PXB, PHB, SYS or an integer)",
    ),
    Rule(
        "NCCL_SOCKET_NTHREADS",
        lambda v: v.spec is not None
        and "NCCL_NSOCKS_PERTHREAD" in v.env
        and v.parsed * strtoll0(v.env["NCCL_NSOCKS_PERTHREAD"])[0] > 64,
        "error",
        lambda v: (
            lambda nt, ns: f"NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = {nt} x {ns} = "
            f"{nt * ns} > 64: NCCL clamps NCCL_NSOCKS_PERTHREAD to {64 // max(nt, 1)}"
        )(v.parsed, strtoll0(v.env["NCCL_NSOCKS_PERTHREAD"])[0]),
        lambda v: "keep threads x sockets <= 64",
        NCCL_SOCKET,
    ),
    Rule(
        "NCCL_SOCKET_IFNAME",
        lambda v: v.spec is not None and bool(v.host.interface_names) and not v.nccl_ifaces_chosen,
        "error",
        lambda v: f"{v.name}={v.value!r} matches no interface on this host (NCCL then fails "
        f"with 'no socket interface found'); interfaces here: {v.avail}",
        lambda v: f"{v.name}={v.best_iface}",
        f"{NCCL_GUIDE} (NCCL_SOCKET_IFNAME: prefixes, ^ to exclude, = for exact names)",
    ),
    Rule(
        "GLOO_SOCKET_IFNAME",
        lambda v: v.spec is not None
        and bool(v.host.interface_names)
        and v.value.startswith(("^", "=")),
        "error",
        lambda v: f"{v.name}={v.value!r} uses NCCL's '^'/'=' syntax; gloo takes exact interface "
        f"names and fails at init. Interfaces here: {v.avail}",
        lambda v: f"name the interface exactly, e.g. {v.name}={v.best_iface}",
        TORCH_GLOO,
    ),
    Rule(
        "GLOO_SOCKET_IFNAME",
        lambda v: v.spec is not None and bool(v.host.interface_names) and bool(v.missing_ifaces),
        "error",
        lambda v: f"{v.name}: no interface named {', '.join(v.missing_ifaces)} on this host; "
        f"interfaces here: {v.avail}",
        lambda v: f"{v.name}={v.best_iface}",
        TORCH_GLOO,
    ),
    Rule(
        "MASTER_ADDR",
        lambda v: v.spec is not None and v.address is not None and v.address.is_link_local,
        "warning",
        lambda v: f"MASTER_ADDR={v.value} is a link-local address: other nodes usually cannot "
        "route to it",
        lambda v: "use the address of rank 0's data-network interface",
        "RFC 3927 (IPv4 169.254.0.0/16) and RFC 4291 (IPv6 fe80::/10): link-local addresses",
    ),
    Rule(
        "MASTER_ADDR",
        lambda v: v.spec is not None
        and v.address is not None
        and v.address.version == 4
        and v.address in _DOCKER_NET,
        "warning",
        lambda v: f"MASTER_ADDR={v.value} is in docker's default bridge 172.17.0.0/16: "
        "reachable only from containers on the same host",
        lambda v: "use the host's address (docker --network=host) or rank 0's routable address",
        "Docker documentation, Networking, default bridge network (172.17.0.0/16)",
    ),
    Rule(
        "NCCL_IB_DISABLE",
        lambda v: v.spec is not None and v.parsed == 1 and bool(v.host.ib_devices),
        "error",
        lambda v: "NCCL_IB_DISABLE=1 throws away RDMA: this host has verbs devices "
        f"({', '.join(v.host.ib_devices)}), NCCL will use TCP sockets instead",
        lambda v: "unset NCCL_IB_DISABLE",
        f"{NCCL_GUIDE} (NCCL_IB_DISABLE)",
    ),
    Rule(
        "NCCL_IB_DISABLE",
        lambda v: v.spec is not None and v.parsed == 1,
        "warning",
        lambda v: "NCCL_IB_DISABLE=1 forces TCP sockets; on IB/RoCE clusters it throws RDMA "
        "away (no verbs devices on this host, so here it changes nothing)",
        lambda v: "unset NCCL_IB_DISABLE unless you are debugging the IB transport",
        f"{NCCL_GUIDE} (NCCL_IB_DISABLE)",
    ),
    Rule(
        "NCCL_BUFFSIZE",
        lambda v: v.spec is not None and v.parsed != 1 << 22,
        "warning",
        lambda v: f"NCCL_BUFFSIZE={v.parsed} ({v.parsed / 2**20:g} MiB) changes the default 4 MiB "
        "per-channel buffer"
        + (": smaller buffers lower large-message bandwidth" if v.parsed < 1 << 22 else ""),
        lambda v: "unset NCCL_BUFFSIZE unless a measurement (verl-comm nccl autotune) says so",
        f"{NCCL_GUIDE} (NCCL_BUFFSIZE, default 4194304)",
    ),
    Rule(
        DEBUG_VARS,
        lambda v: not (v.name == "NCCL_DEBUG_SUBSYS" and "NCCL_DEBUG" in v.env),
        "warning",
        lambda v: f"{v.name} is a debugging-only variable ({v.spec.doc})",
        lambda v: f"unset {v.name} outside debugging sessions",
        f"{NCCL_GUIDE} (section Debugging)",
    ),
    Rule(
        "NCCL_DEBUG",
        lambda v: v.spec is not None and v.upper in ("INFO", "TRACE"),
        "info",
        lambda v: f"NCCL_DEBUG={v.value} logs every init/connection per rank: debugging only",
        lambda v: "NCCL_DEBUG=WARN in production",
        f"{NCCL_GUIDE} (NCCL_DEBUG)",
    ),
)  # fmt: skip
"""The lint rules in the order they are tried; the first match is the variable's finding."""


def matching_rule(
    name: str, value: str, env: Mapping[str, str], host: HostInfo
) -> tuple[Rule, Var] | None:
    """The first row of :data:`RULES` that matches ``name=value`` (with the other variables
    ``env`` on ``host``), and the :class:`Var` it was matched on; None when none does."""
    v = Var(name, value, env, host, lookup(name))
    for rule in RULES:
        if rule.matches(v):
            return rule, v
    return None


def _check_one(name: str, value: str, env: Mapping[str, str], host: HostInfo) -> Finding | None:
    hit = matching_rule(name, value, env, host)
    return None if hit is None else hit[0].finding(hit[1])


def lint(env: Mapping[str, str], host: HostInfo | None = None) -> list[Finding]:
    """Check the communication variables in ``env`` (e.g. ``os.environ`` or a preset table).

    Args:
        env: variable name -> value; names outside ``NCCL_*``, ``TORCH_NCCL_*``,
            ``TORCH_FR_*``, ``GLOO_*``, ``FI_EFA_*``, ``MASTER_ADDR``/``MASTER_PORT``,
            ``TORCH_DISTRIBUTED_DEBUG``, ``FI_PROVIDER`` are ignored.
        host: interfaces and IB devices to check names against; ``None`` detects this host
            (``nvidia-smi`` calls bounded to 10 s).

    Returns:
        At most one :class:`Finding` per variable, errors first, then by name.
    """
    names = sorted(n for n in env if _linted(n))
    if host is None:
        host = detect_host() if names else HostInfo()
    findings = [f for n in names if (f := _check_one(n, str(env[n]), env, host)) is not None]
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.variable))


def has_errors(findings: list[Finding]) -> bool:
    """True when any finding has severity ``"error"``."""
    return any(f.severity == "error" for f in findings)


__all__ = ["RULES", "Finding", "Rule", "lint", "has_errors", "REGISTRY"]
