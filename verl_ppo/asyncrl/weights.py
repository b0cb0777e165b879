"""Weights of the async mode: published by the training ranks after every optimizer step,
switched in by the rollout ranks between batches.

Both sides build the same :func:`~verl_ppo.reshard.group_plan.plan_group_sync` plan:
training layout DP ``comm.nproc`` (TP 1, the actor's ZeRO stage <= 2: every training rank
holds full weights, so the shards are spread over all of them as senders), rollout layout
TP ``rollout.tensor_model_parallel_size`` x DP. Version ``v`` is the weights after ``v``
optimizer steps; the training ranks publish versions ``first step .. num_steps - 1`` (one
per step, in order, the first in full), so the rollout ranks switch through every one of
them (the delta wire is against the previous version).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_ppo.asyncrl.world import AsyncWorld
from verl_ppo.reshard.group_plan import GroupSyncPlan, plan_group_sync
from verl_ppo.reshard.group_sync import SyncReceiver, SyncSender, SyncStats
from verl_ppo.reshard.layout import ParallelLayout

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def sync_plan(cfg: Any, model_config: Any, actor_zero_stage: int) -> GroupSyncPlan:
    """The plan every rank of the async job builds alike, and preflight before any rank
    starts (pure): bridge ranks ``0 .. comm.nproc - 1`` train, the next
    ``rollout.n_ranks`` generate (:class:`~verl_ppo.asyncrl.world.AsyncWorld`).

    Raises:
        ValueError: layouts the plan cannot serve (see ``plan_group_sync``).
    """
    t, r, tp = cfg.comm.nproc, cfg.rollout.n_ranks, cfg.rollout.tensor_model_parallel_size
    return plan_group_sync(
        model_config,
        ParallelLayout(dp=t, zero_stage=actor_zero_stage),
        ParallelLayout(dp=r // tp, tp=tp),
        range(t),
        range(t, t + r),
    )


class WeightPublisher:
    """Training side: post the current weights to the rollout ranks (non-blocking).

    Args:
        plan: :func:`sync_plan`.
        world: the async world (this rank a training rank).
        cfg: the config (``rollout.sync_wire``, ``rollout.dtype``).
        device: where the weights live.
    """

    def __init__(self, plan: GroupSyncPlan, world: AsyncWorld, cfg: Any, device: torch.device):
        r = cfg.rollout
        self.sender = SyncSender(
            plan, world.rank, world.weights, r.sync_wire, DTYPES[r.dtype], device, world.timeout_s
        )

    def publish(self, params: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Post ``params`` (full weights by HF name); waits first for the previous sync to
        be taken. Returns ``async/sync_*`` metrics of this rank's sends.

        Raises:
            WeightSyncError: the previous sync was not received within ``timeout_s``.
        """
        st: SyncStats = self.sender.start(params)
        return {
            "async/sync_bytes_sent": float(st.bytes_sent),
            "async/sync_changed_frac": st.changed / max(st.elems, 1),
            "async/sync_encode_s": st.encode_s,
        }

    def close(self) -> None:
        """Wait until the last sync was taken (bounded by ``timeout_s``)."""
        self.sender.finish()


class RolloutWeights:
    """Rollout side: the HF policy whose parameters are the receiver's live shards.

    At TP 1 each parameter of ``policy`` is made a view of
    :attr:`~verl_ppo.reshard.group_sync.SyncReceiver.live` (same storage), so a switch is
    what the next generation reads, through the same HF forward as the colocated mode.

    Args:
        plan: :func:`sync_plan`.
        world: the async world (this rank a rollout rank).
        cfg: the config.
        policy: at TP 1, the HF causal LM in the rollout dtype on ``device`` (its initial
            values are replaced by the first sync); None at TP > 1 (the TP model reads
            ``receiver.live``, :mod:`verl_ppo.asyncrl.tp_rollout`).
        device: this rank's device.

    Attributes:
        version: the weights version generation reads (None before the first switch).

    Raises:
        ValueError: a parameter of ``policy`` the plan does not cover, or another shape.
    """

    def __init__(
        self,
        plan: GroupSyncPlan,
        world: AsyncWorld,
        cfg: Any,
        policy: torch.nn.Module | None,
        device: torch.device,
    ) -> None:
        r = cfg.rollout
        self.receiver = SyncReceiver(
            plan, world.rank, world.weights, r.sync_wire, DTYPES[r.dtype], device, world.timeout_s
        )
        live = self.receiver.live
        for name, p in policy.named_parameters() if policy is not None else ():
            if name not in live or live[name].shape != p.shape:
                got = None if name not in live else tuple(live[name].shape)
                raise ValueError(
                    f"rollout weights: {name} {tuple(p.shape)} not in the sync plan (got {got})"
                )
            p.data = live[name]
        self.policy = policy
        self.version: int | None = None
        self.last: dict[str, float] = {}

    def start(self) -> None:
        """Begin receiving the next version in the background."""
        self.receiver.start()

    def switch(self, first: int, last: int) -> int:
        """Wait for the version after :attr:`version` (``first`` when none yet) and switch
        it in; the receive of the next one starts unless it was ``last``. Returns the new
        version.

        Raises:
            WeightSyncError: timeout, dead sender or checksum mismatch (rank, peer, phase).
        """
        st = self.receiver.switch()
        self.version = first if self.version is None else self.version + 1
        self.last = {
            "async/sync_pause_s": st.pause_s,
            "async/sync_transfer_s": st.transfer_s,
            "async/sync_bytes_received": float(st.bytes_received),
        }
        if self.version < last:
            self.receiver.start()
        return self.version
