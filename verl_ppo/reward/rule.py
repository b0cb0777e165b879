"""Rule-based rewards from reasoning-gym's own scorers.

Each entry names its dataset in ``entry["metadata"]["source_dataset"]``; the scorer is
that dataset's ``score_answer(answer, entry) -> float in [0, 1]``
(``reasoning_gym.get_score_answer_fn``). The answer is first extracted from the
completion by the tasks' own rule (:func:`verl_ppo.data.tasks.task_answer`): the text
inside the last ``<answer>...</answer>`` pair; after an opening tag cut off by the length
limit, the text after it; without a tag, for numeric tasks the last number. This is what
the in-process reward (``Task.score``) does, so ``verl-ppo reward-server --model rule``
scores exactly like the trainer's default reward. reasoning-gym's scorers read only the
entry, not the dataset's config, so a server needs no ``data.task_kwargs``.

Entries in verl's format (``data_source``, ``reward_model.ground_truth``, ``extra_info``;
:mod:`verl_ppo.data.verl_format`) are scored too (:func:`rg_entry`): ``data_source`` names
the reasoning-gym dataset, and the reasoning-gym entry is ``extra_info.rg_entry`` (JSON, as
``verl-ppo data export`` writes it) or, without it, ``{"answer": ground_truth}``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from verl_ppo.data.tasks import task_answer
from verl_ppo.reward.base import RewardBatch, RewardError, RewardInputError

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_tagged_answer(text: str) -> str | None:
    """The stripped text inside the last ``<answer>...</answer>`` pair, or None.

    The last pair wins because models often restate the format before answering.
    """
    matches = _ANSWER_RE.findall(text)
    return matches[-1].strip() if matches else None


def rg_entry(entry: dict) -> dict:
    """The reasoning-gym entry of ``entry``: itself, or, for a verl-format row (it has a
    ``reward_model``), ``extra_info.rg_entry`` parsed, else ``{"answer": ground_truth}``,
    with ``metadata.source_dataset`` set to the row's ``data_source``.

    Raises:
        RewardInputError: a verl row without ``data_source`` or ``ground_truth``, or an
            ``rg_entry`` that is not a JSON object.
    """
    if not isinstance(entry, dict) or "reward_model" not in entry:
        return entry
    rm, extra = entry.get("reward_model"), entry.get("extra_info") or {}
    source = entry.get("data_source")
    if not isinstance(rm, dict) or "ground_truth" not in rm or not isinstance(source, str):
        raise RewardInputError(
            "a verl-format entry needs data_source (str) and reward_model.ground_truth"
        )
    raw = extra.get("rg_entry") if isinstance(extra, dict) else None
    if raw is not None:
        try:
            out = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except (ValueError, TypeError) as exc:
            raise RewardInputError(f"extra_info.rg_entry is not a JSON object: {exc}") from exc
    else:
        out = {"answer": str(rm["ground_truth"])}
    meta = dict(out.get("metadata") or {})
    meta["source_dataset"] = source
    return {**out, "metadata": meta}


class RuleReward:
    """Reasoning-gym scorers as a :class:`~verl_ppo.reward.base.RewardModel`.

    Args:
        extract_fn: completion text -> answer string or None. Default: the tasks' rule
            for the entry's dataset, :func:`verl_ppo.data.tasks.task_answer` (pass
            :func:`extract_tagged_answer` to accept closed tags only).
        datasets: optional ``{dataset_name: dataset}`` whose ``score_answer`` is used for
            entries of that name (e.g. a dataset built with a non-default config).
        score_fn: optional ``(completion_text, entry) -> float`` that replaces
            extraction and scorer lookup entirely (e.g. a Task's own scorer).

    ``score`` returns float32 ``(B,)`` rewards in [0, 1] (whatever range ``score_fn``
    returns, when given).

    Raises:
        RewardError: from ``score`` if a scorer fails; the message names the sample
            index. :class:`~verl_ppo.reward.base.RewardInputError` (a subclass) when the
            entry is at fault: no ``metadata.source_dataset`` (and no ``score_fn``), a
            dataset unknown to reasoning-gym, or an entry/completion the scorer cannot read.
    """

    name = "rule"

    def __init__(
        self,
        extract_fn: Callable[[str], str | None] | None = None,
        datasets: Mapping[str, Any] | None = None,
        score_fn: Callable[[str, dict], float] | None = None,
    ) -> None:
        self.extract_fn = extract_fn
        self.score_fn = score_fn
        self._scorers: dict[str, Callable[..., float]] = {
            name: ds.score_answer for name, ds in (datasets or {}).items()
        }
        self._lock = threading.Lock()

    def _scorer(self, name: str) -> Callable[..., float]:
        with self._lock:
            fn = self._scorers.get(name)
            if fn is None:
                import reasoning_gym

                try:
                    fn = reasoning_gym.get_score_answer_fn(name)
                except ValueError as exc:
                    raise RewardInputError(
                        f"reasoning-gym has no dataset {name!r} to score with; pass "
                        f"datasets={{{name!r}: ds}} or score_fn=..."
                    ) from exc
                self._scorers[name] = fn
            return fn

    def score_one(self, completion: str, entry: dict) -> float:
        """Reward of one completion for one task entry (a float, [0, 1] for rg scorers)."""
        if self.score_fn is not None:
            return float(self.score_fn(completion, entry))
        entry = rg_entry(entry)
        meta = entry.get("metadata") if isinstance(entry, dict) else None
        name = meta.get("source_dataset") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            raise RewardInputError(
                "entry has no metadata.source_dataset naming its reasoning-gym dataset "
                "(nor, as a verl-format row, data_source and reward_model.ground_truth); "
                "pass score_fn=... to RuleReward for entries of other origin"
            )
        if self.extract_fn is None:
            answer = task_answer(completion, name)
        else:
            answer = self.extract_fn(completion)
        return float(self._scorer(name)(answer=answer, entry=entry))

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """Float32 ``(B,)`` rewards for ``batch.responses`` against ``batch.entries``."""
        out = []
        for i, (text, entry) in enumerate(zip(batch.responses, batch.entries)):
            try:
                out.append(self.score_one(text, entry))
            except RewardError as exc:
                raise type(exc)(f"sample {i}: {exc}") from exc
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
                # the scorer could not read the entry or completion it was given
                raise RewardInputError(f"sample {i}: malformed entry: {exc!r}") from exc
            except Exception as exc:
                raise RewardError(f"sample {i}: scorer raised {exc!r}") from exc
        return torch.tensor(out, dtype=torch.float32)
