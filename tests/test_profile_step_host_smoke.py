"""``benchmarks/gpu/profile_step_host.py`` (the host-gap diagnostic) runs on the CPU and
accounts for the step's prompts, which come from the prefetch thread."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_profile_step_host_smoke():
    args = ["--shape", "tiny", "--prompt-len", "16", "--response-len", "8"]
    args += ["--rollout-batch", "4", "--micro-batch", "2", "--warmup", "1", "--steps", "2"]
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu" / "profile_step_host.py"), *args],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "timed steps 2" in out and "phase:gen" in out and "phase:update" in out
    exact = out.split("timed exactly (ms per step):")[1]
    # the step waits for its prompts (step_prompts); the worker tokenizes (_tokenize)
    assert "step_prompts" in exact and "_tokenize" in exact
