"""Distributed helpers whose failures are clear errors in bounded time.

- :func:`init_distributed` -> :class:`DistContext`: explicit timeouts for the rendezvous and
  every collective; interface variables checked; eager NCCL init with ``device_id``.
- :func:`new_group` / :meth:`DistContext.new_group`: sub-groups get the same timeout.
- :meth:`DistContext.rank0_section`: a rank-0-only section with a wider deadline.
- ``init_distributed(..., fingerprint=True)``: op/shape/dtype checked across ranks before each
  collective (:class:`FingerprintChecker`).
- :func:`check_finite`: names the rank whose tensor holds NaN/Inf before a reduction.
- :mod:`verl_comm.distributed.errors`: the error classes.
"""

from verl_comm.distributed.checks import FingerprintChecker, check_finite, fingerprint
from verl_comm.distributed.context import (
    DistContext,
    check_socket_interfaces,
    init_distributed,
    new_group,
)
from verl_comm.distributed.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistributedError,
    InterfaceError,
    NonFiniteError,
    PeerLostError,
    Rank0SectionError,
    RendezvousError,
    translate,
)

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistContext",
    "DistributedError",
    "FingerprintChecker",
    "InterfaceError",
    "NonFiniteError",
    "PeerLostError",
    "Rank0SectionError",
    "RendezvousError",
    "check_finite",
    "check_socket_interfaces",
    "fingerprint",
    "init_distributed",
    "new_group",
    "translate",
]
