"""The run folder (``run_dir``): one job at a time, a clear start, a clean stop.

- **Lock**: :class:`RunDirLock` takes an exclusive ``flock`` on ``run_dir/.lock`` and writes
  the holder's pid into it. A second job on the same folder fails at once, naming that pid.
  The kernel drops the lock when the holder dies (even by SIGKILL), so a stale file never
  blocks a new job. Taken by the process that launches the ranks (``verl-ppo train``, the
  Python API) or, under torchrun, by global rank 0.
- **Fresh start** (:func:`prepare_run_dir`): with ``train.resume=auto`` (default) a folder
  holding a complete checkpoint resumes from it; a folder that holds ``metrics.jsonl`` but
  no complete checkpoint is *refused* (its steps could not be continued and new rows would
  mix with old ones); ``train.resume=never`` is the way to start over: the old
  ``metrics.jsonl``, ``checkpoints/`` and the ``tensorboard/`` and ``wandb/`` logger folders
  are renamed aside with a UTC time stamp
  (``metrics.jsonl.old-20261201T181500Z``), nothing is deleted.
- **Resume checks the config**: before a resume, the new resolved config is compared with
  the run's ``config.yaml`` (:mod:`verl_ppo.job.resume_check`): a key that cannot change
  mid-run (model, task, algorithm, compression, layouts) refuses the job with the list of
  differences and the ways out; keys that may change (steps, logging, intervals) are logged.
- **Stop** (:class:`StopRequest`): SIGINT and SIGTERM set a flag; at the next step boundary
  every rank learns of it through one small all-reduce, the trainer saves a checkpoint and
  exits with ``128 + signal``. Bound: the rest of the current step plus one checkpoint write;
  the launcher kills ranks still alive ``comm.timeout_s`` after forwarding the signal, and a
  second Ctrl-C kills at once.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"


class RunDirError(RuntimeError):
    """The run folder cannot be used as asked; the message names the way out."""


class RunDirLock:
    """Exclusive lock on ``run_dir`` for the lifetime of one job.

    Args:
        run_dir: the run folder (created if missing).

    Raises (from :meth:`acquire`):
        RunDirError: another live process holds the lock (its pid is named).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock without waiting and record this process's pid in the lock file.

        Raises:
            RunDirError: in use (the holder's pid named), or ``run_dir`` is a file, lies
                under a file, or cannot be written (the reason and a fix named).
        """
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(
                f"run_dir {str(self.path.parent)!r} is in use by another job (pid "
                f"{holder_pid(holder)}); wait for it to end, stop it, or choose another "
                "run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid()}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def _open(self) -> int:
        folder = self.path.parent
        try:
            if folder.exists() and not folder.is_dir():
                raise NotADirectoryError(f"{str(folder)!r} is a file")
            folder.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if isinstance(exc, (NotADirectoryError, FileExistsError)):
                why = "it or a folder above it is a file, not a folder"
            raise RunDirError(
                f"run_dir {str(folder)!r} cannot be used: {why}; pass run_dir=<a folder you "
                "can write> (e.g. run_dir=runs/my_run)"
            ) from None

    def release(self) -> None:
        """Drop the lock (the file stays; its pid is stale and harmless)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def holder_pid(text: str) -> str:
    """The pid recorded in a lock file's ``text`` ("?" when unreadable)."""
    try:
        return str(int(json.loads(text)["pid"]))
    except (ValueError, KeyError, TypeError):
        return "?"


def _peek_run_dir(config_path: str | None, overrides: list[str]) -> str | None:
    """``run_dir`` as the last override or the YAML file sets it (None when neither does:
    the default is :class:`verl_ppo.config.PPOConfig`'s); read with yaml alone."""
    import yaml

    for item in reversed(overrides):
        key, sep, value = item.partition("=")
        if sep and key.strip() == "run_dir" and value:
            return value
    try:
        data = yaml.safe_load(Path(config_path).read_text()) if config_path else None
    except (OSError, yaml.YAMLError):
        return None  # load_config names the problem
    value = data.get("run_dir") if isinstance(data, dict) else None
    return str(value) if value else None


def early_lock_check(config_path: str | None, overrides: list[str]) -> str | None:
    """Before any heavy import: would ``run_dir`` (as the file and overrides name it) be
    refused? Returns the message (busy, a file, unwritable) or None. The lock is taken and
    given back; the launcher takes it for the job once the config is validated."""
    run_dir = _peek_run_dir(config_path, overrides)
    if run_dir is None or not (Path(run_dir).exists() or Path(run_dir).is_symlink()):
        return None  # a folder that does not exist yet is nobody's
    try:
        RunDirLock(run_dir).acquire().release()
    except RunDirError as exc:
        return str(exc)
    return None


def _stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def prepare_run_dir(
    run_dir: str | Path, resume: str, config: Mapping[str, Any] | None = None
) -> list[str]:
    """Apply the fresh-start policy of ``train.resume`` to ``run_dir`` (caller holds the lock).

    Args:
        run_dir: the run folder.
        resume: ``train.resume``.
        config: the new job's resolved config (``model_dump(mode="json", by_alias=True)``);
            when given and a checkpoint will be resumed, it is compared with the run's
            ``config.yaml`` (:func:`verl_ppo.job.resume_check.check_resume_config`).

    Returns:
        Lines to log (what was moved aside, config keys changed on resume); empty when
        nothing was done.

    Raises:
        RunDirError: ``resume=auto``, ``metrics.jsonl`` present and no complete checkpoint;
            or a resume would change a key that cannot change mid-run.
    """
    from verl_ppo.job.resume_check import ResumeConfigError, check_resume_config
    from verl_ppo.run.checkpoint import latest_checkpoint

    root = Path(run_dir)
    metrics = root / "metrics.jsonl"
    ckpt_root = root / "checkpoints"
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    if resume == "auto":
        if has_metrics and latest_checkpoint(ckpt_root) is None:
            raise RunDirError(
                f"run_dir {str(root)!r} holds metrics.jsonl but no complete checkpoint to "
                "resume from; pass train.resume=never to start over (the old metrics.jsonl "
                "is kept aside), or choose another run_dir"
            )
        latest = latest_checkpoint(ckpt_root)
        if config is None or latest is None:
            return []
        try:
            return check_resume_config(root, config, latest.name)
        except ResumeConfigError as exc:
            raise RunDirError(str(exc)) from None
    moved = []
    stamp = _stamp()
    for path in (metrics, ckpt_root, root / "tensorboard", root / "wandb"):  # train.logger
        if path.exists():
            aside = path.with_name(f"{path.name}.old-{stamp}")
            os.replace(path, aside)
            moved.append(f"train.resume=never: moved {path} aside to {aside}")
    return moved


def logged_eval_start(run_dir: str | Path) -> float | None:
    """The step-0 ``eval/reward`` in ``run_dir/metrics.jsonl`` (None when absent): the start
    of a resumed run's ``eval START -> END`` summary."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step") == 0 and row.get("eval/reward") is not None:
            return float(row["eval/reward"])
    return None


class StopRequest:
    """SIGINT/SIGTERM -> stop at the next step boundary (see the module docstring).

    :meth:`install` replaces the handlers of both signals in this process (main thread
    only) and :meth:`restore` puts the previous ones back.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        """Catch SIGINT and SIGTERM (a no-op outside the main thread)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers replaced by :meth:`install`."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def agreed(self, ctx: Any = None, group: Any = None) -> int:
        """The signal any rank of ``group`` received so far (0 = none); collective.

        One all-reduce (MAX) of a one-element int tensor through ``ctx`` (a
        :class:`verl_comm.distributed.DistContext`, so it has the job's timeout), so every
        rank stops at the same step boundary even when only some of them got the signal.
        Without ``ctx`` (or with one rank) this rank's own flag.
        """
        if ctx is None or ctx.world_size == 1:
            return self.signum
        import torch  # here, so that the run-dir lock is taken before any heavy import
        import torch.distributed as dist

        t = torch.tensor([self.signum], dtype=torch.int64, device=ctx.device)
        ctx.all_reduce(t, op=dist.ReduceOp.MAX, group=group, name="stop request")
        return int(t.item())
