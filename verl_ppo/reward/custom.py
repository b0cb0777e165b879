"""A user's reward function with verl's signature as a :class:`~verl_ppo.reward.base.RewardModel`.

``reward.custom_reward_function.path`` / ``.name`` name a Python file and a function
``compute_score(data_source, solution_str, ground_truth, extra_info)`` (verl's signature:
verl ``verl/utils/reward_score/__init__.py`` ``default_compute_score``; verl calls it with
these keyword arguments, and so do we). It is called once per response, with the row's
``data_source``, the decoded response, ``reward_model.ground_truth`` and ``extra_info``
(:mod:`verl_ppo.data.verl_format`), and returns a float, or a dict with a ``"score"`` whose
other numeric values are logged as ``reward/extra/<key>`` (means over the responses scored
since the last step's line).

With ``reward.num_workers`` > 1 the calls run in a pool of that many processes (the
functions are Python and hold the GIL; the trainer's scoring thread,
:class:`~verl_ppo.reward.async_scorer.AsyncRewardScorer`, waits on them while the next
micro-batch generates). The pool forks its workers when it is built, before the trainer
builds its models and its DeepSpeed threads (``fork`` where the platform has it, else
``spawn``): a scoring function that itself uses torch's OpenMP threads should run with
``num_workers: 1``.

An exception inside the function stops the job with a :class:`~verl_ppo.reward.base.RewardError`
naming the sample, its ``data_source`` and the exception (``on_error: raise``), or scores
0, is counted in ``reward/custom_errors`` and is logged as a warning (``on_error: zero``).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import multiprocessing as mp
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import torch

from verl_ppo.reward.base import RewardBatch, RewardError, RewardInputError

ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_log = logging.getLogger("verl_ppo")


class CustomRewardError(ValueError):
    """The file or function named by ``reward.custom_reward_function`` cannot be used."""


def load_function(path: str | Path, name: str = "compute_score") -> Callable[..., Any]:
    """Import ``path`` as a module and return its function ``name``, checked to accept
    verl's four keyword arguments (:data:`ARGS`).

    Raises:
        CustomRewardError: no such file, the file fails to import (the exception named),
            no callable ``name`` in it, or a signature that cannot take the four arguments.
    """
    p = Path(path)
    key = "reward.custom_reward_function"
    if not p.is_file():
        raise CustomRewardError(f"{key}.path={str(path)!r}: no such file")
    mod_name = f"verl_ppo_custom_reward_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise CustomRewardError(f"{key}.path={str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error while importing the user's file
        raise CustomRewardError(f"{key}.path={str(path)!r} failed to import: {exc!r}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise CustomRewardError(
            f"{key}.name={name!r}: {str(path)!r} defines no function of that name"
        )
    try:
        inspect.signature(fn).bind(**dict.fromkeys(ARGS))
    except TypeError as exc:
        raise CustomRewardError(
            f"{key}.name={name!r} in {str(path)!r} has signature {inspect.signature(fn)}, "
            f"which cannot take verl's arguments ({exc}): define "
            f"def {name}(data_source, solution_str, ground_truth, extra_info=None)"
        ) from None
    except ValueError:  # a builtin without a signature: called as is
        pass
    return fn


def parse_result(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, extra numeric values)`` of what the function returned.

    Raises:
        TypeError: neither a real number nor a dict with a numeric ``"score"``, or a
            non-finite score.
    """
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys {sorted(value)})")
        extra = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if not (hasattr(value, "__float__") and not isinstance(value, str)):
            raise TypeError(f"returned {type(value).__name__} {value!r}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise TypeError(f"returned a non-finite score {score}")
    return score, extra


# ---------------------------------------------------------------- worker side
_WORKER_FN: Callable[..., Any] | None = None


def _init_worker(path: str, name: str) -> None:
    global _WORKER_FN
    _WORKER_FN = load_function(path, name)


def _call(fn: Callable[..., Any] | None, args: tuple) -> tuple[bool, Any]:
    """``(True, (score, extra))`` or ``(False, "ExcType: message")``: an exception of the
    user's function travels back as text (it may not pickle)."""
    try:
        return True, parse_result((fn or _WORKER_FN)(**dict(zip(ARGS, args))))
    except Exception as exc:  # noqa: BLE001 - reported with the sample by the caller
        return False, f"{type(exc).__name__}: {exc}"


def _worker_call(args: tuple) -> tuple[bool, Any]:
    return _call(None, args)


def _worker_ready() -> bool:
    return _WORKER_FN is not None


# --------------------------------------------------------------- trainer side
class CustomReward:
    """verl-signature scoring function as a reward model (see the module docstring).

    Args:
        path, name: the file and the function (``reward.custom_reward_function``).
        num_workers: 1 = call in the scoring thread; > 1 = a process pool of that size.
        on_error: ``"raise"`` or ``"zero"`` (``reward.custom_reward_function.on_error``).

    ``score(batch)`` returns float32 ``(B,)``; ``batch.entries`` are verl rows
    (:func:`verl_ppo.data.file_source.entry_of`).

    Raises:
        CustomRewardError: from the constructor, the function cannot be loaded (see
            :func:`load_function`).
        RewardError: from ``score`` with ``on_error="raise"``, naming the sample; also when
            a worker process died (whatever ``on_error`` says).
        RewardInputError: an entry without verl's fields.
    """

    name = "custom_reward_function"

    def __init__(
        self, path: str, name: str = "compute_score", num_workers: int = 1, on_error: str = "raise"
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
        self.path, self.fn_name = str(path), name
        self.fn = load_function(path, name)
        self.on_error = on_error
        self.num_workers = num_workers
        self._lock = threading.Lock()
        self._errors = 0
        self._extra: dict[str, list[float]] = {}  # key -> [sum, count] since last read
        self._keys: frozenset[str] | None = None  # the extra keys of the first response
        self._pool: ProcessPoolExecutor | None = None
        if num_workers > 1:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            self._pool = ProcessPoolExecutor(
                num_workers,
                mp_context=mp.get_context(method),
                initializer=_init_worker,
                initargs=(self.path, name),
            )
            # start every worker now (before the trainer's threads exist) and prove it loads
            ready = [self._pool.submit(_worker_ready) for _ in range(num_workers)]
            if not all(f.result(timeout=120) for f in ready):
                raise CustomRewardError(f"{self.path!r}: a reward worker failed to load it")

    @staticmethod
    def _args(entry: dict, response: str, i: int) -> tuple:
        rm = entry.get("reward_model") if isinstance(entry, dict) else None
        if not isinstance(rm, dict) or "data_source" not in entry:
            raise RewardInputError(
                f"sample {i}: the custom reward function needs verl-format entries "
                "(data_source, reward_model.ground_truth): train on data.train_files"
            )
        return (entry["data_source"], response, rm.get("ground_truth"), entry.get("extra_info"))

    def _results(self, calls: list[tuple]) -> list[tuple[bool, Any]]:
        if self._pool is None:
            return [_call(self.fn, a) for a in calls]
        try:
            return list(self._pool.map(_worker_call, calls))
        except BrokenProcessPool as exc:
            raise RewardError(
                f"a reward worker process of {self.path!r} died ({exc}); it may have "
                "exited or been killed (memory?): set reward.num_workers=1 to see the error"
            ) from exc

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """Float32 ``(B,)``: the function's score of each response (see the class doc)."""
        calls = [
            self._args(e, r, i) for i, (e, r) in enumerate(zip(batch.entries, batch.responses))
        ]
        out: list[float] = []
        for i, (ok, res) in enumerate(self._results(calls)):
            if ok:
                out.append(res[0])
                self._add_extra(res[1], i)
                continue
            where = f"sample {i} (data_source={calls[i][0]!r}, ground_truth={calls[i][2]!r})"
            if self.on_error == "raise":
                raise RewardError(
                    f"{self.fn_name} of {self.path!r} failed on {where}: {res} (set "
                    "reward.custom_reward_function.on_error=zero to score such responses 0)"
                )
            with self._lock:
                self._errors += 1
                count = self._errors
            _log.warning(
                "%s failed on %s: %s; scored 0 (%d so far)", self.fn_name, where, res, count
            )
            out.append(0.0)
        return torch.tensor(out, dtype=torch.float32)

    def _add_extra(self, extra: dict[str, float], i: int) -> None:
        """Add one response's extra values; the keys must be those of the first response
        (every rank reports the same metric keys: they are averaged over the ranks)."""
        with self._lock:
            if self._keys is None:
                self._keys = frozenset(extra)
            elif frozenset(extra) != self._keys:
                raise RewardError(
                    f"{self.fn_name} of {self.path!r} returned extra keys {sorted(extra)} for "
                    f"sample {i}, but {sorted(self._keys)} before: return the same keys "
                    "(besides 'score') for every response"
                )
            for k, v in extra.items():
                acc = self._extra.setdefault(k, [0.0, 0.0])
                acc[0] += v
                acc[1] += 1

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """``reward/custom_errors`` (responses scored 0 after an exception, total) and
        ``reward/extra/<key>`` (mean of each extra value since the last ``reset=True``; 0 when no
        response was scored since)."""
        with self._lock:
            sums = {k: self._extra.get(k, [0.0, 0.0]) for k in sorted(self._keys or ())}
            out = {f"reward/extra/{k}": s / n if n else 0.0 for k, (s, n) in sums.items()}
            out["reward/custom_errors"] = float(self._errors)
            if reset:
                self._extra = {}
        return out

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:  # the pool's processes end with the trainer's
        if sys is not None and getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
