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
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from verl_comm.profiler import VerlProfiler
from verl_comm.telemetry import CommRecorder
from verl_ppo.algorithms import (
    ADV_ESTIMATORS,
    REWARD_SHAPERS,
    explained_variance,
    make_kl_controller,
    masked_mean,
)
from verl_ppo.checkpoint import CheckpointManager
from verl_ppo.config import PPOConfig, build_config, load_config
from verl_ppo.data.model_store import resolve_model_path
from verl_ppo.data.tasks import Task
from verl_ppo.distributed import ensure_process_group, environment_findings
from verl_ppo.experience import Experience
from verl_ppo.experience_maker import ExperienceMaker, rollout_metrics
from verl_ppo.export import export_live, save_model_meta
from verl_ppo.fast_path import (
    BUDGET_FRACTION,
    token_budget_from_free_memory,
    training_bytes_per_token,
)
from verl_ppo.fast_path import resolve as resolve_fast_path
from verl_ppo.launch import launch
from verl_ppo.metrics import PhaseTimer, get_logger
from verl_ppo.models import (
    build_policy,
    build_value_model,
    check_uniform_dtype,
    load_tokenizer,
)
from verl_ppo.monitor import PrometheusMonitor
from verl_ppo.perf import ModelFlops, device_peaks, phase_perf
from verl_ppo.pipeline.build import build_pipeline_roles, pipeline_fast_path
from verl_ppo.pipeline.checks import check_pipeline_world, pipeline_degree
from verl_ppo.report import RunSummary, Sample, format_samples
from verl_ppo.reshard.hybrid import HybridEngine
from verl_ppo.reward import build_reward_model
from verl_ppo.reward.base import RewardModel
from verl_ppo.reward.cache import CachedReward
from verl_ppo.reward.rule import RuleReward
from verl_ppo.roles import Actor, Critic, Reference
from verl_ppo.run_folder import RunDirError, RunDirLock, StopRequest, prepare_run_dir
from verl_ppo.strategy import DeepSpeedStrategy, ds_config
from verl_ppo.tracking import build_tracking

SAMPLES_SHOWN = 3  # held-out prompt/response/reward triples printed at start and end


