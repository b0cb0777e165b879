"""kill -9 in the middle of a run and of a checkpoint write; resume loses and repeats no step."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.verl_ppo._run import ROOT, run_job

pytestmark = pytest.mark.timeout(900)

BASE = [
    "--config",
    "configs/tiny.yaml",
    "train.num_steps=5",
    "train.save_interval=1",
    "data.eval_size=0",
]
COMPARE = ("reward/mean", "actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/kl")
HE = "actor.model_config.hybrid_engine"
LAYOUTS = {
    "dp": [],
    # PP2 on the pipeline engine (2 ranks), generation on the TP2 rollout model
    "pp2": [
        f"{HE}.enable=true",
        f"{HE}.training_sharding.pipeline_parallel_size=2",
        f"{HE}.rollout_sharding.tensor_parallel_size=2",
    ],
}


def _steps(run):
    recs = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "reward/mean" in r]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kill_mid_step_and_mid_checkpoint_then_resume(tmp_path, layout):
    args = [*BASE, *LAYOUTS[layout]]
    ref = tmp_path / "ref"
    r = run_job([*args, f"run_dir={ref}"])
    assert r.returncode == 0, r.stderr[-3000:]

    run = tmp_path / "run"
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "verl_ppo.train", *args, f"run_dir={run}"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = run / "checkpoints" / "LATEST"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if latest.is_file() and latest.read_text() >= "step_000002":
            break
        assert p.poll() is None, "run ended before it could be killed"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the launcher and both ranks, mid-step
    p.wait(timeout=30)
    ck = run / "checkpoints"
    good = latest.read_text()
    # a kill in the middle of a checkpoint write leaves a .tmp folder and a stale LATEST
    step = int(good.split("_")[1])
    partial = ck / f".tmp-step_{step + 1:06d}"
    if not partial.exists():
        shutil.copytree(ck / good, partial)
        (partial / "COMPLETE").unlink()
        shutil.rmtree(partial / "actor")
    r2 = run_job([*args, f"run_dir={run}"])
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert f"at step {step}" in r2.stderr
    got, want = _steps(run), _steps(ref)
    assert [x["step"] for x in got] == [1, 2, 3, 4, 5]
    for a, b in zip(got, want):
        for k in COMPARE:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    assert not list(ck.glob(".tmp-step_*"))
