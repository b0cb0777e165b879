"""Start N ranks on this host and supervise them: the one launcher of the project.

- :func:`free_port` / :func:`check_port_free`: the rendezvous port.
- :func:`run_ranks`: ``N`` subprocesses with the environment torchrun sets (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
  watched until all exit. When one rank fails the others are stopped (SIGTERM to each rank's
  process group, SIGKILL after :data:`KILL_GRACE_S`) and one message names the failed rank
  and how it ended. Nothing is left behind: every rank runs in its own session, the kernel
  kills it if the launcher dies (``PR_SET_PDEATHSIG`` on Linux), and every path out of
  :func:`run_ranks` (success, failure, deadline, Ctrl-C, an exception) stops what still runs.
- :func:`spawn`: run a Python function ``f(rank, world_size, *args)`` on N ranks through
  :func:`run_ranks` (optionally inside a process group made by
  :func:`~verl_comm.distributed.init_distributed`) and return the per-rank results; a rank's
  exception is re-raised in the caller with its traceback.

Used by ``verl-ppo train`` (``verl_ppo/launch.py``), ``verl-comm doctor``, ``verl-comm bench``
and the multi-process tests and benchmarks. Under torchrun none of this runs: the callers
detect ``RANK``/``WORLD_SIZE`` and run their rank in-process.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

KILL_GRACE_S = 5.0
POLL_S = 0.1
STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM)
"""Exit statuses of a rank that stopped on SIGINT/SIGTERM by itself (not a failure when the
launcher forwards signals)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(port: int, host: str = "127.0.0.1", key: str = "comm.master_port") -> None:
    """Raise a clear error if ``port`` is taken on ``host`` (before any rank starts).

    Raises:
        OSError: naming the port and ``key``, the setting that chose it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            raise OSError(
                f"port {port} on {host} is already in use: set {key} to a free "
                "port, or leave it unset to pick one automatically"
            ) from None


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the launcher dies (even by
    SIGKILL), so no rank outlives a killed launcher. A no-op elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class RankExit:
    """How one rank ended.

    Attributes:
        rank: the rank.
        returncode: its exit status (negative: killed by that signal).
        stopped: True when the launcher stopped it (another rank failed, the deadline
            passed, or Ctrl-C) rather than it exiting by itself.
    """

    rank: int
    returncode: int
    stopped: bool = False


@dataclass
class LaunchResult:
    """What :func:`run_ranks` returns.

    Attributes:
        exits: one :class:`RankExit` per rank, rank order.
        failed_rank: the first rank seen failing by itself, or None.
        timed_out: the deadline passed with ranks still running.
        interrupted: Ctrl-C stopped the ranks (without ``forward_signals``).
        signal: with ``forward_signals``: the SIGINT/SIGTERM forwarded to the ranks (or that
            a rank stopped on by itself), else None.
        killed_after_signal: the ranks did not exit within ``stop_timeout_s`` of the signal,
            or a second signal came: they were killed.
        message: the one line describing the failure (None when every rank succeeded).
    """

    exits: list[RankExit] = field(default_factory=list)
    failed_rank: int | None = None
    timed_out: bool = False
    interrupted: bool = False
    signal: int | None = None
    killed_after_signal: bool = False
    message: str | None = None

    @property
    def ok(self) -> bool:
        """Every rank exited with status 0 by itself."""
        return self.message is None and self.signal is None

    @property
    def returncode(self) -> int:
        """0 on success; the failed rank's positive status (else 1); ``128 + signal`` after
        a forwarded signal (``128 + SIGKILL`` killed without one); 130 after Ctrl-C."""
        if self.failed_rank is not None:
            c = self.exits[self.failed_rank].returncode
            return c if c > 0 else 1
        if self.killed_after_signal:
            return 128 + (self.signal or signal.SIGKILL)
        if self.signal is not None:
            return 128 + self.signal
        if self.interrupted:
            return 130
        return 0 if self.ok else 1


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass


def _stop(procs: list[subprocess.Popen], now: bool = False) -> list[bool]:
    """SIGTERM every running rank's process group (SIGKILL when ``now``), SIGKILL after the
    grace; returns which ranks were still running (i.e. stopped by us)."""
    stopped = [p.poll() is None for p in procs]
    _signal_all(procs, signal.SIGKILL if now else signal.SIGTERM)
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
    return stopped


def run_ranks(
    command: Sequence[str] | Callable[[int], Sequence[str]],
    nproc: int,
    *,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
    base_env: Mapping[str, str] | None = None,
    master_port: int | None = None,
    master_addr: str = "127.0.0.1",
    deadline_s: float | None = None,
    stop_on_failure: bool = True,
    stdout: Callable[[int], IO[Any] | None] | None = None,
    stderr: Callable[[int], IO[Any] | None] | None = None,
    name: str = "launch",
    announce: bool = True,
    forward_signals: bool = False,
    stop_timeout_s: float = 300.0,
    on_signal: Callable[[int], None] | None = None,
) -> LaunchResult:
    """Start ``nproc`` ranks of ``command`` and wait for all of them.

    Args:
        command: argv of every rank, or ``rank -> argv``.
        nproc: number of ranks (>= 1).
        env: variables added to ``base_env`` for every rank (or ``rank -> variables``); they
            win over the launcher's defaults (``OMP_NUM_THREADS`` = cores / ``nproc``), the
            rank variables always win over them.
        base_env: the environment the ranks start from (default: this process's).
        master_port: the rendezvous port (default: :func:`free_port`).
        master_addr: the rendezvous host.
        deadline_s: stop every rank still running after this many seconds (None: none).
        stop_on_failure: stop the other ranks as soon as one fails (False: let them run
            to their own end or the deadline, e.g. to collect each rank's report).
        stdout, stderr: ``rank -> file`` for the rank's output (default: inherited).
        name: prefix of the message (the program the user ran).
        announce: print the failure message on stderr.
        forward_signals: SIGINT/SIGTERM to this process (main thread only) are forwarded to
            every rank, which may then finish cleanly (e.g. checkpoint) and exit with
            ``128 + signal`` (:data:`STOP_CODES`, not a failure); ranks still running
            ``stop_timeout_s`` later, or at a second signal, are killed. A rank that exits
            with a stop code by itself starts the same countdown for the others.
        stop_timeout_s: seconds the ranks get after a forwarded signal.
        on_signal: called with the signal number once it is forwarded (e.g. to tell the
            user what the ranks do now).

    Returns:
        A :class:`LaunchResult`; nothing of the ranks is running any more.

    Raises:
        ValueError: ``nproc < 1``.
        OSError: a rank could not be started (the ones started are stopped first).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    port = master_port or free_port(master_addr)
    out = LaunchResult()
    received: list[int] = []  # signals caught while forwarding
    previous = _catch_signals(received) if forward_signals else {}
    procs: list[subprocess.Popen] = []
    kill_now = False
    try:
        for r in range(nproc):
            argv = list(command(r) if callable(command) else command)
            rank_env = _rank_env(r, nproc, env, base_env, master_addr, port)
            procs.append(_start(argv, rank_env, stdout(r) if stdout else None,
                                stderr(r) if stderr else None))  # fmt: skip
        watch = _Watch(out, received, forward_signals, stop_timeout_s, on_signal)
        kill_now = watch.run(procs, deadline_s, stop_on_failure)
    except KeyboardInterrupt:
        out.interrupted = True
    finally:
        stopped = _stop(procs, now=kill_now)
        for s, h in previous.items():
            signal.signal(s, h)
    out.exits = [RankExit(r, int(p.returncode), stopped[r]) for r, p in enumerate(procs)]
    out.message = _message(out, name, sum(stopped), len(received), stop_timeout_s, deadline_s)
    if out.message and announce:
        print(out.message, file=sys.stderr)
    return out


def _catch_signals(received: list[int]) -> dict[int, Any]:
    """Append SIGINT/SIGTERM to ``received`` instead of acting on them (main thread only:
    Python delivers signals there); returns the previous handlers."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, lambda signum, _f: received.append(signum))
    return previous


def _start(argv: list[str], env: dict[str, str], stdout: Any, stderr: Any) -> subprocess.Popen:
    """One rank in its own session, killed by the kernel if the launcher dies."""
    return subprocess.Popen(
        argv,
        env=env,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )


def _rank_env(
    rank: int,
    nproc: int,
    env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None,
    base_env: Mapping[str, str] | None,
    master_addr: str,
    port: int,
) -> dict[str, str]:
    """Rank ``rank``'s environment: ``base_env`` (default: this process's), the launcher's
    ``OMP_NUM_THREADS`` default, ``env``, then torchrun's rank variables."""
    rank_env = dict(os.environ if base_env is None else base_env)
    rank_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    rank_env.update(env(rank) if callable(env) else (env or {}))
    rank_env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
    )
    return rank_env


