"""verl-format files as the trainer's prompt source (``data.train_files`` / ``data.val_files``).

:class:`FileSource` offers what the trainer asks of a built-in :class:`~verl_ppo.data.tasks.Task`:
``sample(tokenizer, split, index)`` (the rendered prompt, its text and its entry),
``eval`` (the eval rows) and ``score`` (the rule reward). The entry given to the reward is
the verl row itself (``data_source``, ``prompt``, ``ability``, ``reward_model``,
``extra_info``).

Train rows are read in file order, the files one after another, and cycled; the eval rows
are the first ``data.eval_size`` rows of the val files. A row whose chat-rendered prompt is
longer than ``data.max_prompt_length`` tokens is skipped with ``data.filter_overlong_prompts``
(counted, and logged) or refused (:class:`PromptTooLongError`, naming the file and row).
Lengths are measured on demand, for the rows the job draws, in the order they are drawn
(tokenizing all 100k rows of a file took 16 s on the 2-core CPU this was built on; a job
draws ``train.num_steps x prompts per step`` of them): :meth:`FileSource.prepare` measures
exactly those, so preflight refuses an overlong row before any rank starts and every rank
logs the same count.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from verl_ppo.data.tasks import Sample, render_messages
from verl_ppo.data.verl_format import DataFormatError, RowFile, read_rows

_LOGGED_ROWS = 3  # overlong rows named one by one in the log; later ones only counted


class PromptTooLongError(DataFormatError):
    """A row's prompt is over ``data.max_prompt_length`` and filtering is off."""


class _KeptRows:
    """Rows of several files in order, overlong ones skipped or refused, measured on demand.

    ``self[i]`` is the i-th kept row (cycling past the last one); :attr:`filtered` lists the
    ``(path, row, tokens)`` of the rows skipped so far.
    """

    def __init__(
        self, files: Sequence[RowFile], source: FileSource, split: str, cycle: bool
    ) -> None:
        self._refs = [(f, r) for f in files for r in range(len(f))]
        self._source, self._split, self._cycle = source, split, cycle
        self._kept: list[tuple[dict, str]] = []  # (row, rendered prompt)
        self._cursor = 0
        self.filtered: list[tuple[str, int, int]] = []

    @property
    def rows(self) -> int:
        """Rows in the files (kept or not)."""
        return len(self._refs)

    def _scan_to(self, i: int) -> None:
        while len(self._kept) <= i and self._cursor < len(self._refs):
            f, r = self._refs[self._cursor]
            self._cursor += 1
            row = f[r]
            text = self._source.render(row[f.prompt_key])
            n = self._source.length(text)
            if n <= self._source.max_prompt_length:
                self._kept.append((row, text))
            elif self._source.filter_overlong:
                self.filtered.append((f.path, r, n))
                self._source.note_filtered(self._split, f.path, r, n, len(self.filtered))
            else:
                raise PromptTooLongError(
                    f"{f.path!r}, row {r}, column {f.prompt_key!r}: the prompt has {n} tokens "
                    f"after the chat template > data.max_prompt_length="
                    f"{self._source.max_prompt_length}: raise data.max_prompt_length, or set "
                    "data.filter_overlong_prompts=true to skip such rows"
                )

    def get(self, i: int) -> tuple[dict, str]:
        """The i-th kept ``(row, rendered prompt)``.

        Raises:
            DataFormatError: every row is overlong (and filtered), or ``i`` is past the
                kept rows of a split that does not cycle.
        """
        self._scan_to(i)
        if i < len(self._kept):
            return self._kept[i]
        if not self._kept:
            raise DataFormatError(
                f"all {self.rows} {self._split} rows are over data.max_prompt_length="
                f"{self._source.max_prompt_length} tokens (filtered): raise it"
            )
        if not self._cycle:
            raise DataFormatError(
                f"the {self._split} files keep {len(self._kept)} rows, fewer than the "
                f"{i + 1} asked for: set data.eval_size <= {len(self._kept)}, or add rows"
            )
        return self._kept[i % len(self._kept)]

    def __len__(self) -> int:
        """Rows kept so far (all of them once the files have been scanned)."""
        return len(self._kept)


