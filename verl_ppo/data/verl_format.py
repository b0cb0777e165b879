"""verl's dataset format: read, check and write parquet or JSON-lines prompt files.

One row per prompt, with verl's columns and meaning (verl ``docs/preparation/prepare_data.rst``;
its ``examples/data_preprocess/gsm8k.py`` writes them)::

    data_source   str                      names the source; a reward function may branch on it
    prompt        list of {role, content}  chat messages (the column is ``data.prompt_key``)
    ability       str                      optional, e.g. "math"
    reward_model  {style, ground_truth}    ``ground_truth`` is given to the reward function
    extra_info    {...}                    optional, passed to the reward function as is

Files are read with pyarrow (parquet) or :mod:`json` (``.jsonl``). :func:`read_rows` checks
every row and raises :class:`DataFormatError` naming the file, the row (0-based) and the
column; rows are converted to Python dicts only when drawn (:class:`RowFile`), so a large
parquet costs its read and one pass of checks.

:func:`task_rows` turns a built-in reasoning-gym task's split into such rows (the
``verl-ppo data export`` command), keeping the whole reasoning-gym entry as JSON in
``extra_info.rg_entry`` so the rule reward scores an exported row exactly as the task does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REQUIRED = ("data_source", "reward_model")  # besides the prompt column
OPTIONAL = ("ability", "extra_info")
ROLES = frozenset({"system", "user", "assistant", "tool"})
SUFFIXES = (".parquet", ".jsonl")
_CHECK_CHUNK = 8192  # rows converted to Python at a time by the parquet checks


class DataFormatError(ValueError):
    """A prompt file that does not follow verl's format; names the file, row and column."""


def _where(path: str, row: int | None, column: str | None) -> str:
    parts = [repr(path)]
    if row is not None:
        parts.append(f"row {row}")
    if column is not None:
        parts.append(f"column {column!r}")
    return ", ".join(parts)


def check_messages(value: Any, path: str, row: int, column: str) -> None:
    """``value`` is a non-empty list of ``{"role": str, "content": str}`` chat messages.

    Raises:
        DataFormatError: naming ``path``, ``row`` and ``column`` and what was found.
    """
    at = _where(path, row, column)
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise DataFormatError(
            f"{at}: the prompt must be a list of chat messages [{{'role': ..., 'content': "
            f"...}}], got {type(value).__name__} {str(value)[:60]!r}"
        )
    if not value:
        raise DataFormatError(f"{at}: the prompt is an empty list of messages")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataFormatError(
                f"{at}: message {k} must be a dict with a string 'content', got {str(m)[:80]!r}"
            )
        if m.get("role") not in ROLES:
            raise DataFormatError(
                f"{at}: message {k} has role {m.get('role')!r}; use one of {sorted(ROLES)}"
            )


def check_row(row: Any, path: str, index: int, prompt_key: str) -> None:
    """One row against the format of the module docstring.

    Raises:
        DataFormatError: a missing column, a wrong type, or a malformed prompt (file, row,
            column named).
    """
    if not isinstance(row, dict):
        raise DataFormatError(f"{_where(path, index, None)}: a row must be a JSON object")
    for col in (*REQUIRED, prompt_key):
        if col not in row:
            raise DataFormatError(
                f"{_where(path, index, col)}: missing column (have {sorted(row)}; verl's "
                f"format needs {[*REQUIRED, prompt_key]}; data.prompt_key names the prompt's)"
            )
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        raise DataFormatError(
            f"{_where(path, index, 'data_source')}: must be a non-empty string, got "
            f"{type(row['data_source']).__name__}"
        )
    check_messages(row[prompt_key], path, index, prompt_key)
    rm = row["reward_model"]
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataFormatError(
            f"{_where(path, index, 'reward_model')}: must be a dict with a 'ground_truth' "
            f"(and a 'style'), got {str(rm)[:80]!r}"
        )
    if row.get("ability") is not None and not isinstance(row["ability"], str):
        raise DataFormatError(f"{_where(path, index, 'ability')}: must be a string")
    if row.get("extra_info") is not None and not isinstance(row["extra_info"], dict):
        raise DataFormatError(f"{_where(path, index, 'extra_info')}: must be a dict or null")


