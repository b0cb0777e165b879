"""The run folder through the real job (tiny model, 2 gloo ranks): lock, refusal, SIGINT."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.verl_ppo._run import ROOT, run_job
from tests.verl_ppo.test_run_folder import HOLD

pytestmark = pytest.mark.timeout(900)


def test_second_job_on_a_locked_run_dir_fails_at_once(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        r = run_job(["--config", "configs/tiny.yaml", f"run_dir={tmp_path}"], timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2
    assert f"is in use by another job (pid {holder.pid})" in r.stderr, r.stderr[-2000:]
    assert "[rank" not in r.stderr


def test_metrics_without_checkpoint_is_refused_before_launch(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    r = run_job(["--config", "configs/tiny.yaml", f"run_dir={tmp_path}"], timeout=120)
    assert r.returncode == 2 and "train.resume=never" in r.stderr, r.stderr[-2000:]
    assert "[rank" not in r.stderr


def _rows(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_sigint_saves_at_the_step_boundary_then_resumes(tmp_path):
    args = ["--config", "configs/tiny.yaml", f"run_dir={tmp_path}", "train.num_steps=4"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.Popen(
        [sys.executable, "-m", "verl_ppo.train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and '"step": 1' in metrics.read_text()):
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)  # the launcher forwards it to both ranks
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    latest = (tmp_path / "checkpoints" / "LATEST").read_text()
    stopped = int(latest.split("_")[1])
    assert 1 <= stopped < 4 and f"stopped after step {stopped}" in err, err[-3000:]
    assert [r["step"] for r in _rows(tmp_path)] == list(range(stopped + 1))

    r = run_job(args)  # the same command resumes
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and f"at step {stopped}" in r.stderr
    assert [r["step"] for r in _rows(tmp_path)] == list(range(5))  # one row per step
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert ckpts == [f"step_{stopped:06d}", "step_000004"]  # keep_last_checkpoints: 2
