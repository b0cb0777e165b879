"""Experiences from rollout ranks to training ranks (point-to-point on the bridge).

Per (step, training rank) the rollout rank posts three ``isend`` s on the ``experience``
bridge group (:mod:`verl_ppo.asyncrl.world`): a header (int64: step, weights version,
``B``, ``P``, ``R``), the int64 tensors (``input_ids`` and ``attention_mask``
``(B, P + R)``, ``group_index (B,)``) and the float32 tensors (``response_mask`` and
``rollout_log_prob`` ``(B, R)``, ``scores (B,)``), flattened and concatenated. The training
rank rebuilds the :class:`~verl_ppo.step.experience.Experience`; the task entries it
rebuilds from its own prompt order (the same as the rollout's, checked through the group
indices). Every wait has the ``comm.timeout_s`` deadline and names the peer and the phase.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from verl_ppo.reshard.group_sync import wait_work
from verl_ppo.step.experience import Experience

STATS = ("async/rollout_gen_s", "async/sync_pause_s", "async/sync_transfer_s")
"""Rollout-side seconds shipped with each batch: its generation, and the pause and the
transfer of the last weight switch before it (the sync's two times kept apart)."""


class RolloutLinkError(RuntimeError):
    """An experience transfer failed: a dead or late peer, or batches that do not match."""


class ExperienceChannel:
    """Sends (rollout side) or receives (training side) experiences.

    Args:
        group: the ``experience`` bridge group.
        rank: this bridge rank.
        device: where tensors live (``cuda`` with NCCL).
        timeout_s: deadline of each wait (``comm.timeout_s``).
    """

    def __init__(self, group: Any, rank: int, device: torch.device, timeout_s: float) -> None:
        self.group, self.rank, self.device, self.timeout_s = group, rank, device, timeout_s
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[Any, int, str, torch.Tensor]] = []

    def send(
        self, dst: int, step: int, version: int, exp: Experience, stats: dict[str, float]
    ) -> int:
        """Post ``exp`` (``scores`` and ``rollout_log_prob`` filled) and ``stats`` (the
        :data:`STATS` keys, seconds) for training rank ``dst``; returns the bytes posted.
        Waits first for the sends posted before.

        Raises:
            RolloutLinkError: earlier sends not taken within ``timeout_s``.
        """
        self.finish()
        B, P, R = exp.batch_size, exp.prompt_len, exp.responses.shape[1]
        header = torch.tensor([step, version, B, P, R], dtype=torch.int64, device=self.device)
        ints = torch.cat(
            [exp.input_ids.reshape(-1), exp.attention_mask.reshape(-1), exp.group_index]
        )
        extra = torch.tensor([float(stats.get(k, 0.0)) for k in STATS], device=exp.scores.device)
        floats = torch.cat(
            [exp.response_mask.reshape(-1), exp.rollout_log_prob.reshape(-1), exp.scores, extra]
        ).float()
        sent = 0
        for name, t in (("header", header), ("token ids", ints.long()), ("log-probs", floats)):
            t = t.to(self.device).contiguous()
            self._pending.append((self.group.send([t], dst, 0), dst, f"{name} of step {step}", t))
            sent += t.numel() * t.element_size()
        return sent

    def finish(self) -> None:
        """Wait until every posted send was taken.

        Raises:
            RolloutLinkError: a training rank did not take its batch within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        pending, self._pending = self._pending, []
        for work, dst, what, _ in pending:
            wait_work(
                work, deadline, self.cuda,
                f"rank {self.rank} (rollout): experience send ({what}) to training rank {dst}",
                RolloutLinkError,
            )  # fmt: skip

    def _recv(self, t: torch.Tensor, src: int, what: str, deadline: float) -> torch.Tensor:
        wait_work(
            self.group.recv([t], src, 0), deadline, self.cuda,
            f"rank {self.rank}: experience receive ({what}) from rollout rank {src}",
            RolloutLinkError,
        )  # fmt: skip
        return t

    def recv(
        self, src: int, step: int, prompts: tuple[list[dict], torch.Tensor]
    ) -> tuple[Experience, int, dict[str, float]]:
        """Receive the batch of ``step`` from rollout rank ``src``.

        Args:
            prompts: ``(entries, group_index (B,))`` of this rank's prompts of ``step``
                (:meth:`~verl_ppo.step.experience_maker.ExperienceMaker.prompts`).

        Returns:
            ``(experience, weights version that generated it, the rollout's`` :data:`STATS` ``)``.

        Raises:
            RolloutLinkError: nothing within ``timeout_s``, a dead peer, another step, or
                prompts that are not this rank's.
        """
        deadline = time.monotonic() + self.timeout_s
        h = self._recv(
            torch.empty(5, dtype=torch.int64, device=self.device),
            src,
            f"header of step {step}",
            deadline,
        )
        got, version, B, P, R = h.tolist()
        if got != step:
            raise RolloutLinkError(
                f"rank {self.rank}: rollout rank {src} sent step {got}, expected {step}"
            )
        ints = self._recv(
            torch.empty(2 * B * (P + R) + B, dtype=torch.int64, device=self.device),
            src,
            f"token ids of step {step}",
            deadline,
        )
        floats = self._recv(
            torch.empty(2 * B * R + B + len(STATS), dtype=torch.float32, device=self.device),
            src,
            f"log-probs of step {step}",
            deadline,
        )
        ids, mask, group = ints.split([B * (P + R), B * (P + R), B])
        rmask, lp, scores, extra = floats.split([B * R, B * R, B, len(STATS)])
        entries, want_group = prompts
        if not torch.equal(group.cpu(), want_group.cpu()):
            raise RolloutLinkError(
                f"rank {self.rank}: the batch of step {step} from rollout rank {src} holds "
                "other prompts than this rank's (the two sides disagree on the data order)"
            )
        ids = ids.view(B, P + R)
        exp = Experience(
            input_ids=ids,
            attention_mask=mask.view(B, P + R),
            prompt_len=P,
            responses=ids[:, P:],
            response_mask=rmask.view(B, R),
            group_index=group,
            entries=entries,
            scores=scores,
            rollout_log_prob=lp.view(B, R),
        )
        return exp, version, dict(zip(STATS, extra.tolist()))
