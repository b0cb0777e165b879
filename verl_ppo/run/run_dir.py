"""The run folder's lifecycle around the PPO loop: claiming ``run_dir`` (lock and
``train.resume``'s fresh-start policy), the run metadata that ``verl-ppo export``/``eval``
read, checkpoints of engines and trainer state (save, resume) and the HF export.

:class:`RunFolder` receives the engines, the KL controller and the gradient hooks whose
state it saves; :class:`verl_ppo.trainer.PPOTrainer` owns it.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from verl_comm.distributed import DistContext
from verl_ppo.config import PPOConfig
from verl_ppo.data.model_store import resolve_model_path
from verl_ppo.run.checkpoint import CheckpointManager
from verl_ppo.run.export import export_live, save_model_meta
from verl_ppo.run.folder import RunDirError, RunDirLock, prepare_run_dir


class RunFolder:
    """``run_dir``, checkpoints and export of one PPO job.

    Args:
        cfg: the config (``run_dir``, ``train.resume``, ``train.keep_last_checkpoints``,
            ``train.export_critic``; dumped to ``run_dir/config.yaml``).
        ctx: the job's distributed context (rank 0 decides, every rank learns the outcome;
            checkpoint barriers).
        log: the rank's logger.
        engines: role -> strategy, saved and restored by the checkpoints, exported to HF.
        kl_ctrl: the KL controller (its state is checkpointed).
        grad_comm: role -> active gradient-communication handle (error-feedback state is
            checkpointed).
        policy_config: the policy's HF config (``run_dir/model_config``).
        cuda: the run is on CUDA (its RNG state is checkpointed too).
    """

    def __init__(
        self,
        cfg: PPOConfig,
        ctx: DistContext,
        log: logging.Logger,
        *,
        engines: dict[str, Any],
        kl_ctrl: Any,
        grad_comm: dict[str, Any],
        policy_config: Any,
        cuda: bool,
    ) -> None:
        self.config, self.ctx, self.log = cfg, ctx, log
        self.rank, self.world, self.group = ctx.rank, ctx.world_size, ctx.group
        self.engines, self.kl_ctrl, self.grad_comm = engines, kl_ctrl, grad_comm
        self.policy_config, self.cuda = policy_config, cuda
        self.ckpt = CheckpointManager(
            cfg.run_dir, ctx, ctx.group, keep_last=cfg.train.keep_last_checkpoints
        )
        self._lock: RunDirLock | None = None

    def claim(self) -> None:
        """Lock ``run_dir`` and apply ``train.resume``'s fresh-start policy, unless our
        launcher already did (it holds the lock for the ranks). Rank 0 decides; every rank
        raises the same error (collective)."""
        cfg = self.config
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

    def write_meta(self) -> None:
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
        folders under ``run_dir/hf`` (collective; see :mod:`verl_ppo.run.export`)."""
        want_critic = self.config.train.export_critic if critic is None else critic
        return export_live(self.engines, self.rank, self.config.run_dir, critic=want_critic)

    def _trainer_state(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {
            "step": step,
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

    def save(self, step: int) -> Path:
        """Atomic checkpoint of engines and trainer state at ``step`` (collective)."""
        return self.ckpt.save(step, self.engines, self._trainer_state(step))

    def resume(self) -> int:
        """Restore the newest verified checkpoint (engines, KL controller, RNG states,
        gradient hooks), logging each newer one skipped and why; returns its step, or 0
        when there is none (collective: every rank loads the same step)."""
        path, skipped = self.ckpt.resume_point()  # verified; every rank the same
        for line in skipped:
            self.log.warning("%s", line)
        if path is None:
            return 0
        state = self.ckpt.load(path, self.engines)
        step = int(state["step"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        torch.set_rng_state(state["torch_rng"])
        if self.cuda and "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"])
        py = random.getstate()
        random.setstate((py[0], tuple(state["python_rng"]), py[2]))
        for role, handle in self.grad_comm.items():
            if f"grad_comm/{role}" in state and hasattr(handle, "load_state_dict"):
                handle.load_state_dict(state[f"grad_comm/{role}"])
        self.log.info("resumed from %s at step %d", path, step)
        return step
