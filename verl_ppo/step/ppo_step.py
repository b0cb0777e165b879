"""One PPO step and the held-out evaluation, as phases timed by a
:class:`~verl_ppo.observe.metrics.PhaseTimer`:

rollout (reshard -> gen -> reward) -> old_log_prob -> ref -> values -> adv -> update_critic
-> update_actor

then the step's metrics (losses, timings, MFU, rollout and communication statistics)
reduced over the ranks. :class:`PPOStep` receives the workers it drives in its
constructor; :class:`verl_ppo.trainer.PPOTrainer` owns it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.distributed import DistContext
from verl_ppo.algorithms import (
    ADV_ESTIMATORS,
    REWARD_SHAPERS,
    explained_variance,
    masked_mean,
)
from verl_ppo.config import Derived, PPOConfig
from verl_ppo.job.fast_path import ResolvedJob
from verl_ppo.observe.metrics import PhaseTimer
from verl_ppo.observe.perf import phase_perf
from verl_ppo.observe.report import Sample
from verl_ppo.step.experience import Experience
from verl_ppo.step.experience_maker import ExperienceMaker, rollout_metrics

SAMPLES_SHOWN = 3  # held-out prompt/response/reward triples printed at start and end


class PPOStep:
    """:meth:`train_step` and :meth:`evaluate` of one PPO job (both collective).

    Args:
        cfg: the config.
        job: the resolved job (old-log-prob bypass, fused head, ``auto/*`` metrics).
        d: per-rank batch sizes.
        ctx: the job's distributed context (metric and evaluation reductions).
        actor, critic (None under GRPO), reference: the roles it drives.
        experience_maker: makes each step's rollout and the greedy evaluation responses.
        kl_ctrl: the KL controller (the run folder checkpoints the same object).
        tokenizer, task: to show held-out samples.
        profiler: the run's profiler (phase annotations).
        model_flops, peaks: FLOP model and peak FLOP/s (None: no MFU metrics).
        grad_comm: role -> active gradient-communication handle (``comm/*`` metrics).
        pipeline: the :class:`~verl_ppo.pipeline.build.PipelineRoles` of a PP x DP run.
        hybrid: the hybrid engine (a pipeline run evaluates on its TP rollout model).
        monitor: the Prometheus monitor, or None.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        job: ResolvedJob,
        d: Derived,
        ctx: DistContext,
        *,
        actor: Any,
        critic: Any,
        reference: Any,
        experience_maker: ExperienceMaker,
        kl_ctrl: Any,
        tokenizer: Any,
        task: Any,
        profiler: Any,
        model_flops: Any,
        peaks: Any,
        grad_comm: dict[str, Any],
        pipeline: Any = None,
        hybrid: Any = None,
        monitor: Any = None,
    ) -> None:
        self.cfg, self.job, self.d, self.ctx = cfg, job, d, ctx
        self.world, self.rank, self.group = ctx.world_size, ctx.rank, ctx.group
        self.cuda = job.cuda
        self.actor, self.critic, self.reference = actor, critic, reference
        self.experience_maker, self.kl_ctrl = experience_maker, kl_ctrl
        self.tokenizer, self.task, self.profiler = tokenizer, task, profiler
        self.model_flops, self.peaks, self.grad_comm = model_flops, peaks, grad_comm
        self.pipeline, self.hybrid, self.monitor = pipeline, hybrid, monitor

    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step (collective); returns metrics averaged over ranks."""
        cfg = self.cfg
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
            self.monitor.update(m, step=step)
        m["perf/tokens"] *= self.world
        m["perf/throughput_tokens_per_s"] = m["perf/tokens"] / max(m["timing_s/step"], 1e-9)
        m["perf/throughput_tokens_per_s_per_gpu"] = m["perf/throughput_tokens_per_s"] / self.world
        self.kl_ctrl.update(m.get("actor/kl", 0.0), cfg.train.rollout_batch_size)
        m["actor/kl_coef"] = self.kl_ctrl.value
        return m

    def _score_tokens(self, exp: Experience, timer: PhaseTimer) -> None:
        """Phases ``old_log_prob``, ``ref`` and (GAE) ``values``: fill ``exp``'s ``(B, R)``
        log-probs under the rollout policy and the reference, and the critic's values."""
        if self.job.bypass_old_log_prob:  # see verl_ppo.job.fast_path._old_log_prob
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
        alg = self.cfg.algorithm
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
        cfg, m = self.cfg, {}
        if self.critic is not None:
            with timer.phase("update_critic"):
                m.update(self.critic.update(exp, self.d.num_mini_batches, cfg.train.ppo_epochs))
        with timer.phase("update_actor"):
            m.update(
                self.actor.update(
                    exp,
                    self.d.num_mini_batches,
                    cfg.train.ppo_epochs,
                    on_policy=self.job.bypass_old_log_prob,
                )
            )
        return m

    def _perf_metrics(self, times: dict[str, float], exp: Experience) -> dict[str, float]:
        """The resolved ``auto`` settings (``auto/*``), MFU per model phase
        (``perf/mfu/<phase>``, :mod:`verl_ppo.observe.perf`) and decode tokens/s against its floor."""
        out = dict(self.job.metrics())
        out.update(
            phase_perf(
                self.model_flops,
                times,
                exp.attention_mask.sum(-1),
                int(exp.response_mask.sum()),
                self.job.fused_log_probs,
                self.cfg.train.ppo_epochs,
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
            keep: when given, this rank appends :class:`verl_ppo.observe.report.Sample` triples
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
