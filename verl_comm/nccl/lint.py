"""Linter for NCCL / torch / gloo / launcher environment variables.

``lint(env)`` returns at most one :class:`Finding` per variable (the most severe problem,
its message covering the rest), so a report reads one line per variable the user set. The
facts behind each rule (``FACTS.md`` section 4; NCCL 2.30 sources):

- NCCL ignores unknown names silently; ``NCCL_SOCKET_TIMEOUT`` / ``NCCL_TIMEOUT`` are read by
  nothing.
- NCCL parses integers with ``strtoll(s, NULL, 0)``: ``2M`` is 2, ``08`` is 0 (octal), ``abc``
  is 0, all silently (see :func:`verl_comm.nccl.registry.strtoll0`).
- ``NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD <= 64`` (``MAX_SOCKETS`` in
  ``net_socket.cc``); ``NCCL_NSOCKS_PERTHREAD`` alone multiplies 0 auto threads on generic NICs.
- ``(TORCH_)NCCL_ASYNC_ERROR_HANDLING=0`` turns the watchdog's abort off: a dead peer hangs
  the job instead of failing it.
"""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from dataclasses import asdict, dataclass

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


def _int_problem(spec: EnvVar, value: str) -> Finding | None:
    parsed, rest = strtoll0(value)
    meant = value.strip()
    digits = meant.lstrip("+-")
    if len(digits) > 1 and digits.isdigit() and digits[0] == "0":
        return Finding(
            "error",
            spec.name,
            f"{spec.name}={value!r}: a leading 0 means octal to strtoll(s, 0), so NCCL reads "
            f"{parsed}" + (f" (it stops at {rest.strip()!r})" if rest.strip() else ""),
            f"drop the leading zeros: {spec.name}={int(meant, 10)}",
        )
    if rest.strip():
        what = "no digits at all" if rest == value else f"it stops at {rest.strip()!r}"
        return Finding(
            "error",
            spec.name,
            f"{spec.name}={value!r} is parsed with strtoll(s, 0) as {parsed} ({what}); "
            "NCCL says nothing",
            f"write a plain integer, e.g. {spec.name}={_suggest_int(value)}",
        )
    lo, hi = spec.min_value, spec.max_value
    if (lo is not None and parsed < lo) or (hi is not None and parsed > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        return Finding(
            "error",
            spec.name,
            f"{spec.name}={parsed} is outside the valid range {rng} ({spec.doc})",
            f"use a value in {rng} or unset {spec.name} (default {spec.default})",
        )
    return None


def _suggest_int(value: str) -> str:
    s = value.strip().upper()
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        for tail in (suffix + "IB", suffix + "B", suffix):
            if s.endswith(tail) and s[: -len(tail)].isdigit():
                return str(int(s[: -len(tail)]) * mult)
    return "<integer>"


def _ifname_problem(name: str, value: str, host: HostInfo, nccl_syntax: bool) -> Finding | None:
    names = host.interface_names
    if not names:
        return None
    avail = ", ".join(names)
    if not nccl_syntax:
        if value.startswith(("^", "=")):
            return Finding(
                "error",
                name,
                f"{name}={value!r} uses NCCL's '^'/'=' syntax; gloo takes exact interface "
                f"names and fails at init. Interfaces here: {avail}",
                f"name the interface exactly, e.g. {name}={_best_iface(names)}",
            )
        missing = [p for p in value.split(",") if p and p not in names]
        if missing:
            return Finding(
                "error",
                name,
                f"{name}: no interface named {', '.join(missing)} on this host; "
                f"interfaces here: {avail}",
                f"{name}={_best_iface(names)}",
            )
        return None
    exclude = value.startswith("^")
    spec = value[1:] if exclude else value
    exact = spec.startswith("=")
    parts = [p for p in (spec[1:] if exact else spec).split(",") if p]

    def hit(p: str, iface: str) -> bool:
        return iface == p if exact else iface.startswith(p)

    chosen = [i for i in names if any(hit(p, i) for p in parts) != exclude]
    if not chosen:
        return Finding(
            "error",
            name,
            f"{name}={value!r} matches no interface on this host (NCCL then fails with "
            f"'no socket interface found'); interfaces here: {avail}",
            f"{name}={_best_iface(names)}",
        )
    return None


def _best_iface(names: list[str]) -> str:
    good = [n for n in names if not n.startswith(("lo", "docker", "veth", "ifb", "virbr"))]
    return (good or names)[0]


def _master_addr_problem(value: str) -> Finding | None:
    try:
        addr = ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return None
    if addr.is_link_local:
        return Finding(
            "warning",
            "MASTER_ADDR",
            f"MASTER_ADDR={value} is a link-local address: other nodes usually cannot route to it",
            "use the address of rank 0's data-network interface",
        )
    if addr.version == 4 and addr in _DOCKER_NET:
        return Finding(
            "warning",
            "MASTER_ADDR",
            f"MASTER_ADDR={value} is in docker's default bridge 172.17.0.0/16: reachable "
            "only from containers on the same host",
            "use the host's address (docker --network=host) or rank 0's routable address",
        )
    return None


def _check_one(name: str, value: str, env: Mapping[str, str], host: HostInfo) -> Finding | None:
    if name in NEVER_READ:
        return Finding(
            "error",
            name,
            f"{name} is read by nothing (NCCL ignores unknown names silently): setting it "
            "changes no timeout",
            f"unset {name}; {NEVER_READ[name]}",
        )
    if name in REMOVED:
        release, repl = REMOVED[name]
        return Finding(
            "error",
            name,
            f"{name} was removed in NCCL {release}; NCCL 2.30 does not read it",
            f"unset {name}" + (f"; use {repl}" if repl else ""),
        )
    spec = lookup(name)
    if spec is None:
        if name.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_FR_")):
            close = difflib.get_close_matches(name, sorted(known_names()), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}?" if close else "check the spelling"
            return Finding(
                "warning",
                name,
                f"{name} is not read by NCCL {'' if name.startswith('NCCL_') else 'or torch '}"
                "(unknown names are ignored silently)",
                hint,
            )
        return None
    # harmful values first: they matter more than spelling.
    if name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        parsed, _ = strtoll0(value)
        if parsed == 0:
            alias = (
                f" ({name} is torch's deprecated alias of {spec.successor})"
                if spec.successor
                else ""
            )
            return Finding(
                "error",
                name,
                f"{name}=0 disables the ProcessGroupNCCL watchdog's abort: a timed-out or "
                f"failed collective no longer fails, so a dead peer hangs the job{alias}",
                "unset it, or TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down) / 3 (abort, raise)",
            )
    if name == "NCCL_NSOCKS_PERTHREAD" and "NCCL_SOCKET_NTHREADS" not in env:
        return Finding(
            "warning",
            name,
            f"{name}={value} without NCCL_SOCKET_NTHREADS: on generic NICs NCCL auto-selects "
            "0 helper threads, so no extra sockets are opened (auto only on AWS 2x8, GCP 4x1)",
            "set NCCL_SOCKET_NTHREADS too (threads x sockets <= 64), e.g. 4 and 4, or unset both",
        )
    if spec.successor:
        return Finding(
            "warning",
            name,
            f"{name} is deprecated: {spec.doc}; use {spec.successor}"
            + ("; debugging only" if spec.section == "debug" else ""),
            f"unset {name}" + ("" if spec.section == "debug" else f"; set {spec.successor}"),
        )
    if spec.kind in INT_KINDS:
        problem = _int_problem(spec, value)
        if problem:
            return problem
    if spec.kind == "enum" and value.strip().upper() not in spec.choices:
        return Finding(
            "error",
            name,
            f"{name}={value!r} is not one of {', '.join(spec.choices)}",
            f"{name}={spec.choices[0]}",
        )
    if spec.kind == "level" and value.strip().upper() not in _LEVELS:
        if strtoll0(value)[1].strip() or not value.strip():
            return Finding(
                "error", name, f"{name}={value!r} is not a level", "one of " + ", ".join(_LEVELS)
            )
    if name == "NCCL_SOCKET_NTHREADS" and "NCCL_NSOCKS_PERTHREAD" in env:
        nt, ns = strtoll0(value)[0], strtoll0(env["NCCL_NSOCKS_PERTHREAD"])[0]
        if nt * ns > 64:
            return Finding(
                "error",
                name,
                f"NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD = {nt} x {ns} = {nt * ns} > 64: "
                f"NCCL clamps NCCL_NSOCKS_PERTHREAD to {64 // max(nt, 1)}",
                "keep threads x sockets <= 64",
            )
    if name == "NCCL_SOCKET_IFNAME":
        return _ifname_problem(name, value, host, nccl_syntax=True)
    if name == "GLOO_SOCKET_IFNAME":
        return _ifname_problem(name, value, host, nccl_syntax=False)
    if name == "MASTER_ADDR":
        return _master_addr_problem(value)
    if name == "NCCL_IB_DISABLE" and strtoll0(value)[0] == 1:
        if host.ib_devices:
            return Finding(
                "error",
                name,
                f"NCCL_IB_DISABLE=1 throws away RDMA: this host has verbs devices "
                f"({', '.join(host.ib_devices)}), NCCL will use TCP sockets instead",
                "unset NCCL_IB_DISABLE",
            )
        return Finding(
            "warning",
            name,
            "NCCL_IB_DISABLE=1 forces TCP sockets; on IB/RoCE clusters it throws RDMA away "
            "(no verbs devices on this host, so here it changes nothing)",
            "unset NCCL_IB_DISABLE unless you are debugging the IB transport",
        )
    if name == "NCCL_BUFFSIZE":
        parsed = strtoll0(value)[0]
        if parsed != 1 << 22:
            return Finding(
                "warning",
                name,
                f"NCCL_BUFFSIZE={parsed} ({parsed / 2**20:g} MiB) changes the default 4 MiB "
                "per-channel buffer"
                + (": smaller buffers lower large-message bandwidth" if parsed < 1 << 22 else ""),
                "unset NCCL_BUFFSIZE unless a measurement (verl-comm nccl autotune) says so",
            )
    if spec.section == "debug" and not (name == "NCCL_DEBUG_SUBSYS" and "NCCL_DEBUG" in env):
        return Finding(
            "warning",
            name,
            f"{name} is a debugging-only variable ({spec.doc})",
            f"unset {name} outside debugging sessions",
        )
    if name == "NCCL_DEBUG" and value.strip().upper() in ("INFO", "TRACE"):
        return Finding(
            "info",
            name,
            f"NCCL_DEBUG={value} logs every init/connection per rank: debugging only",
            "NCCL_DEBUG=WARN in production",
        )
    return None


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


__all__ = ["Finding", "lint", "has_errors", "REGISTRY"]
