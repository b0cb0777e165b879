"""Process-group initialisation with explicit deadlines, and guarded collectives.

:func:`init_distributed` replaces a bare ``init_process_group``:

1. checks ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` against this host's interfaces
   (an error naming the variable and the interfaces that exist, instantly);
2. creates the rendezvous ``TCPStore`` itself with the timeout, so "rank 0 never started"
   fails after ``timeout_s`` naming ``MASTER_ADDR:MASTER_PORT``;
3. runs a join barrier on the store, so "world size 3 with 2 processes" fails after
   ``timeout_s`` saying "2/3 ranks joined" and which ranks are missing;
4. calls ``init_process_group(timeout=...)`` (and ``device_id=`` for NCCL: eager init).

The returned :class:`DistContext` is passed explicitly to whatever needs it (no globals):
``ctx.new_group`` gives sub-groups the same timeout (torch's ``new_group`` defaults to 30 min
for gloo / 10 min for NCCL whatever the default group got), and its collectives translate
backend failures into :mod:`verl_comm.distributed.errors`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_comm.distributed.checks import FingerprintChecker, check_finite
from verl_comm.distributed.checks import fingerprint as _fp
from verl_comm.distributed.errors import (
    CollectiveTimeoutError,
    DistributedError,
    InterfaceError,
    Rank0SectionError,
    RendezvousError,
    describe_group,
    translate,
)

_JOIN = "verl_comm/joined"


def check_socket_interfaces(backend: str, env: dict[str, str] | None = None) -> None:
    """Validate the socket-interface variables the backend will read.

    ``GLOO_SOCKET_IFNAME`` (gloo, and the CPU side of any job) must name existing interfaces
    exactly; ``NCCL_SOCKET_IFNAME`` (NCCL) must match at least one with NCCL's prefix / ``^`` /
    ``=`` syntax.

    Raises:
        InterfaceError: naming the variable, what is wrong and the interfaces of this host.
    """
    from verl_comm.nccl.lint import lint
    from verl_comm.nccl.topology import HostInfo, list_interfaces

    env = dict(os.environ if env is None else env)
    names = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if backend == "nccl" else [])
    subset = {n: env[n] for n in names if n in env}
    if not subset:
        return
    host = HostInfo(interfaces=list_interfaces())
    errors = [f for f in lint(subset, host=host) if f.severity == "error"]
    if errors:
        raise InterfaceError("; ".join(f"{f.message} (fix: {f.fix})" for f in errors))


def _wait_for_listener(addr: str, port: int, timeout_s: float, rank: int, where: str) -> None:
    """Poll until rank 0's store accepts a TCP connection (TCPStore's own connect back-off
    overshoots its timeout by seconds); raise :class:`RendezvousError` at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(
                f"rank {rank} could not reach the rendezvous store at {where} within "
                f"{timeout_s:g} s: rank 0 is not running, or MASTER_ADDR/MASTER_PORT are wrong "
                f"or blocked (last error: {last})"
            )
        try:
            with socket.create_connection((addr, port), timeout=min(1.0, left)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(left, 0.0)))


def _int_env(name: str, value: int | None) -> int:
    if value is not None:
        return int(value)
    if name not in os.environ:
        raise ValueError(f"{name} is not set: pass {name.lower()}= or export {name}")
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not an integer") from None


