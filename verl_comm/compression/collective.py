"""Collectives passed into the compression algorithms (the transport, kept apart).

The algorithms in :mod:`verl_comm.compression` never call ``torch.distributed``; they take a
:class:`Collective`. Every collective is started and waited on *in the caller's body*:
blocking calls, or (int8's host path, :func:`begin`) started there and waited on later in
the same body, never in a callback. On gloo, starting or waiting on collectives inside a
``Future.then`` callback deadlocks (torch's
``powerSGD_hook`` hung that way on gloo; see ``docs/ARCHITECTURE.md``, DDP comm hooks), so
the hooks run their collectives in the hook body. On NCCL a blocking call only makes the
current CUDA stream wait on NCCL's stream; the hooks run on a side stream so that backward
compute keeps overlapping (see :mod:`verl_comm.hooks`).

Each implementation counts the bytes it sends per rank (``bytes_sent``), with the ring
formulas of nccl-tests: all-reduce ``2 (W-1)/W S``, all-to-all ``(W-1)/W S`` and all-gather
``(W-1) s`` (``S`` = total bytes of the buffer, ``s`` = bytes of one rank's input).
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


def nbytes(t: torch.Tensor) -> int:
    """Bytes held by ``t`` (``numel * element_size``)."""
    return t.numel() * t.element_size()


@runtime_checkable
class Collective(Protocol):
    """Blocking collectives over ``world_size`` ranks (the transport of the algorithms).

    Attributes:
        world_size: number of ranks W.
        rank: this rank's index in ``[0, W)``.
        bytes_sent: running count of payload bytes this rank sent.
    """

    world_size: int
    rank: int
    bytes_sent: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks in place."""

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Chunk ``i`` of ``input`` (split in W equal chunks) goes to rank ``i``; chunk ``j``
        of ``output`` comes from rank ``j``."""

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (W * input.numel()) = inputs of ranks 0..W-1 concatenated. ``input``
        may be this rank's own chunk of ``output`` (in place, as NCCL allows)."""

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        """Element-wise max over ranks in place (used to agree on measurements)."""


class Work(Protocol):
    """A started collective (``torch.distributed``'s ``Work``): ``wait()`` blocks until it
    is done and raises what it raised."""

    def wait(self) -> object: ...


class _Done:
    """The :class:`Work` of a collective that already ran (blocking)."""

    def wait(self) -> bool:
        return True


def begin(coll: Collective, op: str, output: torch.Tensor, input: torch.Tensor,
          wait: bool = False) -> Work:  # fmt: skip
    """Start collective ``op`` (``"all_to_all_single"`` or ``"all_gather_into_tensor"``)
    of ``coll``: its ``start_<op>`` where it has one and ``wait`` is False (asynchronous;
    call ``wait()`` on the result before reading ``output`` or reusing ``input``), else the
    blocking call, then a :class:`Work` that is already done. Collectives must still be
    started in the same order on every rank."""
    start = None if wait else getattr(coll, f"start_{op}", None)
    if start is not None:
        return start(output, input)
    getattr(coll, op)(output, input)
    return _Done()


