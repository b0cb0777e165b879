"""Opt-in consistency checks run before collectives.

- :class:`FingerprintChecker`: before each collective every rank posts a fingerprint
  (sequence number, op, shape, dtype, extra arguments) to the rendezvous store and compares
  it with everyone else's. A mismatch (one rank's ``all_reduce`` against another's
  ``broadcast``, shapes ``[4]`` vs ``[8]``, a collective issued on one rank only) becomes a
  :class:`CollectiveMismatchError` on every rank as soon as the peers reach their own next
  collective, instead of a hang, a wrong result or gloo aborting the process. Cost: one store
  ``set`` plus one ``wait`` and ``W`` ``get`` per collective (a few hundred microseconds on a
  local store), so it is a debug mode, like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
- :func:`check_finite`: one small all-reduce of per-rank NaN/Inf counts; names the ranks
  whose tensor is not finite before a reduction spreads the NaN everywhere.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_comm.distributed.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NonFiniteError,
)

_PREFIX = "verl_comm/fp"


def fingerprint(name: str, tensor: torch.Tensor | None, **extra: object) -> str:
    """Fingerprint of one collective call: ``"all_reduce shape=[4] dtype=float32 op=SUM"``.

    Args:
        name: collective name.
        tensor: its (input) tensor, or ``None`` (barrier).
        extra: arguments that must agree across ranks (reduce op, src).
    """
    parts = [name]
    if tensor is not None:
        parts += [f"shape={list(tensor.shape)}", f"dtype={str(tensor.dtype).replace('torch.', '')}"]
    parts += [f"{k}={v}" for k, v in sorted(extra.items())]
    return " ".join(parts)


class FingerprintChecker:
    """Compares collective fingerprints across the ranks of each group through a store.

    Args:
        store: the rendezvous store (``torch.distributed.Store``), shared by all ranks.
        rank: this process's global rank.
        timeout_s: how long to wait for the peers' fingerprints (seconds); a peer that never
            reaches a collective is reported after this long.
    """

    def __init__(self, store: dist.Store, rank: int, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self._seq: dict[str, int] = {}

    def _linger(self, key: str, n: int, max_s: float = 1.0) -> None:
        """Before raising: count this rank as done reading; the store host (rank 0) waits up
        to ``max_s`` for the others so its exit does not cut them off mid-read."""
        self.store.add(key, 1)
        if self.rank != 0:
            return
        end = time.monotonic() + max_s
        while self.store.add(key, 0) < n and time.monotonic() < end:
            time.sleep(0.01)

    def check(self, group_ranks: list[int], fp: str) -> None:
        """Post ``fp`` for this rank's next collective on the group of ``group_ranks``
        (global ranks) and compare with the peers'.

        Raises:
            CollectiveMismatchError: some rank posted a different fingerprint at the same
                position; the message lists each rank's call.
            CollectiveTimeoutError: some rank posted nothing within ``timeout_s``; the
                message names the ranks and this rank's collective.
        """
        tag = "-".join(map(str, group_ranks))
        if len(tag) > 64:  # large groups: a digest keeps store keys short
            tag = hashlib.sha1(tag.encode()).hexdigest()[:16]
        seq = self._seq.get(tag, 0)
        self._seq[tag] = seq + 1
        base = f"{_PREFIX}/{tag}/{seq}"
        self.store.set(f"{base}/{self.rank}", fp)
        keys = [f"{base}/{r}" for r in group_ranks]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as e:  # store timeout: name who is missing
            try:
                missing = [r for r, k in zip(group_ranks, keys) if not self.store.check([k])]
            except Exception:  # rank 0 (the store host) is gone
                missing = ["unknown: rank 0's store closed"]
            raise CollectiveTimeoutError(
                f"rank {self.rank}: collective #{seq} on ranks {group_ranks} ({fp}): "
                f"rank(s) {missing} issued no collective within {self.timeout_s:g} s "
                "(a collective issued on some ranks only, or a rank stuck or dead)"
            ) from e
        got = {r: self.store.get(k).decode() for r, k in zip(group_ranks, keys)}
        if len(set(got.values())) > 1:
            self._linger(f"{base}/read", len(group_ranks))
            calls = "; ".join(f"rank {r}: {v}" for r, v in got.items())
            raise CollectiveMismatchError(
                f"collective #{seq} on ranks {group_ranks} differs across ranks: {calls}. "
                "Every rank must issue the same collectives in the same order with the same "
                "shapes and dtypes"
            )
        if seq > 0:  # everyone has posted seq, so everyone has finished reading seq - 1
            self.store.delete_key(f"{_PREFIX}/{tag}/{seq - 1}/{self.rank}")


def check_finite(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    name: str = "tensor",
) -> None:
    """Raise on every rank if any rank's ``tensor`` holds NaN or Inf (a collective).

    One all-reduce of a ``(2, W)`` int64 tensor (counts and first bad flat index per rank),
    placed on ``tensor``'s device (CUDA for NCCL, CPU for gloo).

    Args:
        tensor: any shape, floating dtype (integer tensors are always finite and skipped
            locally, but the collective still runs so ranks stay in step).
        group: process group (``None`` = WORLD).
        name: what the tensor is, used in the message (e.g. ``"grad bucket 3"``).

    Raises:
        NonFiniteError: naming each bad rank, its NaN/Inf count and first flat index.
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    stats = torch.zeros(2, world, dtype=torch.int64, device=tensor.device)
    if tensor.is_floating_point() or tensor.is_complex():
        bad = ~torch.isfinite(tensor.detach().reshape(-1))
        count = int(bad.sum())
        if count:
            stats[0, me] = count
            stats[1, me] = int(bad.nonzero()[0, 0])
    dist.all_reduce(stats, group=group)
    stats = stats.cpu()
    bad_ranks = [r for r in range(world) if stats[0, r] > 0]
    if bad_ranks:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        detail = "; ".join(
            f"rank {ranks[r]}: {int(stats[0, r])} NaN/Inf value(s), first at flat index "
            f"{int(stats[1, r])}"
            for r in bad_ranks
        )
        raise NonFiniteError(
            f"non-finite values in {name} before the reduction ({detail}). A plain all-reduce "
            "would have spread them to every rank; look at that rank's loss, inputs or "
            "learning rate"
        )