def _resolve_dtype(name: str, cuda: bool) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


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

    def _build_roles(self) -> None:
        """Actor, reference and (for GAE) critic; each trained role's strategy owns its
        DeepSpeed engine and gradient communication (collective)."""
        cfg = self.config
        policy = build_policy(cfg.model, self.tokenizer, self.dtype, cfg.seed).to(self.device)
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        ref_model = copy.deepcopy(policy)
        check_uniform_dtype(policy, self.dtype, "actor")
        self.policy_config = policy.config
        self.fast = resolve_fast_path(cfg, self.cuda, policy)
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        # copied before the actor engine exists: ZeRO-3 partitions the policy's parameters
        # in place, and a copy made afterwards holds empty (numel 0) tensors
        value_model = None
        if self.use_critic:
            value_model = build_value_model(policy, self.dtype).to(self.device)
        engines_cfg = dict(
            micro_batch_size=self.d.local_micro_batch_size,
            grad_accum_steps=self.d.grad_accum_steps,
            world_size=self.world,
            bf16=self.dtype == torch.bfloat16,
        )
        actor_strategy = self._strategy(cfg.actor, engines_cfg)
        actor_strategy.init(policy)
        packing, fused = self.fast.sequence_packing, self.fast.fused_log_probs
        budget = cfg.train.max_tokens_per_micro_batch
        budget = None if budget == "auto" else budget  # sized below, once the engines exist
        self.actor = Actor(
            actor_strategy,
            cfg.algorithm,
            self.d.local_micro_batch_size,
            cfg.rollout.temperature,
            group=self.group,
            packing=packing,
            max_tokens_per_micro_batch=budget,
            fused=fused,
        )
        self.reference = Reference(
            ref_model,
            self.d.local_micro_batch_size,
            cfg.rollout.temperature,
            packing=packing,
            fused=fused,
        )
        self.engines: dict[str, DeepSpeedStrategy] = {"actor": actor_strategy}
        self.critic: Critic | None = None
        if value_model is not None:
            critic_strategy = self._strategy(cfg.critic, engines_cfg)
            critic_strategy.init(value_model)
            self.critic = Critic(
                critic_strategy,
                cfg.algorithm,
                self.d.local_micro_batch_size,
                group=self.group,
                packing=packing,
                max_tokens_per_micro_batch=budget,
            )
            self.engines["critic"] = critic_strategy
        self._size_token_budget(policy.config)
        self.model_flops = ModelFlops.of(policy.config)
        self.peaks = device_peaks(self.device)
        if self.rank == 0:
            for name, strategy in self.engines.items():
                self.log.info("%s engine: %s", name, strategy.describe())
            for line in self.fast.lines():
                self.log.info("fast path: %s", line)
            if self.peaks is None:
                self.log.info(
                    "fast path: no MFU metrics (no peak FLOP/s known for %s)", self.device
                )

    def _build_pipeline_roles(self) -> None:
        """Actor, reference and (GAE) critic as DeepSpeed pipeline engines: this rank builds
        and holds its stage only (:mod:`verl_ppo.pipeline`)."""
        cfg = self.config
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        roles = build_pipeline_roles(cfg, self.tokenizer, self.dtype, self.world, self.use_critic)
        self.pipeline = roles
        self.policy_config = roles.hf_config
        self.fast = pipeline_fast_path(cfg)
        self.actor, self.critic, self.reference = roles.actor, roles.critic, roles.reference
        self.engines = dict(roles.engines)
        self.model_flops = ModelFlops.of(roles.hf_config)
        self.peaks = device_peaks(self.device)
        if self.rank == 0:
            self.log.info(
                "pipeline: %s, stage params per role %s",
                roles.layout.describe(),
                roles.memory_metrics(),
            )

    def _size_token_budget(self, model_config: Any) -> None:
        """``train.max_tokens_per_micro_batch: auto``: on CUDA, from the memory free now
        (engines built; the smallest over ranks); the no-grad forwards get 4x (they keep
        no activations). See :mod:`verl_ppo.fast_path`."""
        cfg, fp = self.config, self.fast
        given = cfg.train.max_tokens_per_micro_batch
        cap = self.d.local_mini_batch_size * (cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
        if given != "auto":
            fp.max_tokens_per_micro_batch = given
            fp.reasons["train.max_tokens_per_micro_batch"] = f"{given} (set)"
        elif not self.cuda:
            fp.reasons["train.max_tokens_per_micro_batch"] = (
                f"None (auto: CPU, train.micro_batch_size={self.d.local_micro_batch_size})"
            )
        else:
            free = torch.cuda.mem_get_info(self.device)[0]
            if self.world > 1:
                t = torch.tensor([float(free)], dtype=torch.float64, device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
                free = int(t.item())
            bpt = training_bytes_per_token(
                model_config, 2 if self.dtype == torch.bfloat16 else 4,
                cfg.model.gradient_checkpointing,
            )  # fmt: skip
            fp.max_tokens_per_micro_batch = token_budget_from_free_memory(free, bpt, cap)
            fp.reasons["train.max_tokens_per_micro_batch"] = (
                f"{fp.max_tokens_per_micro_batch} (auto: {BUDGET_FRACTION} x "
                f"{free / 2**30:.1f} GiB free / {bpt / 2**20:.2f} MiB per token, at most one "
                f"mini-batch of {cap})"
            )
        if fp.max_tokens_per_micro_batch is not None:
            fp.max_tokens_no_grad = max(4 * fp.max_tokens_per_micro_batch, cap)
        for role in (self.actor, self.critic, self.reference):
            if role is not None:
                role.max_tokens = fp.max_tokens_per_micro_batch
                role.max_tokens_no_grad = fp.max_tokens_no_grad

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
                for line in prepare_run_dir(cfg.run_dir, cfg.train.resume):
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

    def _strategy(self, role_cfg: Any, engines_cfg: dict[str, Any]) -> DeepSpeedStrategy:
        """The DeepSpeed strategy of one role (``actor`` or ``critic`` config section), with
        the job's compression, data-parallel group and deadline."""
        return DeepSpeedStrategy(
            ds_config(
                zero_stage=role_cfg.zero_stage,
                grad_clip=role_cfg.optim.grad_clip,
                offload_optimizer=role_cfg.offload_optimizer,
                **engines_cfg,
            ),
            lr=role_cfg.optim.lr,
            weight_decay=role_cfg.optim.weight_decay,
            betas=role_cfg.optim.betas,
            compression=self.config.compression,
            group=self.group,
            timeout_s=self.ctx.timeout_s,
            recorder=self.recorder,
            fused=self.fast.fused_adamw,
        )

    def _build_reward(self) -> RewardModel:
        """The reward model of ``reward.model`` (rule scorer of the task by default), wrapped in
        the exact-key LRU cache when ``reward.cache_entries`` > 0; a remote reward's calls
        are capped at ``comm.timeout_s``."""
        rc = self.config.reward
        if rc.model == "rule":
            model: Any = RuleReward(score_fn=self.task.score)
        else:
            model = build_reward_model(
                rc.model, device=str(self.device), deadline_s=self.ctx.timeout_s
            )
        if rc.cache_entries:
            model = CachedReward(model, rc.cache_entries)
        return model

    # ------------------------------------------------------------------ step
    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step (collective); returns metrics averaged over ranks."""
        cfg = self.config
        timer = PhaseTimer(profiler=self.profiler, sync_cuda=self.cuda)
        exp, m = self.experience_maker.make_experience(step, timer)
        local = exp  # this rank's rollout (perf and rollout metrics count it once)
        if self.pipeline is not None:  # the stages of a pipeline train on the same batch
            exp = self.pipeline.gather(exp, self.d.num_mini_batches, self.tokenizer.pad_token_id)
            extra = self.hybrid.last_metrics.get("memory/rollout_extra_param_bytes", 0.0)
            m.update(self.pipeline.memory_metrics(extra))
        self._score_tokens(exp, timer)
        with timer.phase("adv"):
            if self.pipeline is not None:  # batch statistics over each rank's own rollout
                m.update(self.pipeline.per_rollout(exp, self._advantages))
            else:
                m.update(self._advantages(exp))
        m.update(self._update(exp, timer))
        m.update(timer.metrics())
        m.update(self._perf_metrics(timer.times, local))
        m.update(rollout_metrics(local, cfg.rollout.max_new_tokens))
        m.update(self._comm_metrics())
        m = self._reduce_metrics(m)
        if self.monitor is not None:
            self.monitor.update(m, step=self.step)
        m["perf/tokens"] *= self.world
        m["perf/throughput_tokens_per_s"] = m["perf/tokens"] / max(m["timing_s/step"], 1e-9)
        m["perf/throughput_tokens_per_s_per_gpu"] = m["perf/throughput_tokens_per_s"] / self.world
        self.kl_ctrl.update(m.get("actor/kl", 0.0), cfg.train.rollout_batch_size)
        m["actor/kl_coef"] = self.kl_ctrl.value
        return m

    def _score_tokens(self, exp: Experience, timer: PhaseTimer) -> None:
        """Phases ``old_log_prob``, ``ref`` and (GAE) ``values``: fill ``exp``'s ``(B, R)``
        log-probs under the rollout policy and the reference, and the critic's values."""
        if self.fast.bypass_old_log_prob:  # see verl_ppo.fast_path.resolve_old_log_prob
            exp.old_log_prob = exp.rollout_log_prob
        else:
            with timer.phase("old_log_prob"):
                exp.old_log_prob = self.actor.compute_log_prob(exp)
        with timer.phase("ref"):
            exp.ref_log_prob = self.reference.compute_log_prob(exp)
        if self.critic is not None:
            with timer.phase("values"):
                exp.values = self.critic.compute_values(exp)

    def _advantages(self, exp: Experience) -> dict[str, float]:
        """Token rewards (``algorithm.reward_shaping``), then advantages and returns
        (``algorithm.adv_estimator``) into ``exp``; returns this rank's metrics."""
        alg = self.config.algorithm
        mask = exp.response_mask
        shape = REWARD_SHAPERS[alg.reward_shaping]
        exp.token_level_rewards, kl = shape(
            exp.scores,
            mask,
            exp.old_log_prob,
            exp.ref_log_prob,
            kl_coef=self.kl_ctrl.value,
            kl_estimator=alg.kl.estimator,
            use_kl_in_reward=alg.kl.use_kl_in_reward,
        )
        exp.advantages, exp.returns = ADV_ESTIMATORS[alg.adv_estimator](
            token_level_rewards=exp.token_level_rewards,
            values=exp.values,
            response_mask=mask,
            gamma=alg.gamma,
            lam=alg.lam,
            group_index=exp.group_index,
            norm_by_std=alg.norm_adv_by_std_in_grpo,
        )
        m = {
            "actor/kl": float(masked_mean(kl, mask)),
            "critic/returns_mean": float(masked_mean(exp.returns, mask)),
            "actor/advantages_mean": float(masked_mean(exp.advantages, mask)),
        }
        if exp.values is not None:
            m["critic/vf_explained_var"] = float(explained_variance(exp.returns, exp.values, mask))
        return m

    def _update(self, exp: Experience, timer: PhaseTimer) -> dict[str, float]:
        """Phases ``update_critic`` (GAE) and ``update_actor``: the PPO epochs."""
        cfg, m = self.config, {}
        if self.critic is not None:
            with timer.phase("update_critic"):
                m.update(self.critic.update(exp, self.d.num_mini_batches, cfg.train.ppo_epochs))
        with timer.phase("update_actor"):
            m.update(
                self.actor.update(
                    exp,
                    self.d.num_mini_batches,
                    cfg.train.ppo_epochs,
                    on_policy=self.fast.bypass_old_log_prob,
                )
            )
        return m

    def _perf_metrics(self, times: dict[str, float], exp: Experience) -> dict[str, float]:
        """The resolved ``auto`` settings (``auto/*``), MFU per model phase
        (``perf/mfu/<phase>``, :mod:`verl_ppo.perf`) and decode tokens/s against its floor."""
        out = dict(self.fast.metrics())
        out.update(
            phase_perf(
                self.model_flops,
                times,
                exp.attention_mask.sum(-1),
                int(exp.response_mask.sum()),
                self.fast.fused_log_probs,
                self.config.train.ppo_epochs,
                self.peaks,
            )
        )
        B, R = exp.response_mask.shape
        if times.get("gen"):
            out["perf/decode_tokens_per_s"] = B * R / times["gen"]
            if self.peaks is not None:
                floor = self.model_flops.decode_floor_s(B, exp.prompt_len, R, self.peaks)
                out["perf/decode_floor_tokens_per_s"] = B * R / floor
                out["perf/decode_vs_floor"] = floor / times["gen"]
        if self.cuda:
            out["memory/alloc_retries"] = float(torch.cuda.memory_stats()["num_alloc_retries"])
        return out

    def _comm_metrics(self) -> dict[str, float]:
        """``comm/<role>/<stat>`` of each active gradient-communication hook."""
        return {
            f"comm/{role}/{k.split('/', 1)[-1]}": float(v)
            for role, handle in self.grad_comm.items()
            for k, v in handle.hook_state.metrics().items()
        }

    def _reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        """Mean over the ranks of every metric (one float64 all-reduce); keys ending in
        ``_max`` (per-rank peaks) are reduced by maximum instead."""
        keys = sorted(m)
        t = torch.tensor([m[k] for k in keys], dtype=torch.float64)
        is_max = torch.tensor([k.endswith("_max") for k in keys])
        if self.world > 1:
            peak = self.ctx.all_reduce(
                t.clone().to(self.ctx.device), op=dist.ReduceOp.MAX, group=self.group, name="peaks"
            )
            t = self.ctx.all_reduce(t.to(self.ctx.device), group=self.group, name="metrics")
            t = torch.where(is_max, peak.cpu(), t.cpu() / self.world)
        return dict(zip(keys, t.tolist()))

    @torch.no_grad()
    def evaluate(self, keep: list | None = None) -> float:
        """Mean reward of greedy responses on the held-out split (all ranks, collective).

        Args:
            keep: when given, this rank appends :class:`verl_ppo.report.Sample` triples
                (question, response, reward) of its first ``SAMPLES_SHOWN`` prompts to it.
        """
        n = len(self.task.eval)
        mine = list(range(self.rank, n, self.world))
        total = torch.zeros(2, dtype=torch.float64)
        bs = max(self.d.local_rollout_batch_size, 1)
        self.actor.module.eval()
        with contextlib.ExitStack() as stack:
            model = None
            if self.pipeline is not None:  # no rank holds the policy: the TP rollout model
                params = self.actor.strategy.hf_named_parameters()
                model = stack.enter_context(self.hybrid.rollout(params))
                # TP groups generate together: every rank runs the same number of batches
                n_batches = -(-n // (self.world * bs))
                mine += [None] * (n_batches * bs - len(mine))
            self._evaluate(mine, bs, total, keep, model)
        if self.world > 1:
            total = self.ctx.all_reduce(total.to(self.ctx.device), group=self.group, name="eval")
            total = total.cpu()
        return float(total[0] / max(total[1], 1.0))

    def _evaluate(self, mine: list, bs: int, total: torch.Tensor, keep: Any, model: Any) -> None:

        for i in range(0, len(mine), bs):
            idx = mine[i : i + bs]
            real = [j for j in idx if j is not None]  # None: a pad to keep TP groups in step
            texts: list[str] | None = [] if keep is not None and len(keep) < SAMPLES_SHOWN else None
            scores = self.experience_maker.greedy_scores("eval", real or [0], texts, model)
            if not real:
                continue
            total += torch.tensor([float(scores.sum()), len(real)], dtype=torch.float64)
            if texts is not None:
                for j, text, r in zip(real, texts, scores.tolist()):
                    question = self.task.sample(self.tokenizer, "eval", j).question
                    keep.append(Sample(question, text, float(r)))
                del keep[SAMPLES_SHOWN:]

    # ------------------------------------------------------------ checkpoint
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
        path = self.ckpt.latest()
        if path is None:
            return
        state = self.ckpt.load(path, self.engines)
        self.step = int(state["step"])
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
