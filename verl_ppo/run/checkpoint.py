"""Atomic checkpoints: written aside, renamed into place, then marked as the latest.

Layout under ``run_dir/checkpoints``::

    step_000012/            one complete checkpoint
        actor/ critic/      DeepSpeed checkpoints (model + optimizer), tag = role name
        trainer_rank{r}.pt  per-rank trainer state (step, data position, KL controller,
                            compression state, RNG states): tensors and plain types only,
                            loaded with ``torch.load(weights_only=True)``
        COMPLETE            JSON marker written last, before the rename: the step, the
                            world size and every file's size and SHA-256
    LATEST                  name of the newest complete checkpoint (replaced atomically)

A crash mid-write leaves a ``.tmp-step_*`` folder that is never loaded (and is removed by
the next save); ``LATEST`` only ever names folders that hold ``COMPLETE``.

Verified resume: a checkpoint is complete only when every rank has written its files (a
barrier) and rank 0 has read each one back into the marker's checksums. On resume rank 0
checks the candidates newest first against their markers (:func:`verify_checkpoint`),
names each one it skips and why, and broadcasts its choice, so every rank loads the same
step or none does (:meth:`CheckpointManager.resume_point`).

Rotation (``train.keep_last_checkpoints``, default 2): after ``LATEST`` names the new
checkpoint, rank 0 removes the oldest complete ``step_*`` folders beyond the newest ``keep``
(never the one ``LATEST`` names). Two, not one: a crash while the newest is being written
still leaves the previous one, and the one before can be compared against.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.distributed import DistContext


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint ``root/LATEST`` names, or None (an incomplete one is ignored)."""
    marker = root / "LATEST"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if (path / "COMPLETE").is_file() else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and (p / "COMPLETE").is_file())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under ``folder``
    (the marker itself excluded), read back from disk."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "COMPLETE":
            out[p.relative_to(folder).as_posix()] = {
                "size": p.stat().st_size,
                "sha256": _sha256(p),
            }
    return out


def verify_checkpoint(path: Path, world_size: int | None = None) -> str | None:
    """Check a checkpoint folder against its ``COMPLETE`` marker.

    Args:
        path: a ``step_*`` folder.
        world_size: the resuming job's ranks (checked against the marker when given).

    Returns:
        None when intact, else why not (the first problem found, naming the file).
        A marker written before checksums existed (no ``files``) passes on presence alone.
    """
    try:
        marker = json.loads((path / "COMPLETE").read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable COMPLETE marker ({exc})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if files is None:
        return None
    written = marker.get("world_size")
    if world_size is not None and written is not None and written != world_size:
        return f"written by {written} ranks, this job has {world_size}"
    for rel, want in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{rel} holds {size} bytes, {want['size']} were written"
        if _sha256(f) != want["sha256"]:
            return f"{rel} does not match its SHA-256 checksum"
    return None


def pick_checkpoint(root: Path, world_size: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under ``root`` and a line per newer one skipped.

    Raises:
        CheckpointError: complete checkpoints exist but none is intact.
    """
    skipped = []
    candidates = complete_checkpoints(root)
    for path in reversed(candidates):
        problem = verify_checkpoint(path, world_size)
        if problem is None:
            return path, skipped
        skipped.append(f"checkpoint {path.name} skipped: {problem}")
    if candidates:
        raise CheckpointError(
            f"no intact checkpoint in {root}: " + "; ".join(skipped) + ". Start over with "
            "train.resume=never (the damaged ones are moved aside), or choose another run_dir"
        )
    return None, skipped


class CheckpointError(RuntimeError):
    """No checkpoint of the run can be resumed; the message names each one and why."""


def rotate_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Remove complete checkpoints beyond the newest ``keep_last`` (0 = keep all), never the
    one ``LATEST`` names (``train.keep_last_checkpoints``; called by rank 0 after a save).

    Returns:
        The removed folders.
    """
    if keep_last <= 0:
        return []
    latest = latest_checkpoint(root)
    old = [p for p in complete_checkpoints(root)[:-keep_last] if p != latest]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


class CheckpointManager:
    """Saves and finds checkpoints of one run.

    Args:
        run_dir: the run's directory (shared by all ranks: one host or a shared FS).
        ctx: the job's distributed context: this rank, and the barriers between the writing
            stages (each bounded by ``ctx.timeout_s``).
        group: process group of the barriers (default ``ctx.group``, every rank).
        keep_last: complete checkpoints kept after each save (0 = all), see
            :func:`rotate_checkpoints`.
    """

    def __init__(
        self, run_dir: str | Path, ctx: DistContext, group: Any = None, keep_last: int = 0
    ) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.ctx = ctx
        self.rank = ctx.rank
        self.group = ctx.group if group is None else group
        self.keep_last = keep_last

    def _barrier(self) -> None:
        self.ctx.barrier(self.group)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None (an incomplete one is ignored)."""
        return latest_checkpoint(self.root)

    def resume_point(self) -> tuple[Path | None, list[str]]:
        """The checkpoint every rank resumes from (collective): rank 0 verifies the
        candidates newest first (:func:`pick_checkpoint`) and broadcasts its choice.

        Returns:
            ``(folder or None, lines naming each checkpoint skipped and why)``; the lines
            are rank 0's (empty elsewhere).

        Raises:
            CheckpointError: on every rank, when no complete checkpoint is intact.
        """
        box: list[Any] = [None, []]
        if self.rank == 0:
            try:
                path, skipped = pick_checkpoint(self.root, self.ctx.world_size)
                box = [None if path is None else path.name, skipped]
            except CheckpointError as exc:
                box = [exc, []]
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(box, src=0, group=self.group)
        if isinstance(box[0], Exception):
            raise CheckpointError(str(box[0]))
        return (None if box[0] is None else self.root / box[0]), box[1] if self.rank == 0 else []

    def save(self, step: int, engines: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` (collective: every rank calls it).

        Args:
            engines: role name -> object with ``save(directory, tag, client_state)``.
            trainer_state: this rank's state (tensors and plain Python types only).

        Returns:
            The final checkpoint folder.
        """
        name = f"step_{step:06d}"
        tmp, final = self.root / f".tmp-{name}", self.root / name
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        for role, eng in engines.items():
            eng.save(str(tmp), tag=role, client_state={})
        torch.save(trainer_state, tmp / f"trainer_rank{self.rank}.pt")
        self._barrier()  # every rank's files are written
        if self.rank == 0:
            marker = {"step": step, "world_size": self.ctx.world_size}
            marker["files"] = file_manifest(tmp)
            (tmp / "COMPLETE").write_text(json.dumps(marker, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = self.root / "LATEST.tmp"
            latest_tmp.write_text(name)
            os.replace(latest_tmp, self.root / "LATEST")
            rotate_checkpoints(self.root, self.keep_last)
        self._barrier()
        return final

    def load(self, path: Path, engines: dict[str, Any]) -> dict[str, Any]:
        """Load the engines and this rank's trainer state from ``path``.

        Raises:
            FileNotFoundError: this rank's trainer state is missing (world size changed?).
        """
        for role, eng in engines.items():
            eng.load(str(path), tag=role)
        f = path / f"trainer_rank{self.rank}.pt"
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} missing: the checkpoint was written by a different number of ranks; "
                "resume with the same world size or set train.resume=never"
            )
        return torch.load(f, weights_only=True)
