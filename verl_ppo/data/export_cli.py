"""``verl-ppo data export``: a built-in reasoning-gym task as a verl-format file.

    verl-ppo data export --task basic_arithmetic --n 10000 --out data/train.parquet
    verl-ppo data export --config configs/default.yaml --split eval --n 48 --out data/val.parquet

The rows are the task's own prompts in the order the trainer draws them for the same seed
and task options (``--config`` takes ``data.task``, ``data.task_kwargs`` and ``seed`` from a
config file; ``--task``, ``--task-kwargs`` and ``--seed`` override it), so training on the
exported train file and evaluating on the exported eval file reproduces the built-in task's
batches (:func:`verl_ppo.data.verl_format.task_rows`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verl-ppo data export",
        description="Write a built-in reasoning-gym task as a verl-format parquet/JSON-lines file.",
    )
    p.add_argument("--task", default=None, help="reasoning-gym task (default: the config's)")
    p.add_argument("--n", type=int, required=True, help="rows to write")
    p.add_argument("--out", required=True, help="FILE.parquet or FILE.jsonl")
    p.add_argument("--split", choices=("train", "eval"), default="train", help="default train")
    p.add_argument("--seed", type=int, default=None, help="task seed (default: the config's)")
    p.add_argument("--task-kwargs", default=None, help="JSON, e.g. '{\"max_digits\": 1}'")
    p.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="train generator draws (default: the config's data.train_size); rows past the "
        "kept draws cycle, as the trainer does",
    )
    p.add_argument("--config", default=None, help="take task, task_kwargs and seed from it")
    return p


def export_main(argv: list[str]) -> int:
    """``verl-ppo data export ...``; returns the exit code (2 on bad arguments)."""
    from verl_ppo.config import load_config
    from verl_ppo.data.tasks import Task, TaskError
    from verl_ppo.data.verl_format import DataFormatError, task_rows, write_rows
    from verl_ppo.errors import ConfigError

    a = _parser().parse_args(argv)
    try:
        cfg = load_config(a.config)
        task = a.task or cfg.data.task
        if task is None:
            raise ConfigError("no task: pass --task NAME (the config trains on files)")
        kwargs = json.loads(a.task_kwargs) if a.task_kwargs else cfg.data.task_kwargs
        seed = cfg.seed if a.seed is None else a.seed
        if a.n <= 0:
            raise ConfigError(f"--n must be > 0, got {a.n}")
        t0 = time.perf_counter()
        train_size = a.train_size or cfg.data.train_size
        source = Task(task, train_size=train_size, seed=seed,
                      eval_size=a.n if a.split == "eval" else 1, overrides=kwargs)  # fmt: skip
        out = write_rows(list(task_rows(source, a.split, a.n)), a.out)
    except (ConfigError, TaskError, DataFormatError, json.JSONDecodeError) as exc:
        print(f"verl-ppo data export: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {a.n} {a.split} rows of {task} (seed {seed}, task_kwargs {kwargs}) to {out} "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: list[str]) -> int:
    """``verl-ppo data <command>``: only ``export`` for now."""
    if not argv or argv[0] != "export":
        print("usage: verl-ppo data export --task NAME --n N --out FILE", file=sys.stderr)
        return 2
    return export_main(argv[1:])
