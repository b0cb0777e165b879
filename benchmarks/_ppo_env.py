"""Process and machine facts of the PPO throughput benchmarks: rank and world, device
synchronisation, max over ranks, versions, device name, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max of ``values`` over ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    t = torch.tensor(values, dtype=torch.float64, device=dev or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "deepspeed", "trl", "accelerate", "pydantic"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _device(world: int) -> str:
    if torch.cuda.is_available():
        return f"{world} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({world} process{'es' if world > 1 else ''})"


def _dirty() -> bool | None:
    """Whether the run is made from uncommitted changes (``verl_comm.bench.env.dirty``)."""
    from verl_comm.bench.env import dirty

    return dirty(REPO)


def _commit() -> str:
    if os.environ.get("VERL_COMMIT"):
        return os.environ["VERL_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"
