"""Registry of the environment variables that NCCL, torch's ProcessGroupNCCL, gloo and the
launcher read.

Sources: the list of names NCCL 2.30 reads (``data/nccl_2.30_env_names.txt``, extracted from
the ``NCCL_PARAM``/``ncclGetEnv`` calls of the NCCL 2.30 sources), defaults from those sources
(``src/misc/param.cc``, ``src/transport/net_socket.cc``, ``src/graph/connect.cc``), the NCCL
user guide's environment-variable page (sections "production" vs "debugging"), and torch's
``ProcessGroupNCCL.hpp`` (``TORCH_NCCL_*`` names and their deprecated ``NCCL_*`` aliases).

Every name NCCL 2.30 reads is known (:func:`nccl_names`); the variables that matter for
tuning or that circulate in advice carry a detailed :class:`EnvVar` in :data:`REGISTRY`.
"""

from __future__ import annotations

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
        removed: release that removed it; NCCL no longer reads a removed name.
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
    removed: str | None = None
    choices: tuple[str, ...] = ()


def _v(name: str, kind: str, default: str | None, doc: str, **kw) -> EnvVar:
    owner = kw.pop("owner", "nccl")
    return EnvVar(name=name, owner=owner, kind=kind, default=default, doc=doc, **kw)


_LEVEL_DOC = "LOC, NVL, PIX, PXB, PHB, SYS or an integer level"

