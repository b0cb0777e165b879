"""The async mode end to end on gloo (tiny model): equality with the colocated mode at
staleness 0, the staleness bound of a one-step-off-policy run, kill -9 of a rollout or a
training rank followed by a resume, and Ctrl-C (SIGINT) followed by a resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from benchmarks.async_learning import ON_POLICY  # 2 + 2 ranks at staleness 0, fp32, full wire
from tests.verl_ppo._run import ROOT, run_job

pytestmark = pytest.mark.timeout(900)

BASE = ["--config", "configs/tiny.yaml", "data.eval_size=0", "train.export_critic=true"]
# one step off policy on one TP2 rollout group (bf16 delta wire, the defaults)
ONE_OFF = [
    "rollout.mode=async",
    "rollout.n_ranks=2",
    "rollout.tensor_model_parallel_size=2",
    "algorithm.policy_loss=decoupled",
]


def _steps(run):
    recs = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "reward/mean" in r]


def _weights(run):
    out = {}
    for role in ("actor", "critic"):
        for k, v in load_file(str(Path(run) / "hf" / role / "model.safetensors")).items():
            out[f"{role}/{k}"] = v
    return out


def test_staleness_zero_equals_colocated(tmp_path):
    args = [*BASE, "train.num_steps=5"]
    colo, asy = tmp_path / "colocated", tmp_path / "async"
    r = run_job([*args, f"run_dir={colo}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_job([*args, *ON_POLICY, f"run_dir={asy}"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _weights(colo), _weights(asy)
    assert a.keys() == b.keys() and len(a) > 10
    # same batches, same sampling seeds, bit-identical weights on the rollout ranks (fp32,
    # checksum-verified): the runs are the same computation; 1e-6 is the bound
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst
    assert any(float((a[k] - b[k]).abs().max()) == 0.0 for k in a)
    assert [s["async/staleness_max"] for s in _steps(asy)] == [0.0] * 5
    assert [s["reward/mean"] for s in _steps(asy)] == [s["reward/mean"] for s in _steps(colo)]


def test_one_step_off_policy_keeps_the_bound(tmp_path):
    run = tmp_path / "run"
    r = run_job([*BASE, *ONE_OFF, "train.num_steps=4", f"run_dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    steps = _steps(run)
    # batch k is generated with version max(k - 1, 0): staleness 0 first, then 1
    assert [s["async/staleness_max"] for s in steps] == [0.0, 1.0, 1.0, 1.0]
    assert [s["async/weights_version"] for s in steps] == [0.0, 0.0, 1.0, 2.0]
    assert all(s["actor/rollout_is_weight_mean"] > 0 for s in steps)  # the decoupled loss ran
    # bf16 delta wire: after the first (full) sync only the changed elements travel
    sent = [s["async/sync_bytes_sent"] for s in steps]
    assert all(x < sent[0] for x in sent[1:]), sent


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the launcher child with ``RANK=rank``."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (p / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(p.name)
    return None


KILL = [*BASE, *ON_POLICY, "train.num_steps=5", "train.save_interval=1", "comm.timeout_s=60"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the interrupted ones must end at (once for the module's tests)."""
    ref = tmp_path_factory.mktemp("uninterrupted")
    r = run_job([*KILL, f"run_dir={ref}"])
    assert r.returncode == 0, r.stderr[-3000:]
    return ref


def _start(run: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.Popen(
        [sys.executable, "-m", "verl_ppo.train", *KILL, f"run_dir={run}"],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_checkpoint(p: subprocess.Popen, run: Path, step: int) -> None:
    latest = run / "checkpoints" / "LATEST"
    deadline = time.monotonic() + 400
    while not (latest.is_file() and latest.read_text() >= f"step_{step:06d}"):
        assert time.monotonic() < deadline and p.poll() is None, "ended before the interruption"
        time.sleep(0.05)


def _resume_ends_like(run: Path, ref: Path) -> None:
    """The same command resumes from the last intact checkpoint and ends where the
    uninterrupted run does (bit-identical training at staleness 0: 1e-6 is the bound)."""
    good = (run / "checkpoints" / "LATEST").read_text()
    r = run_job([*KILL, f"run_dir={run}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at step {int(good.split('_')[1])}" in r.stderr
    got, want = _steps(run), _steps(ref)
    assert [x["step"] for x in got] == [x["step"] for x in want] == [1, 2, 3, 4, 5]
    a, b = _weights(ref), _weights(run)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("victim", [3, 1], ids=["rollout_rank", "training_rank"])
def test_kill_rank_then_resume(tmp_path, uninterrupted, victim):
    """kill -9 of rollout rank 1 of 2 (bridge rank 3) or of training rank 1 of 2: the job
    stops within comm.timeout_s naming the dead rank, the checkpoint of the last completed
    step is intact, and the same command resumes from it."""
    run = tmp_path / "run"
    p = _start(run)
    _wait_checkpoint(p, run, 2)
    pid = _rank_pid(p.pid, victim)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=120)
    assert p.returncode != 0
    assert time.monotonic() - t0 < 60  # within comm.timeout_s
    assert f"rank {victim}" in err, err[-2000:]
    _resume_ends_like(run, uninterrupted)


def test_sigint_stops_every_rank_then_resumes(tmp_path, uninterrupted):
    """Ctrl-C of the async job: the launcher forwards SIGINT to the training and the rollout
    ranks; the training ranks stop at the next step boundary with a checkpoint, the rollout
    ranks say they stopped with them, nobody waits for comm.timeout_s, and the same command
    resumes."""
    run = tmp_path / "run"
    p = _start(run)
    _wait_checkpoint(p, run, 1)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGINT, err[-3000:]
    assert time.monotonic() - t0 < 45, err[-3000:]  # well before comm.timeout_s (60 s)
    stopped = int((run / "checkpoints" / "LATEST").read_text().split("_")[1])
    assert 1 <= stopped < 5 and f"stopped after step {stopped}" in err, err[-3000:]
    assert "rollout rank" in err and "stopped with the training ranks" in err, err[-3000:]
    # no rank failed or was killed ("killed after" is the launcher's notice of the deadline)
    assert "Traceback" not in err and "ranks killed" not in err, err[-3000:]
    assert "failed" not in err, err[-3000:]
    _resume_ends_like(run, uninterrupted)