@dataclass
class _Watch:
    """The supervision loop of :func:`run_ranks`, filling ``out`` as the ranks end."""

    out: LaunchResult
    received: list[int]
    forward_signals: bool
    stop_timeout_s: float
    on_signal: Callable[[int], None] | None

    def run(
        self, procs: list[subprocess.Popen], deadline_s: float | None, stop_on_failure: bool
    ) -> bool:
        """Poll until every rank ended, one failed (with ``stop_on_failure``), the deadline
        passed or the signal countdown ran out; returns whether to kill at once."""
        out, received = self.out, self.received
        end = None if deadline_s is None else time.monotonic() + deadline_s
        sig_end = float("inf")
        ok_codes = (0, *STOP_CODES) if self.forward_signals else (0,)
        while True:
            if received and out.signal is None:
                out.signal = received[0]
                _signal_all(procs, out.signal)
                sig_end = time.monotonic() + self.stop_timeout_s
                if self.on_signal is not None:
                    self.on_signal(out.signal)
            if len(received) > 1 or time.monotonic() > sig_end:
                out.killed_after_signal = True
                return True
            codes = [p.poll() for p in procs]
            stopping = [c for c in codes if self.forward_signals and c in STOP_CODES]
            if stopping and out.signal is None:  # a rank was signalled directly
                out.signal, sig_end = stopping[0] - 128, time.monotonic() + self.stop_timeout_s
            failed = [r for r, c in enumerate(codes) if c not in (None, *ok_codes)]
            if failed and out.failed_rank is None:
                out.failed_rank = failed[0]
                if stop_on_failure:
                    return False
            if all(c is not None for c in codes):
                return False
            if end is not None and time.monotonic() >= end:
                out.timed_out = True
                return False
            time.sleep(POLL_S)


