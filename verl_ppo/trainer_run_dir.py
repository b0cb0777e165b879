"""The run folder's lifecycle around the PPO loop: claiming ``run_dir`` (lock and
``train.resume``'s fresh-start policy), the run metadata that ``verl-ppo export``/``eval``
read, checkpoints of engines and trainer state (save, resume) and the HF export.

:class:`TrainerRunDirMixin` is one part of :class:`verl_ppo.trainer.PPOTrainer`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from verl_ppo.data.model_store import resolve_model_path
from verl_ppo.export import export_live, save_model_meta
from verl_ppo.run_folder import RunDirError, RunDirLock, prepare_run_dir


class TrainerRunDirMixin:
    """``run_dir``, checkpoints and export of :class:`~verl_ppo.trainer.PPOTrainer`."""

    @property
    def grad_comm(self) -> dict[str, Any]:
        """Role -> active :class:`~verl_ppo.grad_comm.GradCommHandle` (empty when DeepSpeed
        reduces the gradients itself)."""
        return {
            role: s.grad_comm
            for role, s in self.engines.items()
            if s.grad_comm is not None and s.grad_comm.active
        }

    def _claim_run_dir(self) -> None:
        """Lock ``run_dir`` and apply ``train.resume``'s fresh-start policy, unless our
        launcher already did (it holds the lock for the ranks). Rank 0 decides; every rank
        raises the same error (collective). Warns when compression has no peer."""
        cfg = self.config
        if self.world == 1 and cfg.compression.gradient_compression != "none" and self.rank == 0:
            self.log.warning(
                "world size 1: gradient_compression=%s has no peer, nothing is communicated "
                "(launch comm.nproc >= 2 ranks: verl-ppo train, or PPOTrainer(...).run() in a "
                "plain process)",
                cfg.compression.gradient_compression,
            )
        if os.environ.get("VERL_PPO_LAUNCHED"):
            return
        error = ""
        if self.rank == 0:
            try:
                self._lock = RunDirLock(cfg.run_dir).acquire()
                dumped = cfg.model_dump(mode="json", by_alias=True)
                for line in prepare_run_dir(cfg.run_dir, cfg.train.resume, dumped):
                    self.log.info("%s", line)
            except RunDirError as exc:
                error = str(exc)
        if self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.group)
            error = box[0]
        if error:
            raise RunDirError(error)

    def _write_run_meta(self) -> None:
        """``run_dir/config.yaml`` and ``run_dir/model_config`` (what ``verl-ppo export`` and
        ``verl-ppo eval`` need besides the weights); rank 0."""
        run_dir = Path(self.config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(
            yaml.safe_dump(self.config.model_dump(mode="json", by_alias=True), sort_keys=False)
        )
        # policy_config: the HF config in both layouts (a pipeline stage has no HF module)
        save_model_meta(run_dir, self.policy_config, resolve_model_path(self.config.model.path))

    def export_hf(self, critic: bool | None = None) -> dict[str, Path]:
        """Write the actor (and the critic: ``critic`` or ``train.export_critic``) as HF
        folders under ``run_dir/hf`` (collective; see :mod:`verl_ppo.export`)."""
        want_critic = self.config.train.export_critic if critic is None else critic
        return export_live(self.engines, self.rank, self.config.run_dir, critic=want_critic)

    def _trainer_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": self.step,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": list(random.getstate()[1]),
        }
        if self.cuda:
            state["cuda_rng"] = torch.cuda.get_rng_state()
        for role, handle in self.grad_comm.items():
            if hasattr(handle, "state_dict"):
                state[f"grad_comm/{role}"] = handle.state_dict()
        return state

    def save_checkpoint(self) -> Path:
        """Atomic checkpoint of engines and trainer state at the current step (collective)."""
        return self.ckpt.save(self.step, self.engines, self._trainer_state())

    def _maybe_resume(self) -> None:
        path, skipped = self.ckpt.resume_point()  # verified; every rank the same
        for line in skipped:
            self.log.warning("%s", line)
        if path is None:
            return
        state = self.ckpt.load(path, self.engines)
        self.step = int(state["step"])
        self.resumed_from = self.step  # said by the summary line and the metric rows
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        torch.set_rng_state(state["torch_rng"])
        if self.cuda and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"])
        py = random.getstate()
        random.setstate((py[0], tuple(state["python_rng"]), py[2]))
        for role, handle in self.grad_comm.items():
            if f"grad_comm/{role}" in state and hasattr(handle, "load_state_dict"):
                handle.load_state_dict(state[f"grad_comm/{role}"])
        self.log.info("resumed from %s at step %d", path, self.step)
