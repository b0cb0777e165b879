"""Running a benchmark's ``--smoke`` mode from a test: one command line and one failure
message for the ``tests/**/test_bench_*_smoke.py`` files (their records are read with
:func:`verl_comm.bench.report.read_jsonl`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_smoke(
    script: str,
    out: Path,
    *,
    timeout: float,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """``python [LAUNCHER...] benchmarks/SCRIPT --smoke --out OUT [ARGS...]`` in the repository
    root, stdout/stderr captured as text.

    Args:
        launcher: interpreter arguments before the script, e.g.
            ``("-m", "torch.distributed.run", "--nproc_per_node=2")``.
        env: the whole environment of the run (None: this process's).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    cmd = [sys.executable, *launcher, str(REPO / "benchmarks" / script), "--smoke"]
    return subprocess.run(
        [*cmd, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def check_exit(proc: subprocess.CompletedProcess, ok: Sequence[int] = (0,)) -> None:
    """Assert the run's exit code is in ``ok``; the message holds the tails of its output."""
    assert proc.returncode in ok, proc.stdout[-2000:] + proc.stderr[-4000:]