def _message(
    out: LaunchResult,
    name: str,
    others: int,
    signals: int,
    stop_timeout_s: float,
    deadline_s: float | None,
) -> str | None:
    """The one line describing how the launch failed (None when every rank succeeded);
    ``others``: ranks the launcher stopped, ``signals``: signals caught."""
    if out.killed_after_signal:
        if signals > 1:
            return f"{name}: ranks killed at a second signal"
        return f"{name}: ranks killed {stop_timeout_s:g} s after signal {out.signal}"
    if out.interrupted:
        return f"{name}: interrupted; all ranks stopped"
    if out.failed_rank is not None:
        r = out.failed_rank
        return f"{name}: rank {r} {_how(out.exits[r].returncode)}" + (
            f"; stopped the other {others} rank(s)." if others else "."
        )
    if out.timed_out:
        return f"{name}: {others} rank(s) still running after {deadline_s:g} s: stopped"
    if out.signal is not None:
        return f"{name}: every rank stopped on signal {out.signal}"
    return None


# ------------------------------------------------------------------ functions on N ranks
def _target_spec(target: str | Callable[..., Any]) -> str:
    """``"module:qualname"`` for an importable module-level function, else
    ``"/path/file.py:name"`` (pytest's importlib mode gives test modules odd names)."""
    if isinstance(target, str):
        return target
    mod = target.__module__
    spec = importlib.util.find_spec(mod) if mod != "__main__" else None
    path = inspect.getfile(target)
    if spec is not None and spec.origin and Path(spec.origin).resolve() == Path(path).resolve():
        return f"{mod}:{target.__qualname__}"
    return f"{path}:{target.__qualname__}"


