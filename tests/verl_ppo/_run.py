"""Helpers to run the main job as a user would (subprocess, bounded time)."""

import os
import subprocess
import sys

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
