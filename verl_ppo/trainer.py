"""The PPO trainer: a short loop of named, timed phases.

rollout (reshard -> gen -> reward) -> old_log_prob -> ref -> values -> adv -> update_critic
-> update_actor

Each rank makes its share of the global rollout batch (:mod:`verl_ppo.step.experience_maker`);
the actor and critic are DeepSpeed engines whose gradients are reduced across the
data-parallel ranks (by DeepSpeed, or by verl_comm's hooks when ``gradient_compression`` is
set: each :class:`~verl_ppo.workers.strategy.DeepSpeedStrategy` owns its handle). The PPO maths comes
from the registries of :mod:`verl_ppo.algorithms`. Metrics are averaged over ranks and
written by rank 0.

The trainer holds one :class:`~verl_comm.distributed.DistContext` and passes its group and
``timeout_s`` (``comm.timeout_s``, the one source of every deadline) to everything that
communicates: the gradient reducers, the metric and evaluation reductions, the reward
(waiting for async scores, a remote reward's deadline) and the checkpoint barriers.

:class:`PPOTrainer` reads as setup / run / close. :meth:`~PPOTrainer.setup` resolves the
job once (:func:`verl_ppo.job.fast_path.resolve`) and composes three parts, each given what it
needs in its constructor: :class:`~verl_ppo.workers.build.Workers` (roles, strategies,
hybrid engine, reward), :class:`~verl_ppo.step.ppo_step.PPOStep` (experience, scoring,
advantages, update, evaluation) and :class:`~verl_ppo.run.run_dir.RunFolder` (claim,
checkpoints, resume, export). This module also launches the ranks from a plain process.

With ``rollout.mode: async`` the trainer runs on the training ranks only: it joins the
training world (:func:`verl_ppo.asyncrl.world.join_world`) and gives :class:`PPOStep` an
:class:`~verl_ppo.asyncrl.train_side.AsyncExperience` (weights out, batches in from the
rollout ranks) where the colocated mode gives it the :class:`ExperienceMaker`.
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

from verl_comm.profiler import VerlProfiler
from verl_comm.telemetry import CommRecorder
from verl_ppo.algorithms import make_kl_controller
from verl_ppo.asyncrl.train_side import AsyncExperience, async_experience
from verl_ppo.asyncrl.world import join_world
from verl_ppo.config import PPOConfig, build_config, load_config
from verl_ppo.data.file_source import build_prompt_source
from verl_ppo.job.fast_path import ModelFacts, layouts, model_config_of, resolve
from verl_ppo.launch import launch
from verl_ppo.observe.metrics import get_logger, progress_bar
from verl_ppo.observe.monitor import PrometheusMonitor
from verl_ppo.observe.report import RunSummary, format_samples
from verl_ppo.observe.tracking import build_tracking
from verl_ppo.run.folder import StopRequest, logged_eval_start
from verl_ppo.run.run_dir import RunFolder
from verl_ppo.step.experience_maker import ExperienceMaker
from verl_ppo.step.ppo_step import SAMPLES_SHOWN, PPOStep
from verl_ppo.workers.build import Workers
from verl_ppo.workers.distributed import ensure_process_group, environment_findings
from verl_ppo.workers.models import load_tokenizer

__all__ = ["PPOTrainer", "SAMPLES_SHOWN"]


class PPOTrainer:
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

    After :meth:`setup`, the parts' products are readable here: ``actor``, ``critic``,
    ``reference``, ``engines``, ``pipeline``, ``hybrid``, ``policy_config`` (from the
    workers), ``experience_maker``, ``tokenizer``, ``task``, ``profiler``, ``ctx``,
    ``world``, ``d`` and ``job`` (the :class:`~verl_ppo.job.fast_path.ResolvedJob`).

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
        self.resumed_from: int | None = None  # the checkpoint step setup() loaded, if any
        self.workers: Workers | None = None
        self.ppo_step: PPOStep | None = None
        self.run_folder: RunFolder | None = None
        self.experience_maker: ExperienceMaker | None = None
        self.async_rollout: AsyncExperience | None = None
        self.monitor: PrometheusMonitor | None = None
        self.tracking: Any = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Resolve the job, build workers, step and run folder (collective across ranks)."""
        cfg = self.config
        self._t_setup = time.time()
        # every auto resolved once, from a weightless copy of the policy, before anything
        # is built; explicit settings that cannot apply fail here, before any group starts
        self.job = resolve(
            cfg, torch.cuda.is_available(), ModelFacts.of_config(model_config_of(cfg))
        )
        # async: this rank's role world (training ranks: the default group) and the bridge
        self.async_world = join_world(cfg) if cfg.rollout.mode == "async" else None
        self.ctx, self._owns_group = ensure_process_group(cfg)
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.log = get_logger(self.rank)
        self._report_environment()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.job.cuda
            else torch.device("cpu")
        )
        rollout_layout = (layouts(cfg, self.world, self.job.actor_zero_stage) or (None, None))[1]
        self.d = cfg.derived(self.world)
        random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed)
        self.recorder = CommRecorder()
        self.profiler = VerlProfiler.from_config(
            cfg.profiler, recorder=self.recorder, rank=self.rank
        )
        self.tokenizer = load_tokenizer(cfg.model)
        # a built-in task, or verl-format files (data.train_files); rank 0 logs the rows
        self.task = build_prompt_source(cfg, self.tokenizer, self.log if self.rank == 0 else None)
        w = self.workers = Workers(
            cfg, self.job, self.ctx, self.device, self.d, self.tokenizer, self.task,
            self.recorder, self.log, rollout_layout,
        )  # fmt: skip
        self.job = w.job  # with the token budget, resolved once the engines exist
        self.experience_maker = ExperienceMaker(
            cfg, self.d, self.tokenizer, self.task, w.actor, w.reward, rank=self.rank,
            world_size=self.world, device=self.device, timeout_s=self.ctx.timeout_s,
            hybrid=w.hybrid, profiler=self.profiler, use_cuda_graph=self.job.use_cuda_graph,
        )  # fmt: skip
        source: Any = self.experience_maker
        if self.async_world is not None:  # batches come from the rollout ranks
            source = self.async_rollout = async_experience(
                cfg, self.async_world, self.experience_maker, w.actor.strategy,
                w.policy_config, self.job.actor_zero_stage, self.device,
            )  # fmt: skip
        self.monitor = self._build_monitor()
        kl = cfg.algorithm.kl
        self.kl_ctrl = make_kl_controller(kl.controller, kl.kl_coef, kl.target_kl, kl.horizon)
        grad_comm = w.grad_comm()
        self.ppo_step = PPOStep(
            cfg, self.job, self.d, self.ctx, actor=w.actor, critic=w.critic,
            reference=w.reference, experience_maker=source,
            kl_ctrl=self.kl_ctrl, tokenizer=self.tokenizer, task=self.task,
            profiler=self.profiler, model_flops=w.model_flops, peaks=w.peaks,
            grad_comm=grad_comm, pipeline=w.pipeline, hybrid=w.hybrid, monitor=self.monitor,
        )  # fmt: skip
        self.run_folder = RunFolder(
            cfg, self.ctx, self.log, engines=w.engines, kl_ctrl=self.kl_ctrl,
            grad_comm=grad_comm, policy_config=w.policy_config, cuda=self.job.cuda,
        )  # fmt: skip
        self.run_folder.claim()
        if self.rank == 0:
            self.run_folder.write_meta()
        if cfg.train.resume == "auto":
            self.step = self.run_folder.resume()
            self.resumed_from = self.step or None  # said by the summary and the metric rows
        if self.async_rollout is not None:
            self.async_rollout.begin(self.step)
        self.tracking = build_tracking(
            cfg.train, cfg.run_dir, self.rank, self.step, cfg.model_dump(by_alias=True),
            comm_method=cfg.compression.gradient_compression,
        )  # fmt: skip
        self._ready = True

    def _report_environment(self) -> None:
        """Rank 0 warns about the environment and about compression without a peer."""
        if self.rank != 0:
            return
        for line in environment_findings():
            self.log.warning("environment %s", line)
        method = self.config.compression.gradient_compression
        if self.world == 1 and method != "none":
            self.log.warning(
                "world size 1: gradient_compression=%s has no peer, nothing is communicated "
                "(launch comm.nproc >= 2 ranks: verl-ppo train, or PPOTrainer(...).run() in a "
                "plain process)",
                method,
            )

    def _build_monitor(self) -> PrometheusMonitor | None:
        """The Prometheus endpoint of ``monitor.prometheus_port``, or None."""
        mc = self.config.monitor
        if mc.prometheus_port is None:
            return None
        monitor = PrometheusMonitor(
            mc.prometheus_port, mc.prometheus_host, rank=self.rank, device=self.device
        )
        if self.rank == 0:
            self.log.info("prometheus metrics on %s", monitor.url)
        return monitor

    # ------------------------------------------------------- the parts' products
    @property
    def actor(self) -> Any:
        """The actor role (None before :meth:`setup` and after :meth:`close`)."""
        return None if self.workers is None else self.workers.actor

    @property
    def critic(self) -> Any:
        """The critic role (None under GRPO)."""
        return None if self.workers is None else self.workers.critic

    @property
    def reference(self) -> Any:
        """The frozen reference policy."""
        return None if self.workers is None else self.workers.reference

    @property
    def engines(self) -> dict[str, Any] | None:
        """Role -> strategy of the trained roles."""
        return None if self.workers is None else self.workers.engines

    @property
    def pipeline(self) -> Any:
        """The pipeline roles of a PP x DP run, else None."""
        return None if self.workers is None else self.workers.pipeline

    @property
    def hybrid(self) -> Any:
        """The hybrid engine, or None."""
        return None if self.workers is None else self.workers.hybrid

    @property
    def policy_config(self) -> Any:
        """The policy's HF config."""
        return None if self.workers is None else self.workers.policy_config

    @property
    def grad_comm(self) -> dict[str, Any]:
        """Role -> active :class:`~verl_ppo.workers.grad_comm.GradCommHandle`."""
        return {} if self.workers is None else self.workers.grad_comm()

    # ------------------------------------------------------------------- step
    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step (collective); returns metrics averaged over ranks."""
        return self.ppo_step.train_step(step)

    def evaluate(self, keep: list | None = None) -> float:
        """Mean reward of greedy responses on the held-out split (collective); see
        :meth:`verl_ppo.step.ppo_step.PPOStep.evaluate`."""
        return self.ppo_step.evaluate(keep)

    def save_checkpoint(self) -> Path:
        """Atomic checkpoint of engines and trainer state at the current step (collective)."""
        return self.run_folder.save(self.step)

    def export_hf(self, critic: bool | None = None) -> dict[str, Path]:
        """Write the actor (and the critic) as HF folders under ``run_dir/hf`` (collective)."""
        return self.run_folder.export_hf(critic)

    # -------------------------------------------------------------------- run
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
        resumed = self.resumed_from
        summary = RunSummary(method, cfg.compression.start_iter, self.world, resumed)
        if resumed and self.rank == 0:  # the step-0 eval of the run being resumed
            summary.eval_start = logged_eval_start(cfg.run_dir)
        t0 = float(os.environ.get("VERL_PPO_T0", self._t_setup))
        total = num_steps if num_steps is not None else cfg.train.num_steps
        samples = self._begin(summary, total)
        out, saved_at = self._loop(summary, total, samples)
        self._finish(summary, out, saved_at, samples)
        if self.rank == 0:
            self.log.info("%s", summary.line(time.time() - t0, self.stopped_by))
        return out

    def _begin(self, summary: RunSummary, total: int) -> list:
        """The step-0 evaluation (with samples) of a fresh run, or a note on resuming."""
        samples: list = []
        if self.config.data.eval_size > 0 and self.step == 0:
            e0 = self.evaluate(samples)
            summary.eval_start = e0
            self.tracking.log({"eval/reward": e0}, step=0)
            self.log.info("%s", format_samples("held-out samples at step 0 (greedy):", samples))
        elif self.step >= total:
            self.log.warning(
                "%s already holds step %d of %d: nothing to train (raise train.num_steps to "
                "continue, or train.resume=never to start over)",
                self.config.run_dir,
                self.step,
                total,
            )
        elif self.step:
            self.log.info("resuming at step %d of %d", self.step, total)
        return samples

    def _loop(
        self, summary: RunSummary, total: int, samples: list
    ) -> tuple[list[dict[str, float]], int]:
        """Steps until ``total`` or a stop signal: train, evaluate, log, save on interval.
        Returns the logged metrics and the step of the last interval checkpoint (-1: none);
        ``samples`` receives the last evaluation's samples."""
        cfg = self.config
        want_eval = cfg.data.eval_size > 0
        stop = StopRequest().install()
        bar = progress_bar(total, "ppo", initial=self.step, enabled=self.rank == 0)
        out: list[dict[str, float]] = []
        saved_at = -1
        said: dict[str, str] = {}  # role -> policy auto's choice, logged when it changes
        self.profiler.start(first_step=self.step + 1)  # numbered as in the log
        try:
            while self.step < total:
                self.stopped_by = stop.agreed(self.ctx, self.ctx.group)
                if self.stopped_by:
                    break
                m = self.train_step(self.step)
                self.profiler.step()
                self.step += 1
                summary.observe(m)
                if summary.resumed_at:
                    m["run/resumed_from_step"] = summary.resumed_at
                if want_eval and (
                    self.step == total
                    or (cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0)
                ):
                    samples.clear()
                    m["eval/reward"] = self.evaluate(samples if self.step == total else None)
                    summary.eval_end = m["eval/reward"]
                m["step"] = self.step
                self.history.append(m)
                out.append(m)
                if self.step % cfg.train.log_interval == 0 or self.step == total:
                    self.tracking.log(m, step=self.step)
                for role, h in self.grad_comm.items():
                    auto_note = getattr(h.hook_state, "auto_note", None)
                    note = auto_note() if auto_note is not None else None
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
        return out, saved_at

    def _finish(self, summary: RunSummary, out: list, saved_at: int, samples: list) -> None:
        """Profile note, final checkpoint and export, the closing samples and notices."""
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
        if self.config.train.export_hf and out and not self.stopped_by:
            for role, path in self.export_hf().items():
                self.log.info("%s exported to %s (AutoModel*.from_pretrained)", role, path)
        if self.stopped_by:
            self.log.warning(
                "signal %d: stopped after step %d with a checkpoint; run the same command to "
                "resume",
                self.stopped_by,
                self.step,
            )
        elif self.config.data.eval_size > 0 and summary.eval_end is not None:
            self.log.info("%s", format_samples(f"held-out samples at step {self.step}:", samples))
        notice = summary.never_compressed()
        if notice and self.rank == 0:
            self.log.warning("%s", notice)

    def _should_launch(self) -> bool:
        """True in a plain process (no process group, no torchrun/launcher variables) asked
        for more than one rank."""
        plain = not dist.is_initialized() and not (
            "RANK" in os.environ and "WORLD_SIZE" in os.environ
        )
        return plain and (self.config.comm.nproc > 1 or self.config.rollout.mode == "async")

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
        elif code == 2:  # launch(): a preflight or run-folder refusal, no rank started
            raise RuntimeError("verl-ppo: refused before any rank started; see the message above")
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
        maker = self.async_rollout or self.experience_maker  # the async source closes both
        for part in (maker, self.monitor, self.tracking):
            if part is not None:
                part.close()
        # the run_dir lock (a file descriptor) stays held until the process ends, as before
        self.workers = self.experience_maker = self.ppo_step = self.run_folder = None
        self.async_rollout = None
        gc.collect()
        if getattr(self, "_owns_group", False):
            self.ctx.destroy()