def _resolve(spec: str) -> Callable[..., Any]:
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        mspec = importlib.util.spec_from_file_location(f"_launch_target_{abs(hash(where))}", where)
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    obj: Any = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(job_path: str) -> int:
    """One rank of :func:`spawn` (``python -m verl_comm.distributed.launch JOB``)."""
    rank = int(os.environ["RANK"])
    job = pickle.loads(Path(job_path).read_bytes())
    result = Path(job["dir"]) / f"rank{rank}.pkl"
    ctx = None
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if job["backend"] is not None:
            from verl_comm.distributed.context import init_distributed

            ctx = init_distributed(job["backend"], job["timeout_s"])
        value = _resolve(job["target"])(rank, int(os.environ["WORLD_SIZE"]), *job["args"])
        payload = ("ok", value)
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        payload = ("error", traceback.format_exc())
    finally:
        if ctx is not None:
            import gc

            gc.collect()
            ctx.destroy()
    tmp = result.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(payload))
    os.replace(tmp, result)
    return 0 if payload[0] == "ok" else 1


def spawn(
    target: str | Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    backend: str | None = "gloo",
    timeout_s: float = 120.0,
    deadline_s: float | None = None,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
) -> list[Any]:
    """Run ``target(rank, nproc, *args)`` on ``nproc`` fresh Python processes.

    Args:
        target: a module-level function, ``"package.module:function"`` or
            ``"/path/file.py:function"``; ``args`` and its result must be picklable.
        backend: ``"gloo"`` / ``"nccl"``: each rank first joins a process group made by
            :func:`~verl_comm.distributed.init_distributed` (rank = ``LOCAL_RANK`` = GPU
            index) with ``timeout_s``, destroyed after ``target`` returns; None: ``target``
            sets up its own (the rank variables are set, ``init_method="env://"`` works).
        timeout_s: deadline of the process group's rendezvous and collectives (seconds).
        deadline_s: stop all ranks after this many seconds (default: ``timeout_s`` + 60 s
            for interpreter start and imports).
        env: extra environment variables of every rank.
        name: what the error messages call the run (default: the target's name).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message; the other ranks were
            stopped), died without a result, or the deadline passed.
    """
    spec = _target_spec(target)
    label = name or spec.rpartition(":")[2]
    tmp = tempfile.mkdtemp(prefix="verl_comm_spawn_")
    try:
        job = {"target": spec, "args": tuple(args), "backend": backend, "timeout_s": timeout_s}
        job["dir"] = tmp
        job_path = Path(tmp) / "job.pkl"
        job_path.write_bytes(pickle.dumps(job))
        # the ranks see this interpreter's import path (as multiprocessing's spawn does), so
        # a script that put its checkout on sys.path runs its ranks from it too
        paths = [p or os.getcwd() for p in sys.path]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        rank_env = {"PYTHONPATH": os.pathsep.join(paths), **(env or {})}
        res = run_ranks(
            [sys.executable, "-m", "verl_comm.distributed.launch", str(job_path)],
            nproc,
            env=rank_env,
            deadline_s=timeout_s + 60.0 if deadline_s is None else deadline_s,
            name=label,
            announce=False,
        )
        results: dict[int, tuple[str, Any]] = {}
        for r in range(nproc):
            f = Path(tmp) / f"rank{r}.pkl"
            if f.is_file():
                results[r] = pickle.loads(f.read_bytes())
        errors = [r for r in sorted(results) if results[r][0] == "error"]
        if errors:
            first = res.failed_rank if res.failed_rank in errors else errors[0]
            raise RuntimeError(f"{label} failed on rank {first}:\n{results[first][1]}")
        if not res.ok:
            raise RuntimeError(f"{res.message} (no result from ranks "
                               f"{sorted(set(range(nproc)) - set(results))})")  # fmt: skip
        return [results[r][1] for r in range(nproc)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
