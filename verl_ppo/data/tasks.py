"""reasoning-gym tasks as prompt sources with their own scorers (the rule reward).

Each task wraps a seeded reasoning-gym dataset. Prompts are rendered with the model's
chat template and ask for the final answer inside ``<answer>...</answer>``; the scorer is
reasoning-gym's own ``score_answer`` applied to the extracted answer. The evaluation split
uses a different seed, so train and held-out prompts never coincide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

TASKS: dict[str, dict[str, Any]] = {
    # 2-term, 2-digit sums: SmolLM2-135M starts near 0.1 reward, so there is signal.
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 2,
        "max_digits": 2,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "countdown": {},
    "gsm_symbolic": {},
}

ANSWER_FORMAT = "Give the final answer inside <answer></answer>, for example <answer>42</answer>."

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OPEN_RE = re.compile(r"<answer>(.*)$", re.DOTALL | re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
# Tasks whose answers are numbers: without a tag, the last number of the response counts
# (a 135M model rarely uses the tag at first; this keeps the reward informative).
NUMERIC_TASKS = frozenset({"basic_arithmetic", "chain_sum", "gsm_symbolic"})


class TaskError(ValueError):
    """Unknown task or bad task arguments; the message lists the valid choices."""


def extract_answer(text: str, numeric: bool = False) -> str | None:
    """Return the content of the last ``<answer>...</answer>`` in ``text`` (stripped).

    An opening tag cut off by the length limit or by EOS yields the text after it. Without
    any tag: for ``numeric`` tasks the last number in the text, otherwise None.
    """
    found = _ANSWER_RE.findall(text)
    if found:
        return found[-1].strip()
    m = _OPEN_RE.search(text)
    if m:
        return m.group(1).strip() or None
    if numeric:
        nums = _NUMBER_RE.findall(text)
        return nums[-1] if nums else None
    return None


def task_answer(completion: str, dataset: str) -> str | None:
    """The answer the scorer of reasoning-gym dataset ``dataset`` is given for ``completion``:
    :func:`extract_answer`, numeric for :data:`NUMERIC_TASKS`. The in-process rule reward
    (:meth:`Task.score`) and the reward server's ``rule`` model
    (:class:`~verl_ppo.reward.rule.RuleReward`) both extract with it, so they agree."""
    return extract_answer(completion, numeric=dataset in NUMERIC_TASKS)


@dataclass
class Sample:
    """One prompt: the chat-rendered text, the raw question and the reasoning-gym entry."""

    prompt: str
    question: str
    entry: dict


class Task:
    """A seeded reasoning-gym dataset with a train and a held-out split.

    Args:
        name: one of ``TASKS``.
        train_size: number of distinct train prompts (cycled).
        eval_size: number of held-out prompts.
        seed: train split seed; the eval split uses ``seed + 1_000_003``.
        overrides: keyword arguments for the reasoning-gym dataset config.

    Raises:
        TaskError: unknown task name or arguments reasoning-gym rejects.
    """

    def __init__(
        self,
        name: str,
        train_size: int = 10_000,
        eval_size: int = 64,
        seed: int = 0,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        if name not in TASKS:
            raise TaskError(f"unknown task {name!r}; choose one of {sorted(TASKS)} (data.task)")
        import reasoning_gym

        kwargs = {**TASKS[name], **(overrides or {})}
        self.name = name
        try:
            self.train = reasoning_gym.create_dataset(name, size=train_size, seed=seed, **kwargs)
            self.eval = reasoning_gym.create_dataset(
                name, size=eval_size, seed=seed + 1_000_003, **kwargs
            )
        except (TypeError, ValueError, AssertionError) as exc:
            raise TaskError(f"reasoning-gym rejected data.task_kwargs for {name!r}: {exc}") from exc

    def render(self, tokenizer: Any, question: str) -> str:
        """Render one question with the tokenizer's chat template (generation prompt added)."""
        # The instruction goes into the user turn (measured on SmolLM2-135M, 16 held-out
        # sums, T=0.7: 0.125 reward vs 0.0625 with the same text as a system prompt).
        content = f"{question}\n{ANSWER_FORMAT}"
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": content}]
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        return f"Question: {content}\nAnswer: "

    def sample(self, tokenizer: Any, split: str, index: int) -> Sample:
        """Return the ``index``-th sample of ``split`` ("train" cycles, "eval" is fixed)."""
        ds = self.train if split == "train" else self.eval
        entry = ds[index % len(ds)]
        return Sample(self.render(tokenizer, entry["question"]), entry["question"], entry)

    def score(self, completion: str, entry: dict) -> float:
        """reasoning-gym's score in [0, 1] of the answer extracted from ``completion``."""
        return float(
            self.train.score_answer(answer=task_answer(completion, self.name), entry=entry)
        )
