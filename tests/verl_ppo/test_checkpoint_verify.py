"""Damaged checkpoints: sizes and checksums in the marker, the newest intact one resumed,
the skipped ones named, every rank on the same step (2 gloo ranks)."""

import json

import pytest
import torch

from verl_ppo.run.checkpoint import CheckpointError, CheckpointManager, pick_checkpoint


class _Engine:
    """Saves and loads one tensor file per role, as a DeepSpeed engine's save/load would."""

    def __init__(self, value: float) -> None:
        self.value = torch.full((64,), value)

    def save(self, directory: str, tag: str, client_state: dict) -> None:
        from pathlib import Path

        (Path(directory) / tag).mkdir(parents=True, exist_ok=True)
        torch.save(self.value, Path(directory) / tag / "model.pt")

    def load(self, directory: str, tag: str) -> None:
        from pathlib import Path

        self.value = torch.load(Path(directory) / tag / "model.pt", weights_only=True)


class _OneRank:
    """The part of a DistContext CheckpointManager uses, for one process."""

    rank, world_size, group = 0, 1, None

    def barrier(self, group=None) -> None:
        pass


def _save(run, steps, ctx=None):
    ctx = ctx or _OneRank()
    mgr = CheckpointManager(run, ctx, group=ctx.group)
    for s in steps:
        mgr.save(s, {"actor": _Engine(float(s))}, {"step": s})
    return mgr


def test_marker_holds_size_and_checksum_of_every_file(tmp_path):
    _save(tmp_path, [2])
    marker = json.loads((tmp_path / "checkpoints/step_000002/COMPLETE").read_text())
    assert marker["step"] == 2 and marker["world_size"] == 1
    assert set(marker["files"]) == {"actor/model.pt", "trainer_rank0.pt"}
    f = tmp_path / "checkpoints/step_000002/trainer_rank0.pt"
    assert marker["files"]["trainer_rank0.pt"]["size"] == f.stat().st_size


def test_truncated_newest_is_skipped_and_named(tmp_path):
    mgr = _save(tmp_path, [2, 4])
    f = tmp_path / "checkpoints/step_000004/trainer_rank0.pt"
    f.write_bytes(f.read_bytes()[:100])  # truncated
    path, skipped = mgr.resume_point()
    assert path.name == "step_000002"
    assert skipped == [
        f"checkpoint step_000004 skipped: trainer_rank0.pt holds 100 bytes, "
        f"{json.loads((f.parent / 'COMPLETE').read_text())['files']['trainer_rank0.pt']['size']}"
        " were written"
    ]
    state = mgr.load(path, {"actor": _Engine(0.0)})
    assert state["step"] == 2


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path):
    _save(tmp_path, [2, 4])
    f = tmp_path / "checkpoints/step_000004/actor/model.pt"
    data = bytearray(f.read_bytes())
    data[-40] ^= 0xFF
    f.write_bytes(bytes(data))
    path, skipped = pick_checkpoint(tmp_path / "checkpoints")
    assert path.name == "step_000002"
    assert "actor/model.pt does not match its SHA-256 checksum" in skipped[0]


def test_no_intact_checkpoint_is_refused_with_the_way_out(tmp_path):
    _save(tmp_path, [2])
    (tmp_path / "checkpoints/step_000002/actor/model.pt").unlink()
    with pytest.raises(CheckpointError, match=r"actor/model.pt is missing.*train.resume=never"):
        pick_checkpoint(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match="written by 1 ranks, this job has 2"):
        _save(tmp_path / "b", [1])
        pick_checkpoint(tmp_path / "b/checkpoints", world_size=2)


def _resume_worker(rank: int, port: int, run: str, q) -> None:
    import datetime

    import torch.distributed as dist

    from verl_comm.distributed import DistContext

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        ctx = DistContext.from_default_group(timeout_s=60)
        mgr = _save(run, [2, 4], ctx)
        ctx.barrier()
        if rank == 1:  # only rank 1's own file is damaged; rank 0 must still notice
            f = mgr.root / "step_000004" / "trainer_rank1.pt"
            f.write_bytes(f.read_bytes()[:50])
        ctx.barrier()
        path, skipped = mgr.resume_point()
        state = mgr.load(path, {"actor": _Engine(0.0)})
        q.put((rank, int(state["step"]), skipped))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_agree_on_the_step_before_loading(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_resume_worker, args=(r, port, str(tmp_path), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = {r: (step, skipped) for r, step, skipped in (q.get(timeout=90) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert res[0][0] == res[1][0] == 2  # no half-resume: both ranks on step 2
    assert "step_000004 skipped: trainer_rank1.pt holds 50 bytes" in res[0][1][0]
    assert res[1][1] == []  # rank 0 says it once


def test_export_refuses_a_damaged_checkpoint(tmp_path):
    from verl_ppo.run.export import ExportError, find_checkpoint

    _save(tmp_path, [2, 4])
    (tmp_path / "checkpoints/step_000004/actor/model.pt").write_bytes(b"")
    with pytest.raises(ExportError, match=r"step_000004 is damaged: actor/model.pt holds 0 bytes"):
        find_checkpoint(tmp_path)
    assert find_checkpoint(tmp_path, 2).name == "step_000002"