_VARS: tuple[EnvVar, ...] = (
    # --- NCCL: network and sockets -------------------------------------------------------
    _v(
        "NCCL_SOCKET_IFNAME",
        "ifname",
        None,
        "interfaces for bootstrap and the socket "
        "transport: prefixes, '^' excludes, '=' exact names (default: ib*, then any but "
        "docker*/lo, then docker*, then lo)",
    ),
    _v(
        "NCCL_SOCKET_FAMILY",
        "enum",
        None,
        "force IPv4 or IPv6 for sockets",
        choices=("AF_INET", "AF_INET6"),
    ),
    _v(
        "NCCL_SOCKET_NTHREADS",
        "int",
        "-2 (auto: 0, AWS 2, GCP 4)",
        "helper threads per socket connection; threads x NCCL_NSOCKS_PERTHREAD <= 64",
        min_value=1,
        max_value=16,
    ),
    _v(
        "NCCL_NSOCKS_PERTHREAD",
        "int",
        "-2 (auto: 1, AWS 8)",
        "sockets per helper thread; no effect while NCCL_SOCKET_NTHREADS stays 0 (generic NICs)",
        min_value=1,
        max_value=64,
    ),
    _v(
        "NCCL_SOCKET_RETRY_CNT",
        "int",
        "34",
        "connection retries on ECONNREFUSED/ETIMEDOUT "
        "(the real 'socket timeout' knob, with NCCL_SOCKET_RETRY_SLEEP_MSEC)",
        min_value=0,
    ),
    _v(
        "NCCL_SOCKET_RETRY_SLEEP_MSEC",
        "int",
        "100",
        "sleep between socket retries (ms), growing linearly per retry",
        min_value=0,
    ),
    _v("NCCL_NET", "str", None, "force a network: 'IB', 'Socket' or a plugin's name"),
    _v("NCCL_NET_PLUGIN", "str", None, "network plugin library name or path"),
    _v(
        "NCCL_IB_DISABLE",
        "bool",
        "0",
        "1 disables the IB/RoCE verbs transport: NCCL falls back to TCP sockets",
        min_value=0,
        max_value=1,
    ),
    _v("NCCL_IB_HCA", "str", None, "IB HCAs to use: prefixes, '^' excludes, '=' exact, ':port'"),
    _v(
        "NCCL_IB_TIMEOUT",
        "int",
        "20",
        "IB verbs timeout exponent: 4.096 us x 2^value (20 = 4.3 s)",
        min_value=1,
        max_value=31,
    ),
    _v("NCCL_IB_RETRY_CNT", "int", "7", "IB verbs retry count", min_value=0, max_value=7),
    _v("NCCL_IB_GID_INDEX", "int", "-1 (auto)", "RoCE GID index", min_value=-1, max_value=255),
    _v("NCCL_IB_SL", "int", "-1 (0)", "IB service level", min_value=-1, max_value=15),
    _v("NCCL_IB_TC", "int", "-1 (0)", "IB traffic class", min_value=-1, max_value=255),
    _v(
        "NCCL_IB_QPS_PER_CONNECTION",
        "int",
        "1",
        "queue pairs per IB connection",
        min_value=1,
        max_value=128,
    ),
    _v(
        "NCCL_IB_ADAPTIVE_ROUTING",
        "bool",
        "-2 (auto: on for IB, off for RoCE)",
        "IB adaptive routing",
        min_value=-2,
        max_value=1,
    ),
    _v("NCCL_NET_GDR_LEVEL", "level", None, "max distance for GPUDirect RDMA: " + _LEVEL_DOC),
    _v("NCCL_NET_GDR_READ", "bool", None, "GPUDirect RDMA for sends", min_value=0, max_value=1),
    _v(
        "NCCL_CROSS_NIC",
        "int",
        "2",
        "0: same NIC per ring/tree rank, 1: allow cross-NIC, 2: auto",
        min_value=0,
        max_value=2,
    ),
    _v(
        "NCCL_COLLNET_ENABLE",
        "bool",
        None,
        "enable CollNet (SHARP) collectives",
        min_value=0,
        max_value=1,
    ),
    _v(
        "NCCL_NCHANNELS_PER_NET_PEER",
        "int",
        None,
        "channels per remote peer for P2P",
        min_value=1,
        max_value=64,
    ),
    # --- NCCL: intra-node transports -----------------------------------------------------
    _v(
        "NCCL_P2P_DISABLE",
        "bool",
        "0",
        "1 disables P2P (NVLink/PCIe) between GPUs",
        min_value=0,
        max_value=1,
    ),
    _v("NCCL_P2P_LEVEL", "level", None, "max distance for P2P: " + _LEVEL_DOC),
    _v(
        "NCCL_SHM_DISABLE",
        "bool",
        "0",
        "1 disables the shared-memory transport",
        min_value=0,
        max_value=1,
    ),
    _v(
        "NCCL_NVLS_ENABLE",
        "int",
        "2 (auto)",
        "NVLink SHARP (NVSwitch multicast); 0 off",
        min_value=0,
        max_value=2,
    ),
    _v(
        "NCCL_CUMEM_ENABLE",
        "bool",
        "-2 (auto: 1)",
        "cuMem* allocations for buffers",
        min_value=-2,
        max_value=1,
    ),
    _v(
        "NCCL_PXN_DISABLE",
        "bool",
        "0",
        "1 disables PXN (NVLink then the peer GPU's NIC)",
        min_value=0,
        max_value=1,
    ),
    _v(
        "NCCL_NVB_DISABLE",
        "bool",
        "0",
        "1 disables NVLink-to-NVLink forwarding via a GPU",
        min_value=0,
        max_value=1,
    ),
    _v(
        "NCCL_RUNTIME_CONNECT",
        "bool",
        "1",
        "connect lazily at the first collective",
        min_value=0,
        max_value=1,
    ),
    # --- NCCL: buffers, channels, algorithms ---------------------------------------------
    _v(
        "NCCL_BUFFSIZE",
        "int",
        "4194304 (4 MiB)",
        "SIMPLE-protocol buffer per channel and peer, bytes",
        min_value=65536,
    ),
    _v(
        "NCCL_LL_BUFFSIZE",
        "int",
        "-2 (auto)",
        "LL buffer size, bytes",
        min_value=1,
        section="debug",
    ),
    _v(
        "NCCL_LL128_BUFFSIZE",
        "int",
        "-2 (auto)",
        "LL128 buffer size, bytes",
        min_value=1,
        section="debug",
    ),
    _v(
        "NCCL_NTHREADS",
        "int",
        "-2 (auto: 512 on recent GPUs)",
        "CUDA threads per channel block: 64, 128, 256 or 512",
        min_value=64,
        max_value=512,
        section="debug",
    ),
    _v(
        "NCCL_MIN_CTAS",
        "int",
        "1",
        "minimum CTAs (channels); debugging only",
        min_value=1,
        max_value=64,
        section="debug",
    ),
    _v(
        "NCCL_MAX_CTAS",
        "int",
        "auto (up to 64)",
        "maximum CTAs (channels); debugging only",
        min_value=1,
        max_value=64,
        section="debug",
    ),
    _v(
        "NCCL_MIN_NCHANNELS",
        "int",
        "-2",
        "minimum channels; deprecated since 2.17",
        min_value=1,
        max_value=64,
        section="debug",
        successor="NCCL_MIN_CTAS",
    ),
    _v(
        "NCCL_MAX_NCHANNELS",
        "int",
        "-2",
        "maximum channels; deprecated since 2.17",
        min_value=1,
        max_value=64,
        section="debug",
        successor="NCCL_MAX_CTAS",
    ),
    _v(
        "NCCL_MIN_NRINGS",
        "int",
        "-2",
        "legacy alias of NCCL_MIN_NCHANNELS (itself deprecated since 2.17)",
        min_value=1,
        max_value=64,
        section="debug",
        successor="NCCL_MIN_CTAS",
    ),
    _v(
        "NCCL_MAX_NRINGS",
        "int",
        "-2",
        "legacy alias of NCCL_MAX_NCHANNELS (itself deprecated since 2.17)",
        min_value=1,
        max_value=64,
        section="debug",
        successor="NCCL_MAX_CTAS",
    ),
    _v(
        "NCCL_ALGO",
        "str",
        None,
        "restrict algorithms (Ring, Tree, CollnetDirect, "
        "CollnetChain, NVLS, NVLSTree, PAT); debugging only",
        section="debug",
    ),
    _v(
        "NCCL_PROTO",
        "str",
        None,
        "restrict protocols (LL, LL128, Simple); debugging only",
        section="debug",
    ),
    _v(
        "NCCL_CHECK_POINTERS",
        "bool",
        "0",
        "check pointers per call; deprecated",
        min_value=0,
        max_value=1,
        section="debug",
        successor="NCCL_CHECK_MODE",
    ),
    _v(
        "NCCL_LAUNCH_MODE",
        "enum",
        "GROUP",
        "PARALLEL or GROUP kernel launch",
        section="debug",
        choices=("PARALLEL", "GROUP"),
    ),
    # --- NCCL: debugging -----------------------------------------------------------------
    _v(
        "NCCL_DEBUG",
        "enum",
        None,
        "log level: VERSION, WARN (production), INFO or TRACE (debugging)",
        choices=("VERSION", "WARN", "INFO", "ABORT", "TRACE"),
    ),
    _v(
        "NCCL_DEBUG_SUBSYS",
        "str",
        "INIT,BOOTSTRAP,ENV",
        "subsystems logged at INFO",
        section="debug",
    ),
    _v("NCCL_DEBUG_FILE", "str", None, "log to this file (%h host, %p pid)", section="debug"),
    _v("NCCL_TOPO_DUMP_FILE", "str", None, "dump the detected topology (XML)", section="debug"),
    _v("NCCL_GRAPH_DUMP_FILE", "str", None, "dump the search graphs (XML)", section="debug"),
    _v(
        "NCCL_HOSTID",
        "str",
        None,
        "override the host identity (tests pretend multi-node)",
        section="debug",
    ),
    # --- torch ProcessGroupNCCL ----------------------------------------------------------
    _v(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "int",
        "3",
        "watchdog action on a timed-out or "
        "failed collective: 0 none (a dead peer hangs the job), 1 tear down (abort and "
        "kill), 2 clean up only, 3 skip clean-up (abort and raise)",
        owner="torch",
        min_value=0,
        max_value=3,
    ),
    _v(
        "NCCL_ASYNC_ERROR_HANDLING",
        "int",
        "3",
        "deprecated torch alias of TORCH_NCCL_ASYNC_ERROR_HANDLING",
        owner="torch",
        min_value=0,
        max_value=3,
        successor="TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ),
    _v(
        "TORCH_NCCL_BLOCKING_WAIT",
        "bool",
        "0",
        "wait() blocks and raises on timeout",
        owner="torch",
        min_value=0,
        max_value=1,
    ),
    _v(
        "NCCL_BLOCKING_WAIT",
        "bool",
        "0",
        "deprecated torch alias",
        owner="torch",
        min_value=0,
        max_value=1,
        successor="TORCH_NCCL_BLOCKING_WAIT",
    ),
    _v(
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "bool",
        None,
        "dump the flight recorder on timeout",
        owner="torch",
        min_value=0,
        max_value=1,
    ),
    _v(
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "int",
        "2000",
        "flight recorder ring buffer entries (0 = off); TORCH_FR_BUFFER_SIZE in newer torch",
        owner="torch",
        min_value=0,
    ),
    _v(
        "TORCH_FR_BUFFER_SIZE",
        "int",
        "2000",
        "flight recorder ring buffer entries",
        owner="torch",
        min_value=0,
    ),
    _v(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "str",
        "/tmp/nccl_trace_rank_",
        "flight recorder dump path prefix",
        owner="torch",
    ),
    _v(
        "TORCH_NCCL_ENABLE_MONITORING",
        "bool",
        "1",
        "heartbeat monitor that kills a stuck watchdog",
        owner="torch",
        min_value=0,
        max_value=1,
    ),
    _v(
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        "int",
        "480",
        "heartbeat monitor timeout (s)",
        owner="torch",
        min_value=1,
    ),
    _v(
        "TORCH_NCCL_DESYNC_DEBUG",
        "bool",
        "0",
        "report which rank desynchronised",
        owner="torch",
        min_value=0,
        max_value=1,
        section="debug",
    ),
    _v(
        "NCCL_DESYNC_DEBUG",
        "bool",
        "0",
        "deprecated torch alias",
        owner="torch",
        min_value=0,
        max_value=1,
        section="debug",
        successor="TORCH_NCCL_DESYNC_DEBUG",
    ),
    _v(
        "TORCH_NCCL_ENABLE_TIMING",
        "bool",
        "0",
        "record start events (duration metrics)",
        owner="torch",
        min_value=0,
        max_value=1,
        section="debug",
    ),
    _v(
        "NCCL_ENABLE_TIMING",
        "bool",
        "0",
        "deprecated torch alias",
        owner="torch",
        min_value=0,
        max_value=1,
        section="debug",
        successor="TORCH_NCCL_ENABLE_TIMING",
    ),
    _v(
        "TORCH_NCCL_NAN_CHECK",
        "bool",
        "0",
        "check collective inputs for NaN",
        owner="torch",
        min_value=0,
        max_value=1,
        section="debug",
    ),
    _v(
        "TORCH_NCCL_AVOID_RECORD_STREAMS",
        "bool",
        "1",
        "stash tensors instead of recordStream",
        owner="torch",
        min_value=0,
        max_value=1,
    ),
    _v(
        "TORCH_NCCL_PROPAGATE_ERROR",
        "bool",
        "0",
        "propagate errors to all ranks through the store",
        owner="torch",
        min_value=0,
        max_value=1,
    ),
    _v(
        "TORCH_DISTRIBUTED_DEBUG",
        "enum",
        "OFF",
        "c10d checks: OFF, INFO, DETAIL (DETAIL wraps every collective in a consistency check)",
        owner="torch",
        section="debug",
        choices=("OFF", "INFO", "DETAIL"),
    ),
    # --- gloo and launcher ---------------------------------------------------------------
    _v(
        "GLOO_SOCKET_IFNAME",
        "str",
        None,
        "gloo interfaces: exact names, comma-separated (no NCCL-style '^' or '=' prefixes)",
        owner="gloo",
    ),
    _v("MASTER_ADDR", "str", None, "rendezvous (TCPStore) host of rank 0", owner="launcher"),
    _v(
        "MASTER_PORT",
        "int",
        None,
        "rendezvous (TCPStore) port",
        owner="launcher",
        min_value=1,
        max_value=65535,
    ),
    # --- libfabric (AWS EFA) -------------------------------------------------------------
    _v("FI_PROVIDER", "str", None, "libfabric provider, 'efa' on AWS", owner="libfabric"),
    _v(
        "FI_EFA_USE_DEVICE_RDMA",
        "bool",
        None,
        "GPUDirect RDMA on EFA (p4d/p5)",
        owner="libfabric",
        min_value=0,
        max_value=1,
    ),
    _v(
        "FI_EFA_FORK_SAFE",
        "bool",
        None,
        "fork safety for EFA (dataloader workers)",
        owner="libfabric",
        min_value=0,
        max_value=1,
    ),
)

#: detailed entries by name.
REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}

#: names that advice circulates but nothing reads, with what to use instead.
NEVER_READ: dict[str, str] = {
    "NCCL_SOCKET_TIMEOUT": "NCCL has no socket timeout: use NCCL_SOCKET_RETRY_CNT / "
    "NCCL_SOCKET_RETRY_SLEEP_MSEC for connection retries, NCCL_IB_TIMEOUT on IB, and "
    "init_process_group(timeout=...) for collectives",
    "NCCL_TIMEOUT": "NCCL has no such timeout: pass init_process_group(timeout=...) "
    "(verl_comm.dist.init_distributed(timeout_s=...))",
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
