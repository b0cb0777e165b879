"""The typed batch that flows through one PPO step (OpenRLHF's ``Experience`` is the model).

Shapes: ``B`` sequences on this rank, ``P`` prompt length (left-padded), ``R`` response
length (right-padded). Every per-token tensor is ``(B, R)`` and aligned with ``responses``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class Experience:
    """One rank's rollout batch and everything computed from it.

    Attributes:
        input_ids: ``(B, P + R)`` int64, prompt + response.
        attention_mask: ``(B, P + R)`` int64, 0 on left prompt padding and after EOS.
        prompt_len: ``P``.
        responses: ``(B, R)`` int64.
        response_mask: ``(B, R)`` float32, 1 up to and including EOS.
        group_index: ``(B,)`` int64, samples of one prompt share an index (GRPO).
        entries: the reasoning-gym entries, one per sequence.
        scores: ``(B,)`` float32 rule reward of each response.
        rollout_log_prob: ``(B, R)`` float32, the sampler's log-probs of the responses
            (0 after EOS; :mod:`verl_ppo.rollout.sampler`).
        old_log_prob, ref_log_prob, values, token_level_rewards, advantages, returns:
            ``(B, R)`` float32, filled by the phases of the step.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    responses: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor
    entries: list = field(default_factory=list)
    scores: torch.Tensor | None = None
    rollout_log_prob: torch.Tensor | None = None
    old_log_prob: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None
    values: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Number of sequences ``B``."""
        return int(self.input_ids.shape[0])

    def slice(self, idx: torch.Tensor | slice) -> Experience:
        """The sub-batch at ``idx`` (tensors indexed on dim 0; entries too)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx]
            elif f.name == "entries":
                if isinstance(idx, slice):
                    out[f.name] = v[idx]
                else:
                    out[f.name] = [v[i] for i in idx.tolist()]
            else:
                out[f.name] = v
        return Experience(**out)

    def split(self, size: int) -> list[Experience]:
        """Consecutive sub-batches of ``size`` sequences (the last may be smaller)."""
        return [self.slice(slice(i, i + size)) for i in range(0, self.batch_size, size)]
