"""Host topology: the ``nvidia-smi topo -m`` matrix, NVLink counts, IB devices, interfaces.

Parsing is pure (:func:`parse_topo_matrix`, :func:`parse_ip_addr`) and tested on captured
outputs; :func:`detect_host` gathers the live facts with a deadline on every external call.

Link codes of ``nvidia-smi topo -m`` (its legend): ``X`` self, ``NV#`` a bonded set of #
NVLinks, ``PIX`` at most one PCIe bridge, ``PXB`` several PCIe bridges, ``PHB`` through a PCIe
host bridge, ``NODE`` across host bridges within a NUMA node, ``SYS`` across NUMA nodes.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
from dataclasses import asdict, dataclass, field

LINK_CODES = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\w+)$")
_NV = re.compile(r"^NV(\d+)$")

#: NVLinks per GPU pair when every link is up (through NVSwitch or a direct full mesh).
#: Keys are matched against the GPU name, most specific first; PCIe/NVL cards have none.
FULL_NVLINKS: tuple[tuple[str, int], ...] = (
    ("A100-SXM", 12),
    ("A800-SXM", 8),
    ("H800", 8),
    ("H100 80GB HBM3", 18),
    ("H100-SXM", 18),
    ("H200", 18),
    ("B200", 18),
)


@dataclass
class TopoMatrix:
    """Parsed ``nvidia-smi topo -m``.

    Attributes:
        devices: row/column labels in order, e.g. ``["GPU0", "GPU1", "NIC0"]``.
        links: ``links[a][b]`` is the code between devices a and b (``"X"`` on the diagonal).
        cpu_affinity, numa_affinity: per GPU, as printed (e.g. ``"0-47"``, ``"0"``).
        nic_names: ``NIC0 -> mlx5_0`` from the NIC legend.
    """

    devices: list[str]
    links: dict[str, dict[str, str]]
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> list[str]:
        """GPU labels, e.g. ``["GPU0", "GPU1"]``."""
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        """NIC labels, e.g. ``["NIC0"]``."""
        return [d for d in self.devices if not d.startswith("GPU")]

    def nvlinks(self, a: str, b: str) -> int:
        """Number of NVLinks between devices ``a`` and ``b`` (0 when the path is PCIe/SYS)."""
        m = _NV.match(self.links[a][b])
        return int(m.group(1)) if m else 0

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict."""
        return asdict(self)


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the output of ``nvidia-smi topo -m`` into a :class:`TopoMatrix`.

    Accepts tab- or space-separated columns and the ANSI underline nvidia-smi puts on the
    header. Raises:
        ValueError: no header with GPU columns, a row with a missing or unknown link code
            (the message names the row and the cell).
    """
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    header_idx = next((i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln)), None)
    if header_idx is None:
        raise ValueError("nvidia-smi topo -m output: no header line starting with 'GPU0'")
    header = re.split(r"\t+|\s{2,}|\s(?=GPU\d|NIC\d)", lines[header_idx].strip())
    devices = [h for h in header if _DEVICE.match(h)]
    extra_cols = [h for h in header if not _DEVICE.match(h)]
    links: dict[str, dict[str, str]] = {}
    topo = TopoMatrix(devices=devices, links=links)
    for ln in lines[header_idx + 1 :]:
        if not ln.strip():
            if links:
                break
            continue
        cells = ln.split()
        name = cells[0]
        if not _DEVICE.match(name):
            break
        codes = cells[1 : 1 + len(devices)]
        if len(codes) < len(devices):
            raise ValueError(f"topo row {name}: {len(codes)} link cells, {len(devices)} expected")
        for col, code in zip(devices, codes):
            if code not in LINK_CODES and not _NV.match(code):
                raise ValueError(f"topo row {name}, column {col}: unknown link code {code!r}")
        links[name] = dict(zip(devices, codes))
        rest = [c.strip() for c in re.split(r"\t+|\s{2,}", ln.strip())[1:] if c.strip()]
        rest = rest[len(devices) :]
        if name.startswith("GPU") and rest:
            topo.cpu_affinity[name] = rest[0]
            if len(rest) > 1 and "NUMA Affinity" in extra_cols:
                topo.numa_affinity[name] = rest[1]
    missing = [d for d in devices if d not in links]
    if missing:
        raise ValueError(f"topo matrix: no row for {', '.join(missing)}")
    for ln in lines:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", ln)
        if m:
            topo.nic_names[m.group(1)] = m.group(2)
    return topo


def expected_nvlinks(gpu_name: str) -> int | None:
    """Full NVLink count per GPU pair for a GPU name (``None``: no expectation, e.g. PCIe)."""
    if "PCIe" in gpu_name or gpu_name.endswith(" NVL"):
        return None
    for key, n in FULL_NVLINKS:
        if key in gpu_name:
            return n
    return None


def check_nvlinks(topo: TopoMatrix, gpu_name: str) -> list[str]:
    """Problems with the NVLink mesh: pairs below the platform's full count or without
    NVLink. Returns human-readable lines; empty when all pairs are complete or the platform
    has no expectation."""
    full = expected_nvlinks(gpu_name)
    if full is None:
        return []
    problems = []
    gpus = topo.gpus
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            n = topo.nvlinks(a, b)
            if n < full:
                problems.append(
                    f"{a}-{b}: {topo.links[a][b]} ({n} NVLinks), {full} expected on {gpu_name}: "
                    "a link is down or the fabric manager is not running (nvidia-smi nvlink -s)"
                )
    return problems


@dataclass
class Interface:
    """A network interface and its addresses (IPv4 and IPv6, without prefix length)."""

    name: str
    addresses: list[str] = field(default_factory=list)


def parse_ip_addr(text: str) -> list[Interface]:
    """Parse ``ip -o addr`` output (one address per line) into interfaces, in order."""
    out: dict[str, Interface] = {}
    for ln in text.splitlines():
        m = re.match(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet6?\s+([0-9a-fA-F.:]+)(?:/\d+)?", ln)
        if m:
            out.setdefault(m.group(1), Interface(m.group(1))).addresses.append(m.group(2))
    return list(out.values())


def _ipv4_address(name: str) -> str | None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = struct.pack("256s", name.encode()[:15])
            res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def list_interfaces() -> list[Interface]:
    """Interfaces of this host with their addresses (``socket.if_nameindex`` + ioctl +
    ``/proc/net/if_inet6``); no external command."""
    result = []
    v6: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for ln in f:
                parts = ln.split()
                if len(parts) >= 6:
                    addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
                    v6.setdefault(parts[5], []).append(str(addr))
    except OSError:
        pass
    for _, name in socket.if_nameindex():
        addrs = [a for a in [_ipv4_address(name)] if a] + v6.get(name, [])
        result.append(Interface(name, addrs))
    return result


def ib_devices(sys_root: str = "/sys/class/infiniband") -> list[str]:
    """InfiniBand/RoCE verbs devices (``mlx5_0``, ``efa_0`` ...) listed under ``sys_root``."""
    try:
        return sorted(os.listdir(sys_root))
    except OSError:
        return []


def _run(cmd: list[str], timeout_s: float) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


@dataclass
class HostInfo:
    """What the linter and the doctor need to know about this host.

    Attributes:
        interfaces: network interfaces with addresses.
        ib_devices: verbs devices (IB, RoCE, EFA).
        gpu_names: ``nvidia-smi --query-gpu=name`` per GPU (empty without NVIDIA GPUs).
        topo: parsed ``nvidia-smi topo -m`` or ``None``.
        nvlink_problems: output of :func:`check_nvlinks`.
        topo_error: why ``nvidia-smi topo -m`` could not be parsed (``None``: parsed or absent).
    """

    interfaces: list[Interface] = field(default_factory=list)
    ib_devices: list[str] = field(default_factory=list)
    gpu_names: list[str] = field(default_factory=list)
    topo: TopoMatrix | None = None
    nvlink_problems: list[str] = field(default_factory=list)
    topo_error: str | None = None

    @property
    def interface_names(self) -> list[str]:
        """Names of the interfaces, e.g. ``["lo", "eth0"]``."""
        return [i.name for i in self.interfaces]

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dict."""
        return asdict(self)


def detect_host(timeout_s: float = 10.0) -> HostInfo:
    """Gather :class:`HostInfo` for this machine; ``nvidia-smi`` calls are bounded by
    ``timeout_s`` seconds each and simply skipped when absent or failing."""
    info = HostInfo(interfaces=list_interfaces(), ib_devices=ib_devices())
    names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], timeout_s)
    if names:
        info.gpu_names = [n.strip() for n in names.splitlines() if n.strip()]
    text = _run(["nvidia-smi", "topo", "-m"], timeout_s) if info.gpu_names else None
    if text:
        try:
            info.topo = parse_topo_matrix(text)
        except ValueError as e:  # our parser's limit, not the machine's fault
            info.topo_error = f"could not parse nvidia-smi topo -m: {e}"
        if info.topo is not None and info.gpu_names:
            info.nvlink_problems += check_nvlinks(info.topo, info.gpu_names[0])
    return info
