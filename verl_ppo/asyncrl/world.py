"""The world split of the asynchronous mode: two process-group worlds and a bridge.

``comm.nproc`` training ranks and ``rollout.n_ranks`` rollout ranks are started together
(launcher or torchrun ranks ``0 .. T + R - 1``; training ranks first). Each role gets its
own default process group (training ranks ``0 .. T - 1``, rollout ranks ``0 .. R - 1``), so
everything the colocated trainer runs on the world -- DeepSpeed's data-parallel
reduction, metric reductions, checkpoint barriers -- runs unchanged on the training ranks.
The two roles meet on two standalone process groups over all ``T + R`` processes (bridge
rank = launcher rank), made from the same rendezvous store with their own prefixes:
``weights`` (used only by :class:`~verl_ppo.reshard.group_sync.SyncSender` /
``SyncReceiver``, whose receiver thread must own its group) and ``experience``
(:mod:`verl_ppo.asyncrl.channel`). The transport is the backend's (gloo on the CPU, NCCL on
GPUs), except when there are fewer GPUs than ``T + R`` processes: then training rank ``i``
and rollout rank ``i`` share ``cuda:i`` (e.g. both on one GPU) and the bridge groups are
gloo (NCCL refuses two ranks of one communicator on one GPU), their CUDA tensors staged
through host memory (:func:`placement`); each role world keeps NCCL. Rollout rank ``i``
makes the batches of training ranks ``i, i + R, i + 2R, ...``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_ppo.errors import ConfigError

START_KEY = "verl_ppo/async/start_step"  # the first step of this run, set by training rank 0


@dataclass
class AsyncWorld:
    """This process's place in the async job.

    Attributes:
        rank: bridge rank (= launcher rank; training ranks first).
        n_train, n_rollout: ``comm.nproc`` and ``rollout.n_ranks``.
        store: the rendezvous store shared by both worlds.
        weights, experience: the standalone bridge groups (``T + R`` ranks each).
        cuda: the ranks compute on GPUs (NCCL role worlds).
        timeout_s: ``comm.timeout_s``, the deadline of every wait.
        bridge: the bridge groups' backend (``nccl``, or ``gloo``: on the CPU, or GPUs
            shared by a training and a rollout rank, see :func:`placement`).
    """

    rank: int
    n_train: int
    n_rollout: int
    store: dist.Store
    weights: Any
    experience: Any
    cuda: bool
    timeout_s: float
    bridge: str = "gloo"

    @property
    def wire_device(self) -> torch.device:
        """Where tensors crossing the bridge live: this rank's GPU with an NCCL bridge, else
        host memory (gloo)."""
        if self.bridge == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def is_rollout(self) -> bool:
        """This process is a rollout rank."""
        return self.rank >= self.n_train

    @property
    def train_ranks(self) -> tuple[int, ...]:
        """Bridge ranks of the training ranks."""
        return tuple(range(self.n_train))

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        """Bridge ranks of the rollout ranks."""
        return tuple(range(self.n_train, self.n_train + self.n_rollout))

    def server_of(self, train_rank: int) -> int:
        """Bridge rank of the rollout rank that makes ``train_rank``'s batches."""
        return self.n_train + train_rank % self.n_rollout

    def served_by(self, rollout_rank: int) -> list[int]:
        """Training ranks whose batches bridge rank ``rollout_rank`` makes, ascending."""
        return list(range(rollout_rank - self.n_train, self.n_train, self.n_rollout))

    def start_step(self) -> int:
        """The run's first step (0, or the resumed checkpoint's), as training rank 0 said.

        Raises:
            RuntimeError: not said within ``timeout_s``.
        """
        try:
            self.store.wait([START_KEY], timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - torch raises several kinds here
            raise RuntimeError(
                f"rank {self.rank}: training rank 0 did not announce the start step within "
                f"comm.timeout_s={self.timeout_s:g} s ({e})"
            ) from e
        return int(self.store.get(START_KEY))


def _standalone_group(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float):
    """A process group over ``size`` processes that is not part of the default world."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def placement(
    backend: str, rank: int, local_rank: int, n_train: int, n_rollout: int, n_gpus: int
) -> tuple[int | None, str]:
    """This rank's GPU and the bridge groups' backend (pure; one node).

    Args:
        backend: the resolved ``comm.backend`` (``nccl`` or ``gloo``).
        rank, local_rank: bridge rank and ``LOCAL_RANK``.
        n_train, n_rollout: ``comm.nproc``, ``rollout.n_ranks``.
        n_gpus: GPUs visible to this process.

    Returns:
        ``(gpu index or None on gloo, bridge backend)``: with ``n_gpus >= T + R`` every rank
        has its own GPU (``LOCAL_RANK``) and the bridge is NCCL; with fewer, training rank
        ``i`` and rollout rank ``i`` share GPU ``i`` and the bridge is gloo (staged through
        host memory; NCCL refuses two ranks of one communicator on one GPU).

    Raises:
        ConfigError: a role has more ranks than there are GPUs (its own NCCL world would
            put two ranks on one GPU).
    """
    if backend != "nccl":
        return None, "gloo"
    if n_gpus >= n_train + n_rollout:
        return local_rank, "nccl"
    if max(n_train, n_rollout) > n_gpus:
        raise ConfigError(
            f"rollout.mode=async on {n_gpus} GPU(s): comm.nproc={n_train} training and "
            f"rollout.n_ranks={n_rollout} rollout ranks need one GPU per rank of each role "
            f"(a training and a rollout rank may share one): lower comm.nproc / "
            f"rollout.n_ranks to <= {n_gpus}, or use comm.backend=gloo"
        )
    return (rank if rank < n_train else rank - n_train), "gloo"


def join_world(cfg: Any, env: dict[str, str] | None = None) -> AsyncWorld:
    """Initialise this process's role world (its default group) and the two bridge groups.

    Collective over all ``comm.nproc + rollout.n_ranks`` processes. Reads ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by our
    launcher and by torchrun).

    Raises:
        ConfigError: ``WORLD_SIZE`` is not ``comm.nproc + rollout.n_ranks``, or too few
            GPUs (:func:`placement`).
    """
    from verl_ppo.workers.distributed import resolve_backend

    if dist.is_initialized():
        raise RuntimeError(
            "rollout.mode=async starts its own process groups (a training and a rollout world "
            "joined by a bridge): launch it with verl-ppo train or torchrun, not inside an "
            "existing process group"
        )
    env = dict(os.environ if env is None else env)
    t, r = cfg.comm.nproc, cfg.rollout.n_ranks
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world != t + r:
        raise ConfigError(
            f"rollout.mode=async runs comm.nproc={t} training + rollout.n_ranks={r} rollout "
            f"ranks = {t + r} processes, got WORLD_SIZE={world}: start {t + r} ranks "
            "(torchrun --nproc_per_node), or change comm.nproc / rollout.n_ranks"
        )
    backend, timeout = resolve_backend(cfg.comm.backend), cfg.comm.timeout_s
    n_gpus = torch.cuda.device_count() if backend == "nccl" else 0
    gpu, bridge = placement(backend, rank, int(env.get("LOCAL_RANK", rank)), t, r, n_gpus)
    if gpu is not None:
        torch.cuda.set_device(gpu)
    store = dist.TCPStore(
        env.get("MASTER_ADDR", "127.0.0.1"),
        int(env["MASTER_PORT"]),
        world,
        rank == 0,
        timedelta(seconds=timeout),
    )
    role, local, size = ("train", rank, t) if rank < t else ("rollout", rank - t, r)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"verl_ppo/async/{role}/", store),
        rank=local,
        world_size=size,
        timeout=timedelta(seconds=timeout),
    )
    groups = [
        _standalone_group(
            bridge, dist.PrefixStore(f"verl_ppo/async/{n}/", store), rank, world, timeout
        )
        for n in ("weights", "experience")
    ]
    cuda = backend == "nccl"
    return AsyncWorld(rank, t, r, store, *groups, cuda=cuda, timeout_s=timeout, bridge=bridge)
