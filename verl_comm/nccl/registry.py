"""Registry of the environment variables that NCCL, torch's ProcessGroupNCCL, gloo and the
launcher read.

Sources: the list of names NCCL 2.30 reads (``data/nccl_2.30_env_names.txt``, extracted from
the ``NCCL_PARAM``/``ncclGetEnv`` calls of the NCCL 2.30 sources), defaults from those sources
(``src/misc/param.cc``, ``src/transport/net_socket.cc``, ``src/graph/connect.cc``), the NCCL
user guide's environment-variable page (sections "production" vs "debugging"), and torch's
``ProcessGroupNCCL.hpp`` (``TORCH_NCCL_*`` names and their deprecated ``NCCL_*`` aliases).

Every name NCCL 2.30 reads is known (:func:`nccl_names`); the variables that matter for
tuning or that circulate in advice carry a detailed :class:`EnvVar` in :data:`REGISTRY`,
loaded from ``data/env_registry.csv`` (edit the table there).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

NCCL_VERSION = "2.30"

#: integer parameter kinds are parsed by NCCL with C's ``strtoll(s, NULL, 0)``.
INT_KINDS = ("int", "bool")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable and what its reader does with it.

    Attributes:
        name: the variable, e.g. ``"NCCL_BUFFSIZE"``.
        owner: who reads it: ``"nccl"``, ``"torch"`` (ProcessGroupNCCL / c10d), ``"gloo"``,
            ``"launcher"`` (``MASTER_ADDR``/``MASTER_PORT``) or ``"libfabric"``.
        kind: ``"int"`` (``strtoll(s, 0)``), ``"bool"`` (0/1 through ``strtoll``), ``"str"``,
            ``"ifname"`` (NCCL interface list), ``"level"`` (LOC/NVL/PIX/PXB/PHB/SYS or int),
            ``"enum"`` (one of ``choices``).
        default: the reader's default as text (``None`` = unset / auto-detected).
        min_value, max_value: inclusive integer range (``None`` = unbounded).
        section: ``"production"`` or ``"debug"`` (the user guide's debugging section: never
            set in a production preset).
        doc: one line on what it does, in the reader's terms.
        successor: for a deprecated alias, the name to use instead.
        choices: accepted values for ``kind == "enum"`` (upper-case).
    """

    name: str
    owner: str
    kind: str
    default: str | None
    doc: str
    section: str = "production"
    min_value: int | None = None
    max_value: int | None = None
    successor: str | None = None
    choices: tuple[str, ...] = ()


def _parse_int(text: str) -> int | None:
    return int(text) if text else None


def _load_registry() -> dict[str, EnvVar]:
    """Read ``data/env_registry.csv`` (one row per variable; ``choices`` ``|``-separated).

    Raises:
        FileNotFoundError: the data file is missing from the installation (reinstall).
        ValueError: a malformed row, naming the variable.
    """
    text = (resources.files("verl_comm.nccl") / "data" / "env_registry.csv").read_text()
    out: dict[str, EnvVar] = {}
    for row in csv.DictReader(io.StringIO(text)):
        try:
            out[row["name"]] = EnvVar(
                name=row["name"],
                owner=row["owner"],
                kind=row["kind"],
                default=row["default"] or None,
                doc=row["doc"],
                section=row["section"],
                min_value=_parse_int(row["min_value"]),
                max_value=_parse_int(row["max_value"]),
                successor=row["successor"] or None,
                choices=tuple(c for c in row["choices"].split("|") if c),
            )
        except (KeyError, ValueError) as e:
            raise ValueError(f"env_registry.csv: bad row for {row.get('name')!r}: {e}") from e
    return out


#: detailed entries by name (``data/env_registry.csv``): the variables that matter for tuning
#: or circulate in advice, with default, type, range, section and successor.
REGISTRY: dict[str, EnvVar] = _load_registry()

#: names that advice circulates but nothing reads, with what to use instead.
NEVER_READ: dict[str, str] = {
    "NCCL_SOCKET_TIMEOUT": "NCCL has no socket timeout: use NCCL_SOCKET_RETRY_CNT / "
    "NCCL_SOCKET_RETRY_SLEEP_MSEC for connection retries, NCCL_IB_TIMEOUT on IB, and "
    "init_process_group(timeout=...) for collectives",
    "NCCL_TIMEOUT": "NCCL has no such timeout: pass init_process_group(timeout=...) "
    "(verl_comm.distributed.init_distributed(timeout_s=...))",
}

#: removed or renamed NCCL names: name -> (release that removed it, replacement or "").
REMOVED: dict[str, tuple[str, str]] = {
    "NCCL_LL_THRESHOLD": ("2.5", "NCCL_PROTO (debugging only)"),
    "NCCL_TREE_THRESHOLD": ("2.5", "NCCL_ALGO (debugging only)"),
    "NCCL_SINGLE_RING_THRESHOLD": ("2.5", ""),
    "NCCL_IB_GDR_LEVEL": ("2.4", "NCCL_NET_GDR_LEVEL"),
    "NCCL_IB_CUDA_SUPPORT": ("2.4", "NCCL_NET_GDR_LEVEL"),
}

#: prefixes the linter owns; other variables are left alone.
LINTED_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_", "FI_EFA_")
LINTED_NAMES = ("MASTER_ADDR", "MASTER_PORT", "TORCH_DISTRIBUTED_DEBUG", "FI_PROVIDER")


@lru_cache(maxsize=1)
def nccl_names() -> frozenset[str]:
    """Names NCCL 2.30 reads (one per line in ``data/nccl_2.30_env_names.txt``).

    Raises:
        FileNotFoundError: the data file is missing from the installation (reinstall).
    """
    text = (resources.files("verl_comm.nccl") / "data" / "nccl_2.30_env_names.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


def known_names() -> frozenset[str]:
    """Every name something reads: NCCL's list plus the detailed registry (torch, gloo, ...)."""
    return nccl_names() | frozenset(REGISTRY)


def lookup(name: str) -> EnvVar | None:
    """Return the :class:`EnvVar` for ``name``; a generic NCCL entry for names in NCCL's list
    without a detailed one; ``None`` when nothing reads the name."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name in nccl_names():
        return EnvVar(name, "nccl", "str", None, "read by NCCL 2.30 (see the NCCL user guide)")
    return None


def strtoll0(text: str) -> tuple[int, str]:
    """Emulate C's ``strtoll(text, &end, 0)`` as NCCL's ``ncclParam`` uses it.

    Leading whitespace and a sign are accepted; ``0x``/``0X`` selects hex, a leading ``0``
    octal, otherwise decimal; parsing stops at the first invalid digit. No digits at all
    gives 0. Returns ``(value, rest)`` where ``rest`` is the unparsed tail (what NCCL
    silently ignores). Examples: ``"2M" -> (2, "M")``, ``"08" -> (0, "8")``,
    ``"abc" -> (0, "abc")``, ``"0x10" -> (16, "")``.
    """
    s = text.lstrip(" \t\n\r\f\v")
    i, sign = 0, 1
    if i < len(s) and s[i] in "+-":
        sign = -1 if s[i] == "-" else 1
        i += 1
    base = 10
    if s[i : i + 2].lower() == "0x" and i + 2 < len(s) and s[i + 2] in "0123456789abcdefABCDEF":
        base, i = 16, i + 2
    elif s[i : i + 1] == "0":
        base = 8
    digits = "0123456789abcdef"[:base]
    j = i
    while j < len(s) and s[j].lower() in digits:
        j += 1
    if j == i:  # no conversion performed: value 0, whole string unparsed
        return 0, text
    return sign * int(s[i:j], base), s[j:]
