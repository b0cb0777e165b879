"""Bad input ends every process with one clear message within a bounded time."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.verl_ppo._run import ROOT, run_job
from verl_ppo.data import model_store

pytestmark = pytest.mark.timeout(300)


def _assert_clear(r, pattern):
    assert r.returncode != 0
    assert pattern in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_config_not_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train: {num_steps: [\n")
    t0 = time.monotonic()
    r = run_job(["--config", str(p)], timeout=60)
    _assert_clear(r, "is not valid YAML")
    assert time.monotonic() - t0 < 30


def test_unknown_task():
    r = run_job(["--config", "configs/tiny.yaml", "data.task=nope"], timeout=60)
    _assert_clear(r, "unknown task 'nope'")


def test_unknown_key():
    r = run_job(["--config", "configs/tiny.yaml", "train.num_stepz=3"], timeout=60)
    _assert_clear(r, "train.num_stepz: unknown key")


def test_model_path_not_a_model(tmp_path):
    r = run_job(["--config", "configs/tiny.yaml", f"model.path={tmp_path}"], timeout=60)
    _assert_clear(r, "is not a HF model folder")


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = run_job(
            ["--config", "configs/tiny.yaml", f"run_dir={tmp_path}", f"comm.master_port={port}"],
            timeout=60,
        )
    _assert_clear(r, f"port {port} on 127.0.0.1 is already in use")


def test_incomplete_cache_is_never_used(tmp_path, monkeypatch):
    """A cache folder without a valid COMPLETE marker is rebuilt, never loaded."""
    gguf = model_store.packaged_gguf()
    digest = model_store._digest(gguf)
    target = tmp_path / f"smollm2-135m-instruct-{digest}"
    target.mkdir()
    (target / "config.json").write_text("{}")  # half-written: no marker
    (target / model_store.MARKER).write_text("not json")
    calls = []

    def fake_convert(src, out):  # the real conversion is covered by the SmolLM2 e2e test
        calls.append(out)
        (Path(out) / "config.json").write_text(json.dumps({"ok": True}))

    monkeypatch.setattr(model_store, "_convert", fake_convert)
    path = model_store.ensure_smollm2(tmp_path)
    assert calls and path == target
    assert json.loads((target / "config.json").read_text()) == {"ok": True}
    assert model_store._is_complete(target, digest)
    # complete now: a second call converts nothing
    model_store.ensure_smollm2(tmp_path)
    assert len(calls) == 1


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def broken(src, out):
        (Path(out) / "partial.bin").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(model_store, "_convert", broken)
    with pytest.raises(model_store.ModelStoreError, match="disk full"):
        model_store.ensure_smollm2(tmp_path)
    assert not any(tmp_path.iterdir())


def _rank_pids(launcher_pid):
    pids = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != launcher_pid:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                pids[int(kv[5:])] = int(d.name)
    return pids


def test_a_rank_that_dies_stops_the_job(tmp_path):
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verl_ppo.train",
            "--config",
            "configs/tiny.yaml",
            f"run_dir={tmp_path}",
            "train.num_steps=1000",
            "data.eval_size=0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not metrics.exists() and time.monotonic() < deadline:
            assert p.poll() is None, p.communicate()[1][-2000:]
            time.sleep(0.5)
        pids = _rank_pids(p.pid)
        assert set(pids) == {0, 1}
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert "rank 1 was killed by signal 9" in err
    assert "Traceback" not in err