class RowFile:
    """The rows of one checked file; ``self[i]`` is row ``i`` as a dict (converted on access).

    Attributes:
        path: the file as given.
        prompt_key: the column holding the chat messages.
    """

    def __init__(self, path: str, prompt_key: str, table: Any = None, rows: list | None = None):
        self.path, self.prompt_key = path, prompt_key
        self._table, self._rows = table, rows

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else self._table.num_rows

    def __getitem__(self, i: int) -> dict:
        if self._rows is not None:
            return self._rows[i]
        return self._table.slice(i, 1).to_pylist()[0]

    def column(self, name: str) -> list:
        """Every row's value of column ``name`` (None where absent)."""
        if self._rows is not None:
            return [r.get(name) for r in self._rows]
        if name not in self._table.column_names:
            return [None] * self._table.num_rows
        return self._table.column(name).to_pylist()


def _read_parquet(path: str, prompt_key: str) -> RowFile:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise DataFormatError(f"{path!r}: not a readable parquet file ({exc})") from None
    missing = [c for c in (*REQUIRED, prompt_key) if c not in table.column_names]
    if missing:
        raise DataFormatError(
            f"{_where(path, None, missing[0])}: missing column (the file has "
            f"{table.column_names}; verl's format needs {[*REQUIRED, prompt_key]}; "
            "data.prompt_key names the prompt's)"
        )
    cols = [c for c in (*REQUIRED, prompt_key, *OPTIONAL) if c in table.column_names]
    for start in range(0, table.num_rows, _CHECK_CHUNK):
        chunk = table.select(cols).slice(start, _CHECK_CHUNK).to_pylist()
        for k, row in enumerate(chunk):
            check_row(row, path, start + k, prompt_key)
    return RowFile(path, prompt_key, table=table)


def _read_jsonl(path: str, prompt_key: str) -> RowFile:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(
                    f"{path!r}, line {line_no + 1}: not JSON ({exc.msg})"
                ) from None
            check_row(row, path, len(rows), prompt_key)
            rows.append(row)
    return RowFile(path, prompt_key, rows=rows)


def read_rows(path: str | Path, prompt_key: str = "prompt") -> RowFile:
    """Read and check one verl-format file (``.parquet`` or ``.jsonl``).

    Raises:
        DataFormatError: a missing or empty file, an unknown suffix, or any row that breaks
            the format (the message names the file, row and column).
    """
    path = str(path)
    if not Path(path).is_file():
        raise DataFormatError(f"{path!r}: no such file")
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise DataFormatError(f"{path!r}: unknown format {suffix!r}; use {list(SUFFIXES)}")
    rows = (_read_parquet if suffix == ".parquet" else _read_jsonl)(path, prompt_key)
    if len(rows) == 0:
        raise DataFormatError(f"{path!r}: the file has no rows")
    return rows


def write_rows(rows: Sequence[dict], path: str | Path) -> Path:
    """Write verl-format ``rows`` to ``path`` (``.parquet`` with pyarrow, or ``.jsonl``).

    Raises:
        DataFormatError: an unknown suffix, no rows, or a row that breaks the format.
    """
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise DataFormatError(f"{str(path)!r}: unknown format; use {list(SUFFIXES)}")
    if not rows:
        raise DataFormatError(f"{str(path)!r}: nothing to write (no rows)")
    for i, row in enumerate(rows):
        check_row(row, str(path), i, "prompt")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    else:
        with open(path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return path


def task_row(task_name: str, entry: dict, split: str, index: int) -> dict:
    """The verl-format row of one reasoning-gym ``entry`` of task ``task_name``: the chat
    message the built-in task renders (:func:`verl_ppo.data.tasks.user_content`), the
    reference answer as ``ground_truth`` and the whole entry as JSON in
    ``extra_info.rg_entry``."""
    from verl_ppo.data.tasks import NUMERIC_TASKS, user_content

    return {
        "data_source": task_name,
        "prompt": [{"role": "user", "content": user_content(entry["question"])}],
        "ability": "math" if task_name in NUMERIC_TASKS else "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "question": entry["question"],
            # metadata values JSON lacks (gsm_symbolic's Fractions) as text: scorers read
            # the question and answer, not those
            "rg_entry": json.dumps(entry, default=str),
        },
    }


def task_rows(task: Any, split: str, n: int) -> Iterator[dict]:
    """The first ``n`` rows of ``split`` ("train" or "eval") of a
    :class:`~verl_ppo.data.tasks.Task`, in the order the trainer draws them (train cycles
    over its kept draws as the trainer does)."""
    for i in range(n):
        entry = task.train[i] if split == "train" else task.eval[i % len(task.eval)]
        yield task_row(task.name, entry, split, i)
