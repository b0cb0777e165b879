"""Run folders: the lock, the fresh-start policy, checkpoint rotation, one row per step."""

import json
import os
import subprocess
import sys

import pytest

from verl_ppo.checkpoint import complete_checkpoints, rotate_checkpoints
from verl_ppo.metrics import MetricsWriter
from verl_ppo.run_folder import RunDirError, RunDirLock, StopRequest, prepare_run_dir

HOLD = """
import sys, time
from verl_ppo.run_folder import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_second_holder_fails_at_once_naming_the_pid(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=rf"in use by another job \(pid {p.pid}\)"):
            RunDirLock(tmp_path).acquire()
    finally:
        p.kill()
        p.wait()
    # the kernel released the dead holder's lock: the stale file does not block
    with RunDirLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def _fake_checkpoint(run, step):
    d = run / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text(json.dumps({"step": step}))
    (run / "checkpoints" / "LATEST").write_text(d.name)
    return d


def test_metrics_without_checkpoint_refused_then_never_moves_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="train.resume=never"):
        prepare_run_dir(tmp_path, "auto")
    moved = prepare_run_dir(tmp_path, "never")
    assert len(moved) == 1 and not (tmp_path / "metrics.jsonl").exists()
    assert [p.name.startswith("metrics.jsonl.old-") for p in tmp_path.iterdir()] == [True]
    prepare_run_dir(tmp_path, "auto")  # empty folder: a fresh start


def test_metrics_with_checkpoint_resumes(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    _fake_checkpoint(tmp_path, 1)
    assert prepare_run_dir(tmp_path, "auto") == []


def test_rotation_keeps_the_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _fake_checkpoint(tmp_path, s)
    root = tmp_path / "checkpoints"
    assert rotate_checkpoints(root, 0) == []  # 0 = keep all
    removed = rotate_checkpoints(root, 2)
    assert [p.name for p in removed] == ["step_000001", "step_000002"]
    assert [p.name for p in complete_checkpoints(root)] == ["step_000003", "step_000004"]


def test_metrics_writer_never_holds_two_rows_of_a_step(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write({"step": 0, "eval/reward": 0.1})
    w.write({"step": 1, "reward/mean": 0.5})
    w.write({"step": 1, "reward/mean": 0.7})  # a step repeated after a resume
    w2 = MetricsWriter(tmp_path)  # a restarted job
    w2.write({"step": 0, "eval/reward": 0.2})
    w2.write({"step": 2, "reward/mean": 0.9})
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/reward"] == 0.2 and rows[1]["reward/mean"] == 0.7


def test_stop_request_records_the_first_signal():
    import signal

    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed() == signal.SIGTERM  # no process group: this rank's own flag
    finally:
        stop.restore()
