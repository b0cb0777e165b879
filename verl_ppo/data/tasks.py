"""reasoning-gym tasks as prompt sources with their own scorers (the rule reward).

Each task wraps a seeded reasoning-gym dataset. Prompts are rendered with the model's
chat template and ask for the final answer inside ``<answer>...</answer>``; the scorer is
reasoning-gym's own ``score_answer`` applied to the extracted answer.

Train and held-out prompts are disjoint by construction: the task's question space is split
by a stable hash of each question's key (:func:`split_key`: the arithmetic expression where
reasoning-gym gives one, else the question text). A question whose hash falls in the first
``eval_fraction`` of the hash range belongs to the held-out part and is never a train
prompt, whatever the seeds. A different seed for the eval generator (the former split) does
not separate them: 2-term 1-digit sums have 121 distinct questions, and 11-13 of 48
seed-drawn eval prompts were among the first 24 train prompts of each seed.

Seeds: reasoning-gym draws item ``i`` of a dataset seeded ``s`` with ``Random(s + i)``
(``reasoning_gym/arithmetic/basic_arithmetic.py``, ``__getitem__``), so datasets seeded
``s`` and ``s + 1`` are the same stream shifted by one item. The trainer's seed is therefore
never passed as it is: :func:`stream_seed` hashes it into a 63-bit generator seed, and the
train streams of different seeds share no item (the former ``seed`` itself made seeds 0, 1
and 2 train on the same first 48 prompts in the same order). The held-out prompts are the
same for every seed (one fixed eval stream, like a validation file), so the eval rewards of
different seeds are measured on the same questions.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
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


# Share of the question space held out for evaluation (by hash of the question key).
EVAL_FRACTION = 0.5
# Draws of the eval generator per requested eval prompt before a task is declared too small
# (with a floor): 2,048 draws from a 121-question space miss a given question with
# probability (120/121)^2048 ~ 5e-8.
_EVAL_DRAWS_PER_PROMPT = 64
_EVAL_DRAWS_MIN = 2048


# The eval stream's seed, the same for every trainer seed (see the module docstring).
_EVAL_STREAM = "eval"


def stream_seed(seed: int, stream: str = "train") -> int:
    """The reasoning-gym generator seed of one of a task's prompt streams.

    The first 8 bytes of the SHA-256 of ``"<stream>:<seed>"``, shifted to 63 bits: streams of
    different seeds start at unrelated points of reasoning-gym's ``Random(seed + i)`` item
    seeds, so two train streams of 10,000 items overlap with probability about 2e4 / 2**63.
    Stable across processes and Python versions.
    """
    digest = hashlib.sha256(f"{stream}:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class TaskError(ValueError):
    """Unknown task or bad task arguments; the message lists the valid choices."""


def split_key(entry: dict) -> str:
    """The text that decides an entry's split: reasoning-gym's ``metadata["expression"]``
    when present (so one sum asked in two phrasings lands in one split), else the question."""
    meta = entry.get("metadata") or {}
    return str(meta.get("expression") or entry["question"])


def is_held_out(entry: dict, eval_fraction: float = EVAL_FRACTION) -> bool:
    """True when ``entry``'s question is in the held-out part of its task's question space.

    The first 8 bytes of the SHA-256 of :func:`split_key`, read as a fraction of 2**64, are
    compared with ``eval_fraction``: stable across processes, Python versions and seeds.
    """
    digest = hashlib.sha256(split_key(entry).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


class _TrainSplit:
    """The train draws of a reasoning-gym dataset with held-out questions skipped.

    ``self[i]`` is the i-th kept entry in generator order; past the last kept entry of the
    generator's ``size`` draws it cycles. Entries are generated on demand (countdown takes
    ~20 ms each), so only what is asked for is generated.
    """

    def __init__(self, source: Any, eval_fraction: float) -> None:
        self._source = source
        self._fraction = eval_fraction
        self._kept: list[dict] = []
        self._cursor = 0

    def _scan_to(self, i: int) -> None:
        while len(self._kept) <= i and self._cursor < len(self._source):
            entry = self._source[self._cursor]
            self._cursor += 1
            if not is_held_out(entry, self._fraction):
                self._kept.append(entry)

    def __getitem__(self, i: int) -> dict:
        self._scan_to(i)
        if not self._kept:
            raise TaskError(
                f"all {len(self._source)} train draws are held-out questions; raise "
                "train_size or widen the task (data.task_kwargs)"
            )
        return self._kept[i] if i < len(self._kept) else self._kept[i % len(self._kept)]

    def __iter__(self) -> Iterator[dict]:
        """The kept entries of all ``size`` draws, in order."""
        self._scan_to(len(self._source))
        return iter(list(self._kept))


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


def user_content(question: str) -> str:
    """The user turn a task question becomes: the question, then :data:`ANSWER_FORMAT`."""
    # The instruction goes into the user turn (measured on SmolLM2-135M, 16 held-out
    # sums, T=0.7: 0.125 reward vs 0.0625 with the same text as a system prompt).
    return f"{question}\n{ANSWER_FORMAT}"


def render_messages(tokenizer: Any, messages: list[dict]) -> str:
    """Chat ``messages`` as the policy sees them: the tokenizer's chat template with the
    generation prompt added; without a template, ``"Question: <contents>\nAnswer: "``."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "Question: " + "\n".join(m["content"] for m in messages) + "\nAnswer: "


