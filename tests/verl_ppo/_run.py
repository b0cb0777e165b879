"""Helpers to run the main job as a user would (subprocess, bounded time)."""

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_job(args, timeout=600, env=None, **kw):
    """Run ``python -m verl_ppo.train ARGS`` from the repo root; returns CompletedProcess."""
    e = dict(os.environ)
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "verl_ppo.train", *args],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def run_python(script: str, *args: str, timeout: float = 580) -> subprocess.CompletedProcess:
    """Run ``python -c SCRIPT ARGS...`` from the repo root; returns the CompletedProcess
    (stdout/stderr captured as text).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json(proc: subprocess.CompletedProcess) -> Any:
    """The JSON document on the last line of a successful run's stdout.

    Raises:
        AssertionError: the run failed (the tail of its stderr is the message).
    """
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
