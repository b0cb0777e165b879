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
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from verl_comm.distributed import DistContext


class CheckpointManager:
    """Saves and finds checkpoints of one run.

    Args:
        run_dir: the run's directory (shared by all ranks: one host or a shared FS).
        ctx: the job's distributed context: this rank, and the barriers between the writing
            stages (each bounded by ``ctx.timeout_s``).
        group: process group of the barriers (default ``ctx.group``, every rank).
    """

    def __init__(self, run_dir: str | Path, ctx: DistContext, group: Any = None) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.ctx = ctx
        self.rank = ctx.rank
        self.group = ctx.group if group is None else group

    def _barrier(self) -> None:
        self.ctx.barrier(self.group)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None (an incomplete one is ignored)."""
        marker = self.root / "LATEST"
        if not marker.is_file():
            return None
        path = self.root / marker.read_text().strip()
        return path if (path / "COMPLETE").is_file() else None

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