@dataclass
class DistContext:
    """An initialised job: rank, world size, timeout and the rendezvous store.

    Attributes:
        rank, world_size: global rank and number of processes.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: deadline of every collective, sub-groups included (seconds).
        store: the rendezvous store (used by the debug fingerprints and rank-0 sections).
        device: the device collectives run on (``cuda:<local_rank>`` for NCCL, CPU for gloo).
        checker: the fingerprint checker when the debug mode is on, else ``None``.
    """

    rank: int
    world_size: int
    backend: str
    timeout_s: float
    store: dist.Store
    device: torch.device
    checker: FingerprintChecker | None = None
    report_grace_s: float = 1.0
    _sections: dict[str, int] = field(default_factory=dict)
    _timeouts: dict[int, tuple[dist.ProcessGroup, float]] = field(default_factory=dict)
    _seq: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_default_group(cls, timeout_s: float, fingerprint: bool = False) -> DistContext:
        """The context of a default process group that someone else initialised (user code
        under torchrun, a test harness): rank, size, backend and store are read from it.

        Args:
            timeout_s: the deadline of this job's collectives; torch has no public getter for
                the default group's own timeout, so pass the one it was created with.
            fingerprint: as in :func:`init_distributed`.

        Raises:
            DistributedError: no default process group is initialised.
        """
        if not dist.is_initialized():
            raise DistributedError("no default process group: call init_distributed first")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds, got {timeout_s}")
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # the store the group rendezvoused on (torch 2.x keeps it with the default group)
        store = dist.distributed_c10d._get_default_store()
        checker = FingerprintChecker(store, rank, timeout_s) if fingerprint else None
        return cls(rank, world, backend, timeout_s, store, device, checker)

    # --- groups -------------------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        """The group of every rank of the job (``torch.distributed.group.WORLD``): the group
        a caller passes on when it has no sub-group of its own."""
        return dist.group.WORLD

    def new_group(self, ranks: list[int], timeout_s: float | None = None) -> dist.ProcessGroup:
        """``torch.distributed.new_group`` with this context's timeout (or ``timeout_s``).

        Must be called by every rank (torch's rule), members or not. The group's own
        timeout is remembered, so a timeout error on it names that deadline.
        """
        t = self.timeout_s if timeout_s is None else timeout_s
        group = new_group(ranks, t)
        self._timeouts[id(group)] = (group, t)  # the group is kept alive with its id
        return group

    def group_timeout_s(self, group: dist.ProcessGroup | None) -> float:
        """The deadline of collectives on ``group`` (seconds): its own for groups made by
        :meth:`new_group`, else this context's ``timeout_s``."""
        entry = self._timeouts.get(id(group)) if group is not None else None
        return entry[1] if entry is not None and entry[0] is group else self.timeout_s

    def _ranks(self, group: dist.ProcessGroup | None) -> list[int]:
        if group is None or group is dist.group.WORLD:
            return list(range(self.world_size))
        return dist.get_process_group_ranks(group)

    def _positions(self, ranks: list[int], key: str, seq: int, op: str) -> str:
        """After a timeout: post this rank's position on the store and collect the other
        ranks' for ``report_grace_s`` (only on the error path; healthy collectives pay
        nothing but a counter). Returns a sentence naming the ranks that never reported."""
        base = f"verl_comm/timeout/{key}/{seq}"
        try:
            self.store.set(f"{base}/{self.rank}", op)
            others = [r for r in ranks if r != self.rank]
            deadline = time.monotonic() + self.report_grace_s
            missing = others
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not self.store.check([f"{base}/{r}"])]
                if missing:
                    time.sleep(0.05)
        except Exception:  # the store is gone (rank 0 exited): nothing more to learn
            return ""
        if not missing:
            return (
                f" Every rank of the group reached collective #{seq} and timed out too: the "
                "collective itself stalled (network or backend)."
            )
        reached = sorted(set(ranks) - set(missing))
        return (
            f" Ranks {reached} reached collective #{seq}; rank(s) {missing} did not report "
            f"reaching it within {self.report_grace_s:g} s of this rank's deadline (stuck "
            "elsewhere, skipped it, or dead)."
        )

    @contextmanager
    def _guard(self, op: str, group: dist.ProcessGroup | None, fp: str | None) -> Iterator[None]:
        ranks = self._ranks(group)
        whole = group is None or group is dist.group.WORLD
        key = 0 if whole else id(group)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        if self.checker is not None and fp is not None:
            self.checker.check(ranks, fp)
        try:
            yield
        except DistributedError:
            raise
        except RuntimeError as e:
            desc = describe_group(None if whole else ranks, self.world_size)
            limit = self.timeout_s if whole else self.group_timeout_s(group)
            own = limit != self.timeout_s
            err = translate(e, op, desc, limit, self.rank, seq=seq, group_own=own)
            if isinstance(err, CollectiveTimeoutError):
                gkey = "world" if whole else "-".join(map(str, ranks))
                text = err.args[0].rstrip(". ") + "."
                err.args = (text + self._positions(ranks, gkey, seq, op),)
            raise err from e

    # --- collectives --------------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        group: dist.ProcessGroup | None = None,
        check_finite_first: bool = False,
        name: str = "tensor",
    ) -> torch.Tensor:
        """In-place all-reduce of ``tensor`` (any shape/dtype the backend supports).

        Args:
            check_finite_first: run :func:`verl_comm.distributed.check_finite` first (one small
                extra all-reduce) so a NaN on one rank is named instead of spread.
            name: what the tensor is, for messages.

        Raises:
            NonFiniteError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError.
        """
        with self._guard("all_reduce", group, _fp("all_reduce", tensor, op=op)):
            if check_finite_first:
                check_finite(tensor, group=group, name=name)
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def broadcast(
        self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """In-place broadcast from global rank ``src``; errors as :meth:`all_reduce`."""
        with self._guard("broadcast", group, _fp("broadcast", tensor, src=src)):
            dist.broadcast(tensor, src=src, group=group)
        return tensor

    def all_gather_into_tensor(
        self, output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """``output`` (``W * tensor.numel()`` elements) receives every rank's ``tensor``."""
        with self._guard("all_gather", group, _fp("all_gather", tensor)):
            dist.all_gather_into_tensor(output, tensor, group=group)
        return output

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        """A barrier with the group's timeout (a one-element all-reduce, so it honours the
        timeout on every backend)."""
        t = torch.zeros(1, device=self.device)
        with self._guard("barrier", group, _fp("barrier", None)):
            dist.all_reduce(t, group=group)

    # --- rank-0-only sections -----------------------------------------------------------
    @contextmanager
    def rank0_section(self, name: str, timeout_s: float, src: int = 0) -> Iterator[bool]:
        """A section only rank ``src`` runs (evaluation, checkpointing), with a wider deadline.

        Yields ``True`` on ``src`` (run the body) and ``False`` elsewhere (skip it). At exit,
        the other ranks wait on the store, not in a collective, for up to ``timeout_s``
        seconds, so the job's collective timeout can stay short::

            with ctx.rank0_section("eval", timeout_s=3600) as mine:
                if mine:
                    evaluate()

        Raises:
            Rank0SectionError: on the waiting ranks when ``src`` raised inside the section
                (with its message) or did not finish within ``timeout_s``.
        """
        if timeout_s <= 0:
            raise ValueError(f"rank0_section timeout_s must be positive, got {timeout_s}")
        seq = self._sections.get(name, 0)
        self._sections[name] = seq + 1
        key = f"verl_comm/section/{name}/{seq}"
        if self.rank == src:
            try:
                yield True
            except BaseException as e:
                self.store.set(key, f"error: {type(e).__name__}: {e}")
                raise
            self.store.set(key, "ok")
            return
        yield False
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except Exception as e:
            raise Rank0SectionError(
                f"rank {self.rank}: rank {src} did not finish section {name!r} within "
                f"{timeout_s:g} s; widen rank0_section(timeout_s=...) or shorten the section"
            ) from e
        status = self.store.get(key).decode()
        if status != "ok":
            raise Rank0SectionError(f"rank {src} failed in section {name!r}: {status}")

    def destroy(self) -> None:
        """Tear down: in debug mode, first checks that every rank is at the same position;
        then ``destroy_process_group`` (delete models and ``gc.collect()`` before this)."""
        try:
            if self.checker is not None:
                self.checker.check(list(range(self.world_size)), "destroy_process_group")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def new_group(ranks: list[int], timeout_s: float, **kwargs) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks, timeout=timeout_s)``: the timeout is mandatory.

    torch gives a sub-group 30 min (gloo) / 10 min (NCCL) when no timeout is passed, whatever
    the default group got, so a one-rank collective on a sub-group would hang that long.

    Raises:
        ValueError: non-positive ``timeout_s``.
    """
    if timeout_s <= 0:
        raise ValueError(f"new_group timeout_s must be positive, got {timeout_s}")
    return dist.new_group(ranks, timeout=timedelta(seconds=timeout_s), **kwargs)


def _open_store(
    addr: str, port: int, rank: int, world_size: int, timeout_s: float, is_master: bool, where: str
) -> dist.Store:
    """The rendezvous store (rank 0 hosts it unless torchrun's agent does), scoped to this
    restart attempt.

    Raises:
        RendezvousError: the store could not be started or reached within ``timeout_s``.
    """
    if not is_master:
        _wait_for_listener(addr, port, timeout_s, rank, where)
    try:
        raw = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as e:
        if is_master:
            msg = f"rank 0 could not start the rendezvous store on {where}: {e}"
        else:
            msg = (
                f"rank {rank} could not reach the rendezvous store at {where} within "
                f"{timeout_s:g} s: rank 0 is not running, or MASTER_ADDR/MASTER_PORT are "
                f"wrong or blocked. Backend said: {str(e).strip().splitlines()[0]}"
            )
        raise RendezvousError(msg) from e
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"verl_comm/attempt_{attempt}", raw)


def _join(
    store: dist.Store, rank: int, world_size: int, timeout_s: float, is_master: bool, where: str
) -> None:
    """Mark this rank as joined and wait until every rank has.

    Raises:
        RendezvousError: naming how many ranks joined and which are missing.
    """
    store.set(f"{_JOIN}/{rank}", "1")
    keys = [f"{_JOIN}/{r}" for r in range(world_size)]
    # rank 0 hosts the store: it waits 1 s longer so the others can still ask it who is
    # missing before it raises and the store goes away.
    grace = 1.0 if is_master else 0.0
    try:
        store.wait(keys, timedelta(seconds=timeout_s + grace))
    except Exception as e:
        try:
            present = [r for r, k in enumerate(keys) if store.check([k])]
            joined = f"{len(present)}/{world_size} ranks joined"
            missing = f"missing ranks {sorted(set(range(world_size)) - set(present))}"
        except Exception:  # the store host is gone already
            joined, missing = f"not all {world_size} ranks joined", "rank 0's store closed"
        raise RendezvousError(
            f"rank {rank}: {joined} the rendezvous at {where} within {timeout_s:g} s "
            f"({missing}); start all {world_size} processes or fix WORLD_SIZE"
        ) from e


def init_distributed(
    backend: str,
    timeout_s: float,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_rank: int | None = None,
    fingerprint: bool = False,
) -> DistContext:
    """Initialise the default process group with explicit deadlines; see the module doc.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: deadline in seconds for the rendezvous and every collective.
        rank, world_size, master_addr, master_port, local_rank: default to the ``RANK``,
            ``WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1), ``MASTER_PORT`` (29500) and
            ``LOCAL_RANK`` (``rank % device_count``) variables torchrun sets.
        fingerprint: turn on the op/shape/dtype cross-rank check before each collective.

    Raises:
        ValueError: bad arguments (named).
        InterfaceError: ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` names no interface.
        RendezvousError: store unreachable or not all ranks joined within ``timeout_s``.
        DistributedError: ``init_process_group`` failed (its message included).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive seconds, got {timeout_s}")
    rank = _int_env("RANK", rank)
    world_size = _int_env("WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(master_port or os.environ.get("MASTER_PORT", "29500"))
    check_socket_interfaces(backend)
    timeout = timedelta(seconds=timeout_s)
    where = f"MASTER_ADDR:MASTER_PORT={addr}:{port}"
    # under torchrun the elastic agent already hosts the store on MASTER_PORT: every rank is
    # a client, and keys are scoped per restart attempt so a restart never sees old joins.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master = rank == 0 and not agent_store
    store = _open_store(addr, port, rank, world_size, timeout_s, is_master, where)
    _join(store, rank, world_size, timeout_s, is_master, where)
    device = torch.device("cpu")
    kwargs: dict = {}
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise DistributedError("backend 'nccl' needs CUDA; use backend='gloo' on CPU")
        lr = local_rank if local_rank is not None else os.environ.get("LOCAL_RANK")
        lr = int(lr) if lr is not None else rank % torch.cuda.device_count()
        device = torch.device("cuda", lr)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager init: NCCL errors surface here
    try:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )
    except Exception as e:
        raise DistributedError(f"rank {rank}: init_process_group({backend!r}) failed: {e}") from e
    checker = FingerprintChecker(store, rank, timeout_s) if fingerprint else None
    return DistContext(rank, world_size, backend, timeout_s, store, device, checker)
