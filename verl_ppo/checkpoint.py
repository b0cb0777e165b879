"""Atomic checkpoints: written aside, renamed into place, then marked as the latest.

Layout under ``run_dir/checkpoints``::

    step_000012/            one complete checkpoint
        actor/ critic/      DeepSpeed checkpoints (model + optimizer), tag = role name
        trainer_rank{r}.pt  per-rank trainer state (step, data position, KL controller,
                            compression state, RNG states): tensors and plain types only,
                            loaded with ``torch.load(weights_only=True)``
        COMPLETE            JSON marker written last, before the rename
    LATEST                  name of the newest complete checkpoint (replaced atomically)

A crash mid-write leaves a ``.tmp-step_*`` folder that is never loaded (and is removed by
the next save); ``LATEST`` only ever names folders that hold ``COMPLETE``.

Rotation (``train.keep_last_checkpoints``, default 2): after ``LATEST`` names the new
checkpoint, rank 0 removes the oldest complete ``step_*`` folders beyond the newest ``keep``
(never the one ``LATEST`` names). Two, not one: a crash while the newest is being written
still leaves the previous one, and the one before can be compared against.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

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
        self._barrier()
        if self.rank == 0:
            (tmp / "COMPLETE").write_text(json.dumps({"step": step}))
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
