"""Our own launcher for ``verl-ppo train`` outside torchrun, and the per-rank error wrapper.

The parent validates everything that can be validated before a process starts (config,
model cache, task name, port), starts ``comm.nproc`` ranks as subprocesses with the same
environment variables torchrun sets, and watches them (:mod:`verl_comm.distributed.launch`):
when one rank fails, the others are stopped within a few seconds and one clear message
names the failed rank. Each rank turns an exception into one line on stderr and keeps the
full traceback in ``run_dir``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_comm.distributed.launch import run_ranks


def preflight(cfg: Any) -> None:
    """Checks run once in the parent for ``comm.nproc`` ranks (see :mod:`verl_ppo.job.preflight`).

    Raises:
        verl_ppo.job.preflight.PreflightError: naming the field and the fix.
    """
    from verl_ppo.job.preflight import preflight as check

    check(cfg, cfg.comm.nproc)


def launch(cfg: Any, config_path: str | None, overrides: list[str]) -> int:
    """Start ``cfg.comm.nproc`` ranks of ``python -m verl_ppo.train`` and supervise them.

    Order: every preflight check (no process started yet), the ``run_dir`` lock and its
    fresh-start policy (:mod:`verl_ppo.run.folder`), then the ranks. ``config_path`` None
    writes the resolved config to ``run_dir/config.yaml`` and launches the ranks on it
    (the Python API); the CLI passes its own file and overrides through unchanged.

    Returns:
        0 if every rank succeeded; ``128 + signal`` when SIGINT/SIGTERM stopped the job
        (the ranks saved a checkpoint first); else the failed rank's exit code (or 1, 2
        for a preflight or run-folder error).
    """
    from verl_ppo.run.folder import RunDirError, RunDirLock, prepare_run_dir

    os.environ.setdefault("VERL_PPO_T0", repr(time.time()))
    try:
        preflight(cfg)
        lock = RunDirLock(cfg.run_dir).acquire()
    except Exception as exc:  # noqa: BLE001 - every preflight failure is one clear line
        print(f"verl-ppo: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            dumped = cfg.model_dump(by_alias=True, mode="json")
            for line in prepare_run_dir(cfg.run_dir, cfg.train.resume, dumped):
                print(f"verl-ppo: {line}", file=sys.stderr)
        except RunDirError as exc:
            print(f"verl-ppo: {exc}", file=sys.stderr)
            return 2
        args = ["--config", str(config_path), *overrides] if config_path else []
        if not config_path:
            import yaml

            written = Path(cfg.run_dir) / "config.yaml"
            dumped = cfg.model_dump(by_alias=True, mode="json")
            written.write_text(yaml.safe_dump(dumped, sort_keys=False))
            args = ["--config", str(written)]
        return _spawn(cfg, args)
    finally:
        lock.release()


def _spawn(cfg: Any, args: list[str]) -> int:
    """Start and supervise the ranks (:func:`verl_comm.distributed.launch.run_ranks`):
    SIGINT/SIGTERM are forwarded (the ranks checkpoint at the next step boundary and exit
    with ``128 + signal``), ranks still alive ``comm.timeout_s`` later, or at a second
    signal, are killed; a failed rank stops the others."""

    def forwarded(signum: int) -> None:
        print(
            f"verl-ppo: signal {signum}: the ranks save a checkpoint at the end of "
            f"the current step, then exit (killed after {cfg.comm.timeout_s:.0f} s, "
            "comm.timeout_s; send the signal again to kill now)",
            file=sys.stderr,
        )

    rollout_ranks = cfg.rollout.n_ranks if cfg.rollout.mode == "async" else 0
    res = run_ranks(
        [sys.executable, "-m", "verl_ppo.train", *args],
        cfg.comm.nproc + rollout_ranks,  # async: rollout ranks after the training ranks
        env={"VERL_PPO_LAUNCHED": "1", "VERL_PPO_RUN_DIR": str(cfg.run_dir)},
        master_port=cfg.comm.master_port,
        name="verl-ppo",
        announce=False,
        forward_signals=True,
        stop_timeout_s=cfg.comm.timeout_s,
        on_signal=forwarded,
    )
    if res.failed_rank is not None:
        print(f"{res.message} See the rank's message above.", file=sys.stderr)
    elif res.killed_after_signal:
        print("verl-ppo: ranks killed before their checkpoint", file=sys.stderr)
    elif res.signal is not None:
        print(
            "verl-ppo: stopped; run the same command again to resume from the checkpoint",
            file=sys.stderr,
        )
    elif res.message:
        print(res.message, file=sys.stderr)
    return res.returncode


def rank_main(body: Callable[[], int]) -> int:
    """Run one rank's ``body``; an exception becomes one line on stderr (full traceback in
    ``$VERL_PPO_RUN_DIR`` or the working directory as ``error_rank<r>.txt``) and exit code 1."""
    rank = os.environ.get("RANK", "0")
    try:
        return int(body() or 0)
    except KeyboardInterrupt:
        if rank == "0":  # every rank got it: say it once
            print(
                f"verl-ppo [rank {rank}]: interrupted (Ctrl-C) outside the training loop "
                "(start-up or teardown): no checkpoint was written for it",
                file=sys.stderr,
            )
        return 130
    except Exception as exc:  # noqa: BLE001 - the rank's last word, then exit
        tb = traceback.format_exc()
        where = Path(os.environ.get("VERL_PPO_RUN_DIR", ".")) / f"error_rank{rank}.txt"
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(tb)
            note = f" (traceback: {where})"
        except OSError:
            note = ""
        if os.environ.get("VERL_PPO_DEBUG"):
            sys.stderr.write(tb)
        print(f"verl-ppo [rank {rank}]: {type(exc).__name__}: {exc}{note}", file=sys.stderr)
        return 1
