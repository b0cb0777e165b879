"""train.logger backends: TensorBoard events equal the JSONL; wandb offline stays off the network."""

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.verl_ppo._run import ROOT
from verl_ppo.config import ConfigError, build_config
from verl_ppo.observe.tracking import (
    JsonlLogger,
    TensorBoardLogger,
    Tracking,
    missing_backends,
    wandb_mode,
)


def _jsonl(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (purged events dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def assert_tensorboard_matches_jsonl(run_dir):
    """Every finite numeric JSONL value is a TensorBoard scalar of the same name and step
    (as float32, TensorBoard's storage type), and TensorBoard holds nothing else."""
    want: dict[str, list[tuple[int, float]]] = {}
    for rec in _jsonl(run_dir):
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                want.setdefault(k, []).append((rec["step"], float(np.float32(v))))
    got = tensorboard_scalars(Path(run_dir) / "tensorboard")
    assert got == want


def test_tensorboard_events_equal_jsonl_across_a_resume(tmp_path):
    rng = np.random.default_rng(0)

    def tracking(resume_step):
        return Tracking(
            [JsonlLogger(tmp_path, resume_step), TensorBoardLogger(tmp_path, resume_step)]
        )

    t = tracking(0)
    t.log({"eval/reward": 0.25}, step=0)
    for step in range(1, 5):
        t.log(
            {"timing_s/gen": float(rng.random()), "reward/mean": step / 7, "x": float("nan")}, step
        )
    t.close()
    # resume at step 2: steps 3-4 run again with other values; both backends drop the old ones
    t = tracking(2)
    for step in (3, 4):
        t.log({"timing_s/gen": 10.0 + step, "reward/mean": -1.0, "step": step}, step)
    t.close()
    assert [r["step"] for r in _jsonl(tmp_path)] == [0, 1, 2, 3, 4]
    assert_tensorboard_matches_jsonl(tmp_path)
    assert tensorboard_scalars(tmp_path / "tensorboard")["timing_s/gen"][-1] == (4, 14.0)


def test_logger_config_is_checked():
    assert build_config().train.logger == ["console", "jsonl"]
    with pytest.raises(ConfigError, match="train.logger"):
        build_config(**{"train.logger": ["console", "mlflow"]})
    with pytest.raises(ConfigError, match="twice"):
        build_config(**{"train.logger": ["jsonl", "jsonl"]})


def test_wandb_defaults_to_offline(monkeypatch):
    t = build_config().train
    assert (t.project_name, t.experiment_name, t.wandb_mode) == ("verl_ppo", None, None)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(None) == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's own choice is kept
    assert wandb_mode(None) == "online" and wandb_mode("disabled") == "disabled"


def test_missing_library_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    (msg,) = missing_backends(["console", "wandb"])
    assert "pip install wandb" in msg


# --------------------------------------------------------------------------- wandb
def _wandb_records(run_file: Path) -> list:
    """Records of a wandb run file: a LevelDB-log framed stream (7-byte file header
    ``:W&B`` + magic + version, 32 KiB blocks, 7-byte chunk headers crc32/len/type) of
    ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, out, buf = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def _items(items) -> dict:
    """History items as ``{name: value}`` (names with "/" are stored as ``nested_key``)."""
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


_WANDB_SCRIPT = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace
    from verl_ppo.observe.tracking import build_tracking

    # train.* as the config's defaults give them (test_wandb_defaults_to_offline), without
    # importing torch for the config tree
    train = SimpleNamespace(
        logger=["wandb"], project_name="verl_ppo", experiment_name=None, wandb_mode=None
    )
    t = build_tracking(train, sys.argv[1], 0, 0, {"seed": 0})
    for step in range(3):
        t.log({"timing_s/gen": 0.5 + step, "reward/mean": step / 10, "step": step}, step)
    t.close()
    """
)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to watch sockets")
@pytest.mark.timeout(120)
def test_wandb_offline_run_without_network(tmp_path):
    """The wandb backend with no user setting: an offline run dir holding the metrics, and
    no socket of this process or its children (wandb-core) goes to a non-loopback address."""
    trace, run_dir = tmp_path / "strace.txt", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), PYTHONPATH=ROOT)
    r = subprocess.run(
        [
            "strace",
            "-f",
            "--seccomp-bpf",
            "-qq",
            "-e",
            "trace=connect,sendto,sendmsg",
            "-o",
            str(trace),
        ]
        + [sys.executable, "-c", _WANDB_SCRIPT, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    calls = [ln for ln in trace.read_text().splitlines() if "sa_family=AF_INET" in ln]
    assert calls == [] or all(("127.0.0.1" in c or '"::1"' in c) for c in calls), calls
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (run_file,) = offline.glob("run-*.wandb")
    history = [
        {k: v for k, v in _items(rec.history.item).items() if not k.startswith("_")}
        for rec in _wandb_records(run_file)
        if rec.WhichOneof("record_type") == "history"
    ]
    assert history == [{"timing_s/gen": 0.5 + s, "reward/mean": s / 10} for s in range(3)]


def test_resume_never_moves_logger_folders_aside(tmp_path):
    """A fresh start keeps old TensorBoard events and the old wandb run id out of the new run."""
    from verl_ppo.run.folder import prepare_run_dir

    for d in ("tensorboard", "wandb"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x").write_text("old")
    moved = prepare_run_dir(tmp_path, "never")
    assert len(moved) == 2
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()
    assert sorted(p.name.split(".old-")[0] for p in tmp_path.iterdir()) == ["tensorboard", "wandb"]