class FileSource:
    """Prompts from verl-format files (see the module docstring).

    Args:
        train_files: parquet / JSON-lines paths, read in order.
        val_files: the eval files (None or [] = no eval rows).
        tokenizer: the policy's tokenizer (chat template and prompt lengths).
        prompt_key: the column of chat messages (``data.prompt_key``).
        max_prompt_length: the prompt limit in tokens (``data.max_prompt_length``).
        filter_overlong: skip overlong rows (``data.filter_overlong_prompts``), else refuse.
        eval_size: eval rows used (the first kept rows of the val files).
        log: where filtered rows are reported (None = not reported: ranks other than 0).

    Raises:
        DataFormatError: a file that breaks verl's format (file, row and column named).
    """

    name = "files"

    def __init__(
        self,
        train_files: Sequence[str],
        val_files: Sequence[str] | None,
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 160,
        filter_overlong: bool = False,
        eval_size: int = 0,
        log: logging.Logger | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong = filter_overlong
        self.eval_size = eval_size
        self.log = log
        self.train_files = [read_rows(p, prompt_key) for p in train_files]
        self.val_files = [read_rows(p, prompt_key) for p in (val_files or [])]
        self._train = _KeptRows(self.train_files, self, "train", cycle=True)
        self._val = _KeptRows(self.val_files, self, "val", cycle=False)

    # ------------------------------------------------------------ measuring
    def render(self, messages: list[dict]) -> str:
        """The prompt text of chat ``messages`` (the tokenizer's chat template)."""
        return render_messages(self.tokenizer, messages)

    def length(self, text: str) -> int:
        """Tokens of a rendered prompt, as the trainer encodes it (no special tokens added)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def note_filtered(self, split: str, path: str, row: int, tokens: int, count: int) -> None:
        """Log a skipped overlong row (the first few by name, then every 100th as a count)."""
        if self.log is not None and (count <= _LOGGED_ROWS or count % 100 == 0):
            self.log.warning(
                "data: %s row %d of %r has %d tokens > data.max_prompt_length=%d: filtered "
                "(%d %s rows filtered so far)",
                split, row, path, tokens, self.max_prompt_length, count, split,
            )  # fmt: skip

    def prepare(self, train_rows: int) -> str:
        """Measure the first ``train_rows`` train rows and the ``eval_size`` eval rows (what
        a job draws), so refusals happen now; returns a one-line summary for the log.

        Raises:
            PromptTooLongError: an overlong row with filtering off.
            DataFormatError: too few eval rows, or every row overlong.
        """
        if train_rows > 0:
            self._train.get(train_rows - 1)
        if self.eval_size > 0:
            self._val.get(self.eval_size - 1)
        n_train = sum(len(f) for f in self.train_files)
        n_val = sum(len(f) for f in self.val_files)
        return (
            f"data: {n_train} train rows from {[f.path for f in self.train_files]}, "
            f"{n_val} val rows from {[f.path for f in self.val_files]}; this job draws "
            f"{train_rows} train and {self.eval_size} eval prompts; rows over "
            f"data.max_prompt_length={self.max_prompt_length} filtered: "
            f"{len(self._train.filtered)} train, {len(self._val.filtered)} val"
        )

    @property
    def filtered(self) -> int:
        """Overlong rows skipped so far (train and val)."""
        return len(self._train.filtered) + len(self._val.filtered)

    # ------------------------------------------------- the trainer's interface
    @property
    def eval(self) -> list[dict]:
        """The eval rows: the first ``eval_size`` kept rows of the val files."""
        return [self._val.get(i)[0] for i in range(self.eval_size)]

    def sample(self, tokenizer: Any, split: str, index: int) -> Sample:
        """The ``index``-th prompt of ``split`` ("train" cycles, "eval" is the val rows);
        ``tokenizer`` must be the one given at construction (prompts are measured with it)."""
        if tokenizer is not self.tokenizer:
            raise ValueError("FileSource.sample: use the tokenizer the source was built with")
        if split == "train":
            row, text = self._train.get(index)
        else:
            row, text = self._val.get(index % max(self.eval_size, 1))
        return Sample(text, question_of(row, self.prompt_key), entry_of(row, self.prompt_key))

    def score(self, completion: str, entry: dict) -> float:
        """The rule reward of an exported reasoning-gym row
        (:meth:`verl_ppo.reward.rule.RuleReward.score_one`)."""
        from verl_ppo.reward.rule import RuleReward

        return RuleReward().score_one(completion, entry)


def question_of(row: dict, prompt_key: str) -> str:
    """What the printed samples show: ``extra_info.question`` when the row has one (verl's
    preprocessing scripts write it), else the last user message's content."""
    q = (row.get("extra_info") or {}).get("question")
    if isinstance(q, str):
        return q
    messages = row[prompt_key]
    users = [m["content"] for m in messages if m.get("role") == "user"]
    return users[-1] if users else messages[-1]["content"]


def entry_of(row: dict, prompt_key: str) -> dict:
    """The reward's entry of a verl row: verl's five fields (``extra_info`` ``{}`` when
    absent), the prompt under ``"prompt"`` whatever ``data.prompt_key`` is."""
    return {
        "data_source": row["data_source"],
        "prompt": row[prompt_key],
        "ability": row.get("ability") or "",
        "reward_model": row["reward_model"],
        "extra_info": row.get("extra_info") or {},
    }


def train_rows_drawn(cfg: Any) -> int:
    """Train prompts a job of ``cfg`` draws: ``train.num_steps`` x prompts per step."""
    return cfg.train.num_steps * (cfg.train.rollout_batch_size // cfg.algorithm.n_samples)


def build_prompt_source(cfg: Any, tokenizer: Any, log: logging.Logger | None = None) -> Any:
    """The prompt source of ``cfg.data``: a :class:`FileSource` with ``data.train_files``,
    else the built-in :class:`~verl_ppo.data.tasks.Task` of ``data.task``.

    Raises:
        DataFormatError: a file breaks verl's format, or an overlong row is refused.
        verl_ppo.data.tasks.TaskError: bad task arguments.
    """
    d = cfg.data
    if d.train_files:
        src = FileSource(
            d.train_files,
            d.val_files,
            tokenizer,
            prompt_key=d.prompt_key,
            max_prompt_length=d.max_prompt_length,
            filter_overlong=d.filter_overlong_prompts,
            eval_size=d.eval_size,
            log=log,
        )
        line = src.prepare(train_rows_drawn(cfg))
        if log is not None:
            log.info("%s", line)
        return src
    from verl_ppo.data.tasks import Task

    return Task(
        d.task,
        train_size=d.train_size,
        eval_size=d.eval_size,
        seed=cfg.seed,
        overrides=d.task_kwargs,
    )
