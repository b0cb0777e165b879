"""Versions, devices, topology and NCCL environment for the benchmark preamble and records."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping

import torch

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES", "GLOO_")


def versions() -> dict[str, str]:
    """torch, CUDA, NCCL, Python and verl_comm versions (``"n/a"`` when absent)."""
    from verl_comm import __version__

    out = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "verl_comm": __version__,
    }
    out["cuda"] = str(torch.version.cuda) if torch.version.cuda else "n/a"
    try:
        v = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v or "n/a")
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        out["nccl"] = "n/a"
    return out


def effective_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL/torch-NCCL/gloo variables set in ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)}


def commit() -> str:
    """Short git commit of the working tree, ``$VERL_COMMIT``, or ``"unknown"``."""
    if os.environ.get("VERL_COMMIT"):
        return os.environ["VERL_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


# Paths whose changes do not make a run "dirty": the records a benchmark itself appends.
_RECORD_PATHS = ("benchmarks/results/",)


def dirty(repo: str | os.PathLike | None = None) -> bool | None:
    """Whether the tree a run is made from differs from its commit (``git status
    --porcelain``: modified, staged or untracked files, ``benchmarks/results/`` aside).

    ``$VERL_DIRTY`` (``1``/``0``) wins: a copy of the tree without ``.git`` (a remote
    machine) is checked where the copy was made and the answer passed along. None when
    neither git nor the variable can tell.

    Args:
        repo: the working tree (default: the current directory).
    """
    if os.environ.get("VERL_DIRTY") in ("0", "1"):
        return os.environ["VERL_DIRTY"] == "1"
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    paths = [ln[3:] for ln in out.stdout.splitlines() if ln.strip()]
    return any(not p.startswith(_RECORD_PATHS) for p in paths)


def now_iso() -> str:
    """UTC time, ISO 8601, seconds."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def gpu_link(dev_a: int, dev_b: int) -> str:
    """Link between two GPUs from ``nvidia-smi topo -m`` (e.g. ``"NV18"``, ``"PIX"``, ``"SYS"``),
    with peer access as torch reports it; ``"unknown"`` when nvidia-smi is absent."""
    peer = "?"
    try:
        peer = "yes" if torch.cuda.can_device_access_peer(dev_a, dev_b) else "no"
    except Exception:  # noqa: BLE001
        pass
    link = "unknown"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10
            ).stdout
            rows = [re.split(r"\s+", ln.strip()) for ln in out.splitlines() if ln.startswith("GPU")]
            header = [ln for ln in out.splitlines() if "GPU0" in ln and not ln.startswith("GPU")]
            if rows and header:
                cols = re.split(r"\s+", header[0].strip())
                row = next(r for r in rows if r[0] == f"GPU{dev_a}")
                link = row[1 + cols.index(f"GPU{dev_b}")]
        except (OSError, subprocess.SubprocessError, StopIteration, ValueError, IndexError):
            pass
    return f"GPU{dev_a}<->GPU{dev_b}: {link} (peer access {peer})"


def auto_transport(
    backend: str, environ: Mapping[str, str], per_rank_env: Mapping[str, str], link: str
) -> str:
    """Transport label from the settings: ``gloo``, ``fake_multinode`` (per-rank
    ``NCCL_HOSTID``), ``socket`` (P2P and SHM disabled), ``nvlink`` or ``default``."""
    if backend == "gloo":
        return "gloo"
    if "NCCL_HOSTID" in per_rank_env:
        return "fake_multinode"
    if environ.get("NCCL_P2P_DISABLE") == "1" and environ.get("NCCL_SHM_DISABLE") == "1":
        return "socket"
    if ": NV" in link:
        return "nvlink"
    return "default"
