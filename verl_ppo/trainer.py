"""The PPO trainer: a short loop of named, timed phases.

rollout (reshard -> gen -> reward) -> old_log_prob -> ref -> values -> adv -> update_critic
-> update_actor

Each rank makes its share of the global rollout batch (:mod:`verl_ppo.experience_maker`);
the actor and critic are DeepSpeed engines whose gradients are reduced across the
data-parallel ranks (by DeepSpeed, or by verl_comm's hooks when ``gradient_compression`` is
set: each :class:`~verl_ppo.strategy.DeepSpeedStrategy` owns its handle). The PPO maths comes
from the registries of :mod:`verl_ppo.algorithms`. Metrics are averaged over ranks and
written by rank 0.

The trainer holds one :class:`~verl_comm.distributed.DistContext` and passes its group and
``timeout_s`` (``comm.timeout_s``, the one source of every deadline) to everything that
communicates: the gradient reducers, the metric and evaluation reductions, the reward
(waiting for async scores, a remote reward's deadline) and the checkpoint barriers.

This module holds the public API (construction, :meth:`PPOTrainer.setup`,
:meth:`PPOTrainer.run`, :meth:`PPOTrainer.close`, launching the ranks from a plain process);
the class's other parts are mixins, one idea each: :mod:`verl_ppo.trainer_build` (roles,
engines, token budget, reward), :mod:`verl_ppo.trainer_step` (the step's phases, metric
reduction, evaluation) and :mod:`verl_ppo.trainer_run_dir` (run folder claim and metadata,
checkpoint save/resume, HF export).
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from verl_comm.compression.policy import describe_choices
from verl_comm.profiler import VerlProfiler
from verl_comm.telemetry import CommRecorder
from verl_ppo.algorithms import make_kl_controller
from verl_ppo.checkpoint import CheckpointManager
from verl_ppo.config import PPOConfig, build_config, load_config
from verl_ppo.data.tasks import Task
from verl_ppo.distributed import ensure_process_group, environment_findings
from verl_ppo.experience_maker import ExperienceMaker
from verl_ppo.launch import launch
from verl_ppo.metrics import get_logger
from verl_ppo.models import load_tokenizer
from verl_ppo.monitor import PrometheusMonitor
from verl_ppo.pipeline.checks import check_pipeline_world, pipeline_degree
from verl_ppo.report import RunSummary, format_samples
from verl_ppo.reshard.hybrid import HybridEngine
from verl_ppo.run_folder import StopRequest
from verl_ppo.tracking import build_tracking
from verl_ppo.trainer_build import TrainerBuildMixin, _resolve_dtype
from verl_ppo.trainer_run_dir import TrainerRunDirMixin
from verl_ppo.trainer_step import SAMPLES_SHOWN, TrainerStepMixin

__all__ = ["PPOTrainer", "SAMPLES_SHOWN"]


class PPOTrainer(TrainerBuildMixin, TrainerStepMixin, TrainerRunDirMixin):
    """PPO on a causal LM with DeepSpeed actor/critic engines.

    Args:
        config: a :class:`PPOConfig`, a dict, a YAML path, or None (all defaults).
        **overrides: keyword overrides of config fields, e.g.
            ``gradient_compression="int8"``, ``compression_rank=64``, ``seed=1`` or dotted
            paths ``**{"train.num_steps": 3}``.

    :meth:`run` in a plain process (no torchrun variables, no process group) launches
    ``comm.nproc`` ranks exactly as ``verl-ppo train`` does and waits for them
    (:func:`verl_ppo.launch.launch`); with ``comm.nproc=1`` it trains in this process.
    Under torchrun, our launcher or an existing process group it trains in-process as one
    rank of that group. A world of one rank with ``gradient_compression`` set warns that
    nothing is communicated.

    Raises:
        verl_ppo.config.ConfigError: invalid configuration (before any process group).
    """

    def __init__(self, config: PPOConfig | dict | str | Path | None = None, **overrides: Any):
        if isinstance(config, (str, Path)):
            config = load_config(config)
        if isinstance(config, PPOConfig):
            config = config.model_dump(by_alias=True)
        self.config: PPOConfig = build_config(config or {}, **overrides)
        self._ready = False
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.stopped_by = 0  # the signal that stopped the last run (0 = none)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build models, engines, task and reward (collective across ranks)."""
        cfg = self.config
        self._t_setup = time.time()
        if "WORLD_SIZE" in os.environ:  # layouts against the world, before any group starts
            check_pipeline_world(cfg, int(os.environ["WORLD_SIZE"]))
        self.ctx, self._owns_group = ensure_process_group(cfg)
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.group = self.ctx.group  # data-parallel group: every rank
        self.log = get_logger(self.rank)
        if self.rank == 0:
            for line in environment_findings():
                self.log.warning("environment %s", line)
        self.cuda = torch.cuda.is_available()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )
        self.dtype = _resolve_dtype(cfg.amp_dtype, self.cuda)
        self.d = cfg.derived(self.world)
        random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed)

        self.recorder = CommRecorder()
        self.profiler = VerlProfiler.from_config(
            cfg.profiler, recorder=self.recorder, rank=self.rank
        )
        self.tokenizer = load_tokenizer(cfg.model)
        self.task = Task(
            cfg.data.task,
            train_size=cfg.data.train_size,
            eval_size=cfg.data.eval_size,
            seed=cfg.seed,
            overrides=cfg.data.task_kwargs,
        )
        self.reward_model = self._build_reward()
        self.pipeline: Any = None
        if pipeline_degree(cfg) > 1:  # PP x DP on DeepSpeed's pipeline engine
            self._build_pipeline_roles()
        else:
            self._build_roles()
        self.hybrid = None
        he = cfg.actor.model_config_.hybrid_engine
        if he.enable:
            self.hybrid = HybridEngine.build(
                self.policy_config,
                he,
                self.actor.strategy.layout,  # the layout the engine really runs
                ctx=self.ctx,
                recorder=self.recorder,
            )
        self.experience_maker = ExperienceMaker(
            cfg,
            self.d,
            self.tokenizer,
            self.task,
            self.actor,
            self.reward_model,
            rank=self.rank,
            world_size=self.world,
            device=self.device,
            timeout_s=self.ctx.timeout_s,
            hybrid=self.hybrid,
            profiler=self.profiler,
            use_cuda_graph=self.fast.use_cuda_graph,
        )
        self.monitor = None
        if cfg.monitor.prometheus_port is not None:
            self.monitor = PrometheusMonitor(
                cfg.monitor.prometheus_port,
                cfg.monitor.prometheus_host,
                rank=self.rank,
                device=self.device,
            )
            if self.rank == 0:
                self.log.info("prometheus metrics on %s", self.monitor.url)
        kl = cfg.algorithm.kl
        self.kl_ctrl = make_kl_controller(kl.controller, kl.kl_coef, kl.target_kl, kl.horizon)
        self._claim_run_dir()
        keep = cfg.train.keep_last_checkpoints
        if self.rank == 0:
            self._write_run_meta()
        self.ckpt = CheckpointManager(cfg.run_dir, self.ctx, self.group, keep_last=keep)
        if cfg.train.resume == "auto":
            self._maybe_resume()
        self.tracking = build_tracking(
            cfg.train,
            cfg.run_dir,
            self.rank,
            self.step,
            cfg.model_dump(by_alias=True),
            comm_method=cfg.compression.gradient_compression,
        )
        self._ready = True

    # ------------------------------------------------------------------- run
    def run(self, num_steps: int | None = None) -> list[dict[str, float]]:
        """Train until step ``num_steps`` (default ``train.num_steps``); returns the logged
        metrics of this call's steps. Evaluates at the start and end (printing a few sampled
        prompt/response/reward triples), checkpoints at the end, ends with one summary line.

        In a plain process with ``comm.nproc > 1`` this launches the ranks (see the class
        docstring) and returns the steps they wrote to ``run_dir/metrics.jsonl``.
        SIGINT/SIGTERM stop the run at the next step boundary after a checkpoint
        (:attr:`stopped_by` then holds the signal).

        Raises:
            RuntimeError: the launched ranks failed (exit code and message named).
        """
        if not self._ready and self._should_launch():
            return self._launch(num_steps)
        if not self._ready:
            self.setup()
        cfg = self.config
        method = cfg.compression.gradient_compression
        summary = RunSummary(method, cfg.compression.start_iter, self.world)
        t0 = float(os.environ.get("VERL_PPO_T0", self._t_setup))
        total = num_steps if num_steps is not None else cfg.train.num_steps
        want_eval = cfg.data.eval_size > 0
        if want_eval and self.step == 0:
            samples: list = []
            e0 = self.evaluate(samples)
            summary.eval_start = e0
            self.tracking.log({"eval/reward": e0}, step=0)
            self.log.info("%s", format_samples("held-out samples at step 0 (greedy):", samples))
        elif self.step >= total:
            self.log.warning(
                "%s already holds step %d of %d: nothing to train (raise train.num_steps to "
                "continue, or train.resume=never to start over)",
                cfg.run_dir,
                self.step,
                total,
            )
        elif self.step:
            self.log.info("resuming at step %d of %d", self.step, total)
        stop = StopRequest().install()
        bar = tqdm(
            total=total, initial=self.step, disable=self.rank != 0, desc="ppo", dynamic_ncols=True
        )
        out = []
        saved_at = -1
        said: dict[str, str] = {}  # role -> policy auto's choice, logged when it changes
        self.profiler.start(first_step=self.step + 1)  # numbered as in the log
        try:
            while self.step < total:
                self.stopped_by = stop.agreed(self.ctx, self.group)
                if self.stopped_by:
                    break
                m = self.train_step(self.step)
                self.profiler.step()
                self.step += 1
                summary.observe(m)
                if want_eval and (
                    self.step == total
                    or (cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0)
                ):
                    samples = []
                    m["eval/reward"] = self.evaluate(samples if self.step == total else None)
                    summary.eval_end = m["eval/reward"]
                m["step"] = self.step
                self.history.append(m)
                out.append(m)
                if self.step % cfg.train.log_interval == 0 or self.step == total:
                    self.tracking.log(m, step=self.step)
                for role, h in self.grad_comm.items():
                    note = describe_choices(getattr(h.hook_state, "buckets", {}))
                    if note and said.get(role) != note:
                        said[role] = note
                        self.log.info("policy auto (%s): %s", role, note)
                if cfg.train.save_interval and self.step % cfg.train.save_interval == 0:
                    self.save_checkpoint()
                    saved_at = self.step
                bar.update(1)
        finally:
            stop.restore()
            bar.close()
        if self.profiler.stop() is not None and self.rank == 0:
            self.log.info(
                "profile in %s; read it with: verl-comm profile report %s",
                self.profiler.output_dir,
                self.profiler.output_dir,
            )
        if out and saved_at != self.step:
            t_save = time.perf_counter()
            path = self.save_checkpoint()
            self.log.info("checkpoint %s (%.1f s)", path, time.perf_counter() - t_save)
        if cfg.train.export_hf and out and not self.stopped_by:
            for role, path in self.export_hf().items():
                self.log.info("%s exported to %s (AutoModel*.from_pretrained)", role, path)
        if self.stopped_by:
            self.log.warning(
                "signal %d: stopped after step %d with a checkpoint; run the same command to "
                "resume",
                self.stopped_by,
                self.step,
            )
        elif want_eval and summary.eval_end is not None:
            self.log.info("%s", format_samples(f"held-out samples at step {self.step}:", samples))
        notice = summary.never_compressed()
        if notice and self.rank == 0:
            self.log.warning("%s", notice)
        if self.rank == 0:
            self.log.info("%s", summary.line(time.time() - t0, self.stopped_by))
        return out

    def _should_launch(self) -> bool:
        """True in a plain process (no process group, no torchrun/launcher variables) asked
        for more than one rank."""
        plain = not dist.is_initialized() and not (
            "RANK" in os.environ and "WORLD_SIZE" in os.environ
        )
        return plain and self.config.comm.nproc > 1

    def _launch(self, num_steps: int | None) -> list[dict[str, float]]:
        """Launch ``comm.nproc`` ranks as ``verl-ppo train`` does; their logged steps."""
        cfg = self.config
        if num_steps is not None:
            cfg = cfg.model_copy(
                update={"train": cfg.train.model_copy(update={"num_steps": num_steps})}
            )
        metrics = Path(cfg.run_dir) / "metrics.jsonl"
        code = launch(cfg, None, [])
        if code in (130, 143):
            self.stopped_by = code - 128
        elif code:
            raise RuntimeError(
                f"verl-ppo: the {cfg.comm.nproc} launched ranks failed (exit code {code}); "
                f"see the message above and {cfg.run_dir}/error_rank*.txt"
            )
        text = metrics.read_text() if metrics.is_file() else ""  # no jsonl in train.logger
        rows = [json.loads(x) for x in text.splitlines() if x.strip()]
        out = [r for r in rows if "reward/mean" in r]
        self.step = max((r["step"] for r in out), default=self.step)
        self.history.extend(out)
        return out

    def close(self) -> None:
        """Free engines and tear the process group down if this trainer created it."""
        if getattr(self, "experience_maker", None) is not None:
            self.experience_maker.close()
        if getattr(self, "monitor", None) is not None:
            self.monitor.close()
        if getattr(self, "tracking", None) is not None:
            self.tracking.close()
        for attr in ("actor", "critic", "reference", "engines", "hybrid", "experience_maker"):
            if hasattr(self, attr):
                setattr(self, attr, None)
        gc.collect()
        if getattr(self, "_owns_group", False):
            self.ctx.destroy()
