"""Bytes counted at the transport calls, per peer, independently of the plan.

:class:`WireCounter` stands between the reshard executor and ``torch.distributed``: every
``all_to_all_single`` and every ``isend``/``irecv`` of a ``batch_isend_irecv`` goes through
it, and it adds up, per peer, the bytes of the tensors actually handed to the backend
(``numel * element_size`` of each send slice, and of each receive slice the backend
fills). The executor's own figure (:attr:`ReshardStats.bytes_received`) is the sum of the
plan's transfer sizes; the counter never reads the plan.

A rank only sees its own side; :func:`pairwise_mismatches` gathers every rank's counts and
compares what rank ``i`` sent to ``j`` with what ``j`` received from ``i``, so a send and
a receive that disagree (a wrong split, padding on the wire) are caught on both ends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class WireCounter:
    """Per-peer byte counts of the point-to-point and all-to-all calls made through it.

    Args:
        world_size: ranks in ``group``.
        rank: this rank's index in ``group``.
        group: the process group the calls run on (None = WORLD).

    Attributes:
        sent, received: bytes per peer (group index), summed since :meth:`reset`; the
            rank's own slot counts rank-to-itself payload (none in the reshard executor).
    """

    def __init__(self, world_size: int, rank: int, group: dist.ProcessGroup | None = None):
        self.world_size, self.rank, self.group = world_size, rank, group
        self.reset()

    def reset(self) -> None:
        """Zero the counts (the executor calls this at the start of every reshard)."""
        self.sent = [0] * self.world_size
        self.received = [0] * self.world_size

    def wire_sent(self) -> int:
        """Bytes this rank sent to other ranks."""
        return sum(b for p, b in enumerate(self.sent) if p != self.rank)

    def wire_received(self) -> int:
        """Bytes this rank received from other ranks."""
        return sum(b for p, b in enumerate(self.received) if p != self.rank)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> Any:
        """``dist.all_to_all_single`` (async) with the slices' bytes counted per peer.

        Raises:
            ValueError: split sizes that do not add up to the tensors' element counts
                (the backend would reject or misread them).
        """
        for name, t, splits in (
            ("output", output, output_split_sizes),
            ("input", input, input_split_sizes),
        ):
            if sum(splits) != t.numel() or len(splits) != self.world_size:
                raise ValueError(
                    f"{name} splits {splits} do not cover the {t.numel()} elements of the "
                    f"{name} tensor over {self.world_size} ranks"
                )
        for peer in range(self.world_size):
            self.sent[peer] += input_split_sizes[peer] * input.element_size()
            self.received[peer] += output_split_sizes[peer] * output.element_size()
        return dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=self.group, async_op=True
        )

    def batch_isend_irecv(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """Batched point-to-point: ``ops`` are ``("send" | "recv", tensor, peer)`` with
        ``peer`` a group index; each tensor's bytes are counted against its peer."""
        p2p = []
        for kind, t, peer in ops:
            g = peer if self.group is None else dist.get_global_rank(self.group, peer)
            if kind == "send":
                self.sent[peer] += t.numel() * t.element_size()
                p2p.append(dist.P2POp(dist.isend, t, g, self.group))
            elif kind == "recv":
                self.received[peer] += t.numel() * t.element_size()
                p2p.append(dist.P2POp(dist.irecv, t, g, self.group))
            else:
                raise ValueError(f"op kind must be 'send' or 'recv', got {kind!r}")
        return dist.batch_isend_irecv(p2p) if p2p else []


def pairwise_mismatches(
    sent: list[int],
    received: list[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> list[str]:
    """Compare every rank's per-peer sent bytes with its peers' received bytes (collective).

    Args:
        sent, received: this rank's :attr:`WireCounter.sent` / ``received`` (bytes per
            peer, group indices).
        group: the counters' process group (None = WORLD).
        device: where the gathered counts live (the group's device: CUDA for NCCL).

    Returns:
        One line per ordered pair ``i -> j`` (``i != j``) where rank ``i`` counted a
        different number of bytes sent to ``j`` than ``j`` counted received from ``i``;
        empty when all agree. The same list on every rank.
    """
    n = len(sent)
    mine = torch.tensor([sent, received], dtype=torch.int64, device=device)
    allc = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(allc, mine, group=group)
    bad = []
    for i in range(n):
        for j in range(n):
            s, r = int(allc[i][0, j].item()), int(allc[j][1, i].item())
            if i != j and s != r:
                bad.append(f"rank {i} -> {j}: sent {s} B, received {r} B")
    return bad