@dataclass
class Sample:
    """One prompt: the chat-rendered text, the raw question and the reasoning-gym entry."""

    prompt: str
    question: str
    entry: dict


class Task:
    """A seeded reasoning-gym dataset with a train and a held-out split, disjoint by hash.

    Args:
        name: one of ``TASKS``.
        train_size: draws of the train generator (cycled); draws whose question is held out
            are skipped, so about ``(1 - eval_fraction) * train_size`` train prompts remain.
        eval_size: number of distinct held-out prompts.
        seed: the job's seed; the train generator is seeded ``stream_seed(seed)``. The eval
            generator's seed is the same for every ``seed`` (``stream_seed(0, "eval")``): the
            held-out prompts do not depend on it (membership is decided by
            :func:`is_held_out`, the order by that fixed stream).
        overrides: keyword arguments for the reasoning-gym dataset config.
        eval_fraction: share of the question space held out (by hash), in (0, 1).

    Raises:
        TaskError: unknown task name, arguments reasoning-gym rejects, or a question space
            whose held-out part has fewer than ``eval_size`` distinct questions (the message
            names ``data.eval_size`` and the fix).
    """

    def __init__(
        self,
        name: str,
        train_size: int = 10_000,
        eval_size: int = 64,
        seed: int = 0,
        overrides: dict[str, Any] | None = None,
        eval_fraction: float = EVAL_FRACTION,
    ) -> None:
        if name not in TASKS:
            raise TaskError(f"unknown task {name!r}; choose one of {sorted(TASKS)} (data.task)")
        if not 0.0 < eval_fraction < 1.0:
            raise TaskError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        import reasoning_gym

        kwargs = {**TASKS[name], **(overrides or {})}
        self.name = name
        self.eval_fraction = eval_fraction
        draws = max(_EVAL_DRAWS_MIN, _EVAL_DRAWS_PER_PROMPT * eval_size)
        try:
            source = reasoning_gym.create_dataset(
                name, size=train_size, seed=stream_seed(seed), **kwargs
            )
            eval_source = reasoning_gym.create_dataset(
                name, size=draws, seed=stream_seed(0, _EVAL_STREAM), **kwargs
            )
        except (TypeError, ValueError, AssertionError) as exc:
            raise TaskError(f"reasoning-gym rejected data.task_kwargs for {name!r}: {exc}") from exc
        self._scorer = source
        self.train = _TrainSplit(source, eval_fraction)
        self.eval = self._draw_eval(eval_source, eval_size, kwargs)

    def _draw_eval(self, source: Any, eval_size: int, kwargs: dict[str, Any]) -> list[dict]:
        """The first ``eval_size`` distinct held-out questions of ``source``, or TaskError."""
        found: dict[str, dict] = {}
        for i in range(len(source)):
            if len(found) >= eval_size:
                break
            entry = source[i]
            if is_held_out(entry, self.eval_fraction):
                found.setdefault(split_key(entry), entry)
        if len(found) < eval_size:
            raise TaskError(
                f"data.eval_size={eval_size} asks for {eval_size} distinct held-out questions, "
                f"but task {self.name!r} with {kwargs} holds out only {len(found)} (a "
                f"{self.eval_fraction:g} share of its question space, found in {len(source)} "
                f"draws); set data.eval_size <= {len(found)} or widen the task "
                "(data.task_kwargs, e.g. max_digits)"
            )
        return list(found.values())

    def render(self, tokenizer: Any, question: str) -> str:
        """Render one question with the tokenizer's chat template (generation prompt added)."""
        return render_messages(tokenizer, [{"role": "user", "content": user_content(question)}])

    def sample(self, tokenizer: Any, split: str, index: int) -> Sample:
        """Return the ``index``-th sample of ``split`` ("train" cycles, "eval" is fixed)."""
        entry = self.train[index] if split == "train" else self.eval[index % len(self.eval)]
        return Sample(self.render(tokenizer, entry["question"]), entry["question"], entry)

    def score(self, completion: str, entry: dict) -> float:
        """reasoning-gym's score in [0, 1] of the answer extracted from ``completion``."""
        return float(
            self._scorer.score_answer(answer=task_answer(completion, self.name), entry=entry)
        )
