"""Process-group setup for one trainer rank (torchrun, our own launcher, or a lone process)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.distributed import DistContext, init_distributed
from verl_comm.distributed.launch import free_port
from verl_comm.nccl import apply_preset, lint
from verl_comm.nccl.topology import detect_host


def resolve_backend(name: str) -> str:
    """``auto`` -> ``nccl`` with CUDA, else ``gloo``; ``nccl`` without CUDA is an error."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("comm.backend=nccl needs CUDA GPUs; use comm.backend=gloo on CPU")
    return name


def ensure_process_group(cfg: Any) -> tuple[DistContext, bool]:
    """The job's :class:`~verl_comm.distributed.DistContext`, initialising the default process
    group if needed; returns ``(ctx, created)`` (``created``: this call made the group).

    Under torchrun or our launcher the rank comes from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
    and ``MASTER_ADDR``/``MASTER_PORT``; in a plain process a one-rank group on a free
    loopback port is created. ``comm.nccl_preset`` is applied first (NCCL reads its
    environment at init), and ``comm.timeout_s`` bounds the rendezvous and every
    collective (verl_comm.distributed turns a failure into a clear error naming the cause).
    A group initialised by the caller is adopted with ``comm.timeout_s`` as its deadline.
    """
    if dist.is_initialized():
        return DistContext.from_default_group(cfg.comm.timeout_s), False
    if cfg.comm.nccl_preset:
        apply_preset(cfg.comm.nccl_preset)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(cfg.comm.master_port or free_port()),
        )
    backend = resolve_backend(cfg.comm.backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return init_distributed(backend, cfg.comm.timeout_s, local_rank=local_rank), True


def environment_findings(env: dict[str, str] | None = None) -> list[str]:
    """Lines describing warnings/errors of verl_comm's NCCL/gloo environment linter and
    the NVLink topology check (empty when all is well). Printed once by rank 0."""
    lines = [
        f"{f.severity}: {f.variable}: {f.message} (fix: {f.fix})"
        for f in lint(dict(os.environ if env is None else env))
        if f.severity in ("warning", "error")
    ]
    if torch.cuda.is_available():
        lines += [f"topology: {p}" for p in detect_host(timeout_s=5.0).nvlink_problems]
    return lines
