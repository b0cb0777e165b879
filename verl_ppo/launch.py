"""Our own launcher for ``verl-ppo train`` outside torchrun, and the per-rank error wrapper.

The parent validates everything that can be validated before a process starts (config,
model cache, task name, port), starts ``comm.nproc`` ranks as subprocesses with the same
environment variables torchrun sets, and watches them: when one rank fails, the others are
stopped within a few seconds and one clear message names the failed rank. Each rank turns
an exception into one line on stderr and keeps the full traceback in ``run_dir``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_ppo.distributed import check_port_free, free_port

KILL_GRACE_S = 5.0


def preflight(cfg: Any) -> None:
    """Checks run once in the parent: model cache (converted here, once), task, port.

    Raises:
        verl_ppo.data.model_store.ModelStoreError, verl_ppo.data.tasks.TaskError, OSError.
    """
    from verl_ppo.data.model_store import resolve_model_path
    from verl_ppo.data.tasks import TASKS, TaskError

    if cfg.data.task not in TASKS:
        raise TaskError(
            f"unknown task {cfg.data.task!r} (data.task); choose one of {sorted(TASKS)}"
        )
    resolve_model_path(cfg.model.path)
    if cfg.comm.master_port:
        check_port_free(cfg.comm.master_port)


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the launcher dies (even by
    SIGKILL), so no rank outlives a killed launcher. A no-op elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch(cfg: Any, config_path: str | None, overrides: list[str]) -> int:
    """Start ``cfg.comm.nproc`` ranks of ``python -m verl_ppo.train`` and supervise them.

    Returns:
        0 if every rank succeeded, else the failed rank's exit code (or 1).
    """
    try:
        preflight(cfg)
    except Exception as exc:  # noqa: BLE001 - every preflight failure is one clear line
        print(f"verl-ppo: {exc}", file=sys.stderr)
        return 2
    n = cfg.comm.nproc
    port = cfg.comm.master_port or free_port()
    cmd = [sys.executable, "-m", "verl_ppo.train"]
    if config_path:
        cmd += ["--config", str(config_path)]
    cmd += list(overrides)
    threads = max(1, (os.cpu_count() or 1) // n)
    procs: list[subprocess.Popen] = []
    for r in range(n):
        env = dict(os.environ)
        env.update(
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            VERL_PPO_LAUNCHED="1",
            VERL_PPO_RUN_DIR=str(cfg.run_dir),
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))
        procs.append(
            subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        )
    return _supervise(procs)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + KILL_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _supervise(procs: list[subprocess.Popen]) -> int:
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                _stop(procs)
                how = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
                print(
                    f"verl-ppo: rank {r} {how}; stopped the other {len(procs) - 1} rank(s). "
                    "See the rank's message above.",
                    file=sys.stderr,
                )
                return c if c > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs)
        print("verl-ppo: interrupted; all ranks stopped", file=sys.stderr)
        return 130


def rank_main(body: Callable[[], int]) -> int:
    """Run one rank's ``body``; an exception becomes one line on stderr (full traceback in
    ``$VERL_PPO_RUN_DIR`` or the working directory as ``error_rank<r>.txt``) and exit code 1."""
    rank = os.environ.get("RANK", "0")
    try:
        return int(body() or 0)
    except KeyboardInterrupt:
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
