"""Clear errors for distributed failures.

Every failure that :mod:`verl_comm.distributed` detects or translates is a :class:`DistributedError`
(a ``RuntimeError``) whose message names what failed (the variable, the address, the
collective and its group), the deadline that fired, and the likely fix.
"""

from __future__ import annotations

_HINT_SECTION = (
    "if one rank runs a rank-0-only section (evaluation, checkpointing, logging) longer than "
    "the timeout, wrap it in verl_comm.distributed.rank0_section(ctx, name, timeout_s=...), which "
    "makes the other ranks wait with a wider deadline"
)
_HINT_FINGERPRINT = (
    "init_distributed(..., fingerprint=True) checks op, shape and dtype across ranks before "
    "each collective and names a mismatch at once"
)


class DistributedError(RuntimeError):
    """Base class: a distributed operation failed; the message says what and why."""


class InterfaceError(DistributedError):
    """A socket-interface variable (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) names
    no interface of this host or uses the wrong syntax."""


class RendezvousError(DistributedError):
    """The rendezvous did not complete: the store at ``MASTER_ADDR:MASTER_PORT`` is not
    reachable, or not all ranks joined before the deadline."""


class CollectiveTimeoutError(DistributedError):
    """A collective did not complete within the configured timeout."""


class PeerLostError(DistributedError):
    """A peer closed its connection during a collective (it failed or exited first)."""


class CollectiveMismatchError(DistributedError):
    """Ranks issued different collectives (op, shape or dtype) at the same position."""


class NonFiniteError(DistributedError):
    """A rank's tensor holds NaN or Inf before a reduction."""


class Rank0SectionError(DistributedError):
    """The rank running a rank-0-only section failed or overran the section's deadline."""


def describe_group(ranks: list[int] | None, world_size: int) -> str:
    """``"the default group (3 ranks)"`` (``ranks is None``) or ``"sub-group [0, 2]"``."""
    if ranks is None:
        return f"the default group ({world_size} ranks)"
    return f"sub-group {ranks}"


def translate(
    exc: BaseException,
    op: str,
    group_desc: str,
    timeout_s: float,
    rank: int,
    *,
    seq: int | None = None,
    group_own: bool = False,
) -> DistributedError:
    """Turn a backend exception raised by collective ``op`` into a clear error.

    Args:
        exc: what gloo/NCCL/c10d raised.
        op: the collective, e.g. ``"all_reduce"``.
        group_desc: from :func:`describe_group`.
        timeout_s: the deadline that applied: the group's own timeout in seconds.
        rank: this process's global rank.
        seq: this rank's sequence number of the collective on its group (0-based), if known.
        group_own: the deadline is the sub-group's own (``new_group(..., timeout_s=)``),
            not the job's.

    Returns:
        A :class:`CollectiveTimeoutError` (the backend reports a timeout),
        :class:`PeerLostError` (connection closed or reset by a peer) or a plain
        :class:`DistributedError`; the original exception is kept as ``__cause__`` by the
        caller (``raise translate(...) from exc``).
    """
    if isinstance(exc, DistributedError):
        return exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    low = str(exc).lower()
    if "timed out" in low or "timeout" in low:
        which = "the sub-group's own timeout" if group_own else "the configured timeout"
        nth = f" (its collective #{seq} there)" if seq is not None else ""
        return CollectiveTimeoutError(
            f"rank {rank}: {op} on {group_desc}{nth} did not complete within {which} of "
            f"{timeout_s:g} s. A peer did not join it: it is stuck, dead, issuing a "
            f"different collective, or busy elsewhere. Hints: {_HINT_SECTION}; "
            f"{_HINT_FINGERPRINT}. Backend said: {text}"
        )
    if any(s in low for s in ("connection closed", "connection reset", "broken pipe", "eof")):
        return PeerLostError(
            f"rank {rank}: {op} on {group_desc} failed because a peer closed its connection: "
            f"another rank failed or exited first; look for its error. Backend said: {text}"
        )
    return DistributedError(f"rank {rank}: {op} on {group_desc} failed: {text}")
