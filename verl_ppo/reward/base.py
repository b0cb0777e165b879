"""The reward path's data type and protocol.

A :class:`RewardBatch` carries, per sample, the exact prompt and response token ids
(unpadded), the decoded texts and the task entry (a reasoning-gym dict with
``"question"``, ``"answer"``, ``"metadata"``). Every scorer implements
:class:`RewardModel`: ``score(batch) -> torch.Tensor`` of dtype float32 and shape ``(B,)``
on the CPU.

JSON form (used by the reward server, see :mod:`verl_ppo.reward.server`)::

    {"prompt_ids": [[int, ...], ...], "response_ids": [[int, ...], ...],
     "prompts": [str, ...], "responses": [str, ...], "entries": [{...}, ...]}

All five lists have length B. Entries must be JSON-serialisable (tuples inside
reasoning-gym metadata become lists on the way through, which its scorers accept).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

TokenIds = tuple[int, ...]


class RewardError(RuntimeError):
    """A scorer failed or returned rewards of the wrong shape, dtype or values."""


class RewardInputError(RewardError, ValueError):
    """The batch itself cannot be scored (an entry the scorer cannot read, e.g. without
    ``metadata.source_dataset``): the caller's input, not the scorer, is at fault (the
    reward server answers it with HTTP 400)."""


def _as_id_tuple(ids: Any, field: str, index: int) -> TokenIds:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(
                f"RewardBatch.{field}[{index}] must be a 1-D integer tensor, got "
                f"shape {tuple(ids.shape)} dtype {ids.dtype}"
            )
        return tuple(int(t) for t in ids.tolist())
    try:
        out = tuple(ids)
    except TypeError:
        raise ValueError(
            f"RewardBatch.{field}[{index}] must be a sequence of ints, got {type(ids).__name__}"
        ) from None
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(
                f"RewardBatch.{field}[{index}] must hold ints only, found {t!r} "
                f"({type(t).__name__}); pass token ids, not text"
            )
    return out


@dataclass(frozen=True)
class RewardBatch:
    """B samples to score.

    Attributes:
        prompt_ids: B tuples of prompt token ids, padding removed (any length >= 0).
        response_ids: B tuples of response token ids, padding removed.
        prompts: B decoded prompt texts.
        responses: B decoded response (completion) texts.
        entries: B task entries (dicts), e.g. reasoning-gym items with ``"answer"``.

    Build it from padded tensors with :meth:`from_padded`. The exact token sequence
    ``prompt_ids + response_ids`` is the cache key (:meth:`token_key`).

    Raises:
        ValueError: if the lists differ in length, ids are not ints, or an entry is not
            a dict (the message names the field).
    """

    prompt_ids: tuple[TokenIds, ...]
    response_ids: tuple[TokenIds, ...]
    prompts: tuple[str, ...]
    responses: tuple[str, ...]
    entries: tuple[dict, ...]

    def __init__(
        self,
        prompt_ids: Sequence[Any],
        response_ids: Sequence[Any],
        prompts: Sequence[str],
        responses: Sequence[str],
        entries: Sequence[dict],
    ) -> None:
        n = len(prompt_ids)
        for name, seq in (
            ("response_ids", response_ids),
            ("prompts", prompts),
            ("responses", responses),
            ("entries", entries),
        ):
            if len(seq) != n:
                raise ValueError(
                    f"RewardBatch.{name} has {len(seq)} items but prompt_ids has {n}; "
                    "every field needs one item per sample"
                )
        for name, seq in (("prompts", prompts), ("responses", responses)):
            for i, s in enumerate(seq):
                if not isinstance(s, str):
                    raise ValueError(
                        f"RewardBatch.{name}[{i}] must be str (decoded text), got "
                        f"{type(s).__name__}"
                    )
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise ValueError(
                    f"RewardBatch.entries[{i}] must be a dict (task entry), got {type(e).__name__}"
                )
        set_ = object.__setattr__
        set_(
            self,
            "prompt_ids",
            tuple(_as_id_tuple(p, "prompt_ids", i) for i, p in enumerate(prompt_ids)),
        )
        set_(
            self,
            "response_ids",
            tuple(_as_id_tuple(r, "response_ids", i) for i, r in enumerate(response_ids)),
        )
        set_(self, "prompts", tuple(prompts))
        set_(self, "responses", tuple(responses))
        set_(self, "entries", tuple(entries))

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @classmethod
    def from_padded(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        prompts: Sequence[str],
        responses: Sequence[str],
        entries: Sequence[dict],
    ) -> RewardBatch:
        """Build a batch from padded id tensors and their attention masks.

        Args:
            prompt_ids: ``(B, P)`` integer tensor (left or right padded).
            prompt_mask: ``(B, P)`` bool/int tensor, nonzero where a real token is.
            response_ids: ``(B, R)`` integer tensor.
            response_mask: ``(B, R)`` bool/int tensor, zero on padding and after EOS.
            prompts, responses, entries: B texts / entries as in the class.

        Raises:
            ValueError: if shapes disagree or ids are not integers.
        """
        for name, ids, mask in (
            ("prompt", prompt_ids, prompt_mask),
            ("response", response_ids, response_mask),
        ):
            if ids.dim() != 2 or ids.shape != mask.shape:
                raise ValueError(
                    f"{name}_ids {tuple(ids.shape)} and {name}_mask {tuple(mask.shape)} must be "
                    "equal 2-D shapes (B, L)"
                )
            if ids.is_floating_point():
                raise ValueError(f"{name}_ids must be an integer tensor, got {ids.dtype}")
        if prompt_ids.shape[0] != response_ids.shape[0]:
            raise ValueError(
                f"prompt_ids has {prompt_ids.shape[0]} rows, response_ids {response_ids.shape[0]}"
            )
        p = [row[m.bool()] for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        r = [row[m.bool()] for row, m in zip(response_ids.cpu(), response_mask.cpu())]
        return cls(p, r, prompts, responses, entries)

    def token_key(self, i: int) -> tuple[int, bytes]:
        """Exact cache key of sample ``i``: (prompt length, int64 bytes of prompt+response).

        The prompt length keeps the prompt/response boundary in the key; the bytes hold
        every token (8 bytes per token), so two different sequences never share a key.
        """
        import array

        p, r = self.prompt_ids[i], self.response_ids[i]
        return len(p), array.array("q", p + r).tobytes()

    def select(self, indices: Sequence[int]) -> RewardBatch:
        """Sub-batch holding samples ``indices`` in that order."""
        return RewardBatch(
            [self.prompt_ids[i] for i in indices],
            [self.response_ids[i] for i in indices],
            [self.prompts[i] for i in indices],
            [self.responses[i] for i in indices],
            [self.entries[i] for i in indices],
        )

    def to_json(self) -> dict:
        """The JSON-serialisable form documented in the module docstring."""
        return {
            "prompt_ids": [list(p) for p in self.prompt_ids],
            "response_ids": [list(r) for r in self.response_ids],
            "prompts": list(self.prompts),
            "responses": list(self.responses),
            "entries": list(self.entries),
        }

    @classmethod
    def from_json(cls, obj: Any) -> RewardBatch:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: naming the missing or malformed field.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"request body must be a JSON object, got {type(obj).__name__}")
        fields = ("prompt_ids", "response_ids", "prompts", "responses", "entries")
        missing = [f for f in fields if f not in obj]
        if missing:
            raise ValueError(f"request is missing field(s) {missing}; expected {list(fields)}")
        for f in fields:
            if not isinstance(obj[f], list):
                raise ValueError(f"field {f!r} must be a JSON list, got {type(obj[f]).__name__}")
        return cls(*(obj[f] for f in fields))


@runtime_checkable
class RewardModel(Protocol):
    """Anything that scores a :class:`RewardBatch`.

    ``score`` returns a float32 CPU tensor of shape ``(B,)``, one reward per sample, in
    the order of the batch. Implementations: :class:`~verl_ppo.reward.rule.RuleReward`,
    :class:`~verl_ppo.reward.model.ModelReward`,
    :class:`~verl_ppo.reward.remote.RemoteReward`; wrappers
    :class:`~verl_ppo.reward.cache.CachedReward`, :class:`~verl_ppo.reward.stats.TimedReward`.
    """

    def score(self, batch: RewardBatch) -> torch.Tensor:  # pragma: no cover - protocol
        ...


def check_rewards(rewards: Any, batch_size: int, source: str) -> torch.Tensor:
    """Validate a scorer's output and return it as a float32 CPU tensor of shape (B,).

    Raises:
        RewardError: naming ``source`` if the output is not a tensor/list of B finite floats.
    """
    if not isinstance(rewards, torch.Tensor):
        try:
            rewards = torch.tensor(rewards, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise RewardError(f"{source} returned {type(rewards).__name__}, not numbers") from exc
    if rewards.shape != (batch_size,):
        raise RewardError(
            f"{source} returned rewards of shape {tuple(rewards.shape)}, expected ({batch_size},)"
        )
    rewards = rewards.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(rewards).all()):
        bad = [i for i, v in enumerate(rewards.tolist()) if not math.isfinite(v)]
        raise RewardError(f"{source} returned non-finite rewards at samples {bad[:8]}")
    return rewards
