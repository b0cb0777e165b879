"""A custom reward function in verl's form, for ``reward.custom_reward_function``.

It re-implements, without importing the trainer, the rule the built-in ``basic_arithmetic``
and ``chain_sum`` tasks score with (``verl_ppo/data/tasks.py``: the answer is the text inside
the last ``<answer>...</answer>``, or after an opening tag the length limit cut off, or else
the last number; reasoning-gym's ``ProceduralDataset.score_answer`` then gives 1.0 for the
exact answer, ``len(truth) / len(answer)`` when the answer contains it, else 0.0). Trained on
files exported with ``verl-ppo data export``, it gives the rewards the built-in task gives
(``tests/verl_ppo/test_user_data.py`` checks it; ``benchmarks/user_data.py`` runs the
default job both ways).

Use::

    verl-ppo train --config configs/default.yaml data.task=null data.task_kwargs=null \\
        data.train_files=data/train.parquet data.val_files=data/val.parquet \\
        reward.custom_reward_function.path=examples/arithmetic_reward.py
"""

from __future__ import annotations

import re

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPEN = re.compile(r"<answer>(.*)$", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract(solution_str: str) -> str | None:
    """The answer in a response: the last closed tag, an open tag's tail, or the last number."""
    found = _TAGGED.findall(solution_str)
    if found:
        return found[-1].strip()
    m = _OPEN.search(solution_str)
    if m:
        return m.group(1).strip() or None
    numbers = _NUMBER.findall(solution_str)
    return numbers[-1] if numbers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the exact answer, partial credit when the answer contains it, else 0.0.

    Returns a dict: ``score`` is the reward; ``tagged`` (1.0 when the response closed an
    ``<answer>`` tag) is logged by the trainer as ``reward/extra/tagged``.
    """
    answer = extract(solution_str)
    truth = str(ground_truth)
    score = 0.0
    if answer:
        if answer == truth:
            score = 1.0
        elif truth in answer:
            score = len(truth) / len(answer)
    tagged = 1.0 if _TAGGED.search(solution_str) else 0.0
    return {"score": score, "tagged": tagged}
