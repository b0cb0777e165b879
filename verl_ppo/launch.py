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

from verl_ppo.distributed import free_port

KILL_GRACE_S = 5.0


def preflight(cfg: Any) -> None:
    """Checks run once in the parent for ``comm.nproc`` ranks (see :mod:`verl_ppo.preflight`).

    Raises:
        verl_ppo.preflight.PreflightError: naming the field and the fix.
    """
    from verl_ppo.preflight import preflight as check

    check(cfg, cfg.comm.nproc)


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

    Order: every preflight check (no process started yet), the ``run_dir`` lock and its
    fresh-start policy (:mod:`verl_ppo.run_folder`), then the ranks. ``config_path`` None
    writes the resolved config to ``run_dir/config.yaml`` and launches the ranks on it
    (the Python API); the CLI passes its own file and overrides through unchanged.

    Returns:
        0 if every rank succeeded; ``128 + signal`` when SIGINT/SIGTERM stopped the job
        (the ranks saved a checkpoint first); else the failed rank's exit code (or 1, 2
        for a preflight or run-folder error).
    """
    from verl_ppo.run_folder import RunDirError, RunDirLock, prepare_run_dir

    os.environ.setdefault("VERL_PPO_T0", repr(time.time()))
    try:
        preflight(cfg)
        lock = RunDirLock(cfg.run_dir).acquire()
    except Exception as exc:  # noqa: BLE001 - every preflight failure is one clear line
        print(f"verl-ppo: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            for line in prepare_run_dir(cfg.run_dir, cfg.train.resume):
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
    n = cfg.comm.nproc
    port = cfg.comm.master_port or free_port()
    cmd = [sys.executable, "-m", "verl_ppo.train", *args]
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
    return _supervise(procs, stop_timeout_s=cfg.comm.timeout_s)


def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass


def _stop(procs: list[subprocess.Popen]) -> None:
    _signal_all(procs, signal.SIGTERM)
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


STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def _supervise(procs: list[subprocess.Popen], stop_timeout_s: float = 300.0) -> int:
    """Wait for the ranks; a failed rank stops the others. SIGINT/SIGTERM to this process
    are forwarded to every rank (they save a checkpoint at the next step boundary and exit
    with ``128 + signal``); ranks still alive ``stop_timeout_s`` later, or at a second
    signal, are killed."""
    import threading

    received: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, lambda signum, _f: received.append(signum))
    forwarded = 0
    deadline = float("inf")
    try:
        while True:
            if received and not forwarded:
                forwarded = received[0]
                _signal_all(procs, forwarded)
                deadline = time.monotonic() + stop_timeout_s
                print(
                    f"verl-ppo: signal {forwarded}: the ranks save a checkpoint at the end of "
                    f"the current step, then exit (killed after {stop_timeout_s:.0f} s, "
                    "comm.timeout_s; send the signal again to kill now)",
                    file=sys.stderr,
                )
            if len(received) > 1 or time.monotonic() > deadline:
                _signal_all(procs, signal.SIGKILL)
                for p in procs:
                    p.wait()
                print("verl-ppo: ranks killed before their checkpoint", file=sys.stderr)
                return 128 + (forwarded or signal.SIGKILL)
            codes = [p.poll() for p in procs]
            stopped = [c for c in codes if c in STOP_CODES]
            if stopped and not forwarded:  # a rank was signalled directly: all stop too
                forwarded, deadline = stopped[0] - 128, time.monotonic() + stop_timeout_s
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, *STOP_CODES)]
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
            if all(c is not None for c in codes):
                if forwarded:
                    print(
                        "verl-ppo: stopped; run the same command again to resume from the "
                        "checkpoint",
                        file=sys.stderr,
                    )
                    return 128 + forwarded
                return 0
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