class ProcessGroupCollective:
    """:class:`Collective` over a ``torch.distributed`` process group (None = WORLD).

    Calls are issued with ``async_op=False``; the ``start_*`` variants with ``async_op=True``
    (see :func:`begin`). Raises whatever ``torch.distributed`` raises (e.g. a timeout set
    at ``init_process_group``).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.hierarchy = None
        """A :class:`~verl_comm.compression.hier_int8.Hierarchy` over the same ranks (hosts
        x local ranks), where the hooks made one (:mod:`verl_comm.hooks.hierarchy`)."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += 2 * (w - 1) * nbytes(tensor) // w
        dist.all_reduce(tensor, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += 2 * (w - 1) * nbytes(tensor) // w
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += (w - 1) * nbytes(input) // w
        dist.all_to_all_single(output, input, group=self.group)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.bytes_sent += (self.world_size - 1) * nbytes(input)
        dist.all_gather_into_tensor(output, input, group=self.group)

    def start_all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """:meth:`all_to_all_single` started (``async_op=True``); wait on the result."""
        w = self.world_size
        self.bytes_sent += (w - 1) * nbytes(input) // w
        return dist.all_to_all_single(output, input, group=self.group, async_op=True)

    def start_all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """:meth:`all_gather_into_tensor` started (``async_op=True``); wait on the result."""
        self.bytes_sent += (self.world_size - 1) * nbytes(input)
        return dist.all_gather_into_tensor(output, input, group=self.group, async_op=True)


class LocalCollective:
    """A single rank (W = 1): every collective is the identity; no bytes are sent."""

    world_size = 1
    rank = 0

    def __init__(self) -> None:
        self.bytes_sent = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        pass

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.data_ptr() != input.data_ptr():  # in place: the data is already there
            output.copy_(input)


class LoopbackCollective:
    """W simulated ranks that all hold this rank's data: shapes, compute and byte counts are
    those of a real W-rank run, but nothing leaves the process.

    Used by the adaptive policy to time a compressor's compute without the link, and by
    tests. ``all_reduce`` multiplies by W (every rank contributed the same tensor).
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.rank = 0
        self.bytes_sent = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += 2 * (w - 1) * nbytes(tensor) // w
        tensor.mul_(w)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        pass

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += (w - 1) * nbytes(input) // w
        # every rank sends us the same chunk as our own chunk `rank`
        chunk = input.view(w, -1)[self.rank]
        output.view(w, -1).copy_(chunk.expand(w, -1))

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += (w - 1) * nbytes(input)
        if _overlaps(output, input):  # in place: input is this rank's chunk of output
            input = input.clone()
        output.view(w, -1).copy_(input.reshape(1, -1).expand(w, -1))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of ``a`` and ``b`` (each contiguous) intersect."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + nbytes(b) and b0 < a0 + nbytes(a)


class ThreadGroup:
    """Shared rendezvous of W threads in one process; hands out :class:`ThreadCollective`.

    For one-process tests of multi-rank algorithms (each thread plays one rank). Every
    collective is two barrier phases: publish the input, then read all inputs.

    Args:
        world_size: number of threads W.
        timeout_s: seconds a thread waits at a barrier before ``threading.BrokenBarrierError``.
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[torch.Tensor | None] = [None] * world_size

    def collective(self, rank: int) -> ThreadCollective:
        """The :class:`Collective` of thread ``rank``."""
        return ThreadCollective(self, rank)

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = t.clone()
        self._barrier.wait()
        out = [s.clone() for s in self._slots]  # type: ignore[union-attr]
        self._barrier.wait()
        return out


class ThreadCollective:
    """One rank of a :class:`ThreadGroup` (see there)."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._g = group
        self.world_size = group.world_size
        self.rank = rank
        self.bytes_sent = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += 2 * (w - 1) * nbytes(tensor) // w
        parts = self._g._exchange(self.rank, tensor)
        acc = parts[0].clone()
        for p in parts[1:]:
            acc += p
        tensor.copy_(acc)

    def all_reduce_max(self, tensor: torch.Tensor) -> None:
        parts = self._g._exchange(self.rank, tensor)
        tensor.copy_(torch.stack(parts).amax(0))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        w = self.world_size
        self.bytes_sent += (w - 1) * nbytes(input) // w
        parts = self._g._exchange(self.rank, input)
        out = output.view(w, -1)
        for j in range(w):
            out[j].copy_(parts[j].view(w, -1)[self.rank])

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self.bytes_sent += (self.world_size - 1) * nbytes(input)
        parts = self._g._exchange(self.rank, input)
        output.view(self.world_size, -1).copy_(torch.stack([p.reshape(-1) for p in parts]))
