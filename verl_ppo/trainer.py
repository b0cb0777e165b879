"""The PPO trainer: a short loop of named, timed phases.

generate -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor

Each rank generates its share of the global rollout batch; the actor and critic are
DeepSpeed engines whose gradients are reduced across the data-parallel ranks (by
DeepSpeed, or by verl_comm's hooks when ``gradient_compression`` is set). Metrics are
averaged over ranks and written by rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_ppo.algorithms import (
    ADV_ESTIMATORS,
    kl_penalty,
    make_kl_controller,
    masked_mean,
)
from verl_ppo.checkpoint import CheckpointManager
from verl_ppo.config import PPOConfig, build_config, load_config
from verl_ppo.data.tasks import Task
from verl_ppo.experience import Experience
from verl_ppo.metrics import PhaseTimer, get_logger
from verl_ppo.models import (
    build_policy,
    build_value_model,
    check_uniform_dtype,
    load_tokenizer,
)
from verl_ppo.roles import Actor, Critic, Reference
from verl_ppo.rollout.generate import generate, response_mask_from
from verl_ppo.strategy import DeepSpeedStrategy, ds_config


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

    Call :meth:`run` from every rank of an initialised process group (the CLI and
    ``python -m verl_ppo.train`` do that); in a plain single process, :meth:`run` starts a
    one-rank gloo group itself.

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

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build models, engines, task and reward (collective across ranks)."""
        from verl_ppo.distributed import ensure_process_group

        cfg = self.config
        self._owns_group = ensure_process_group(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = get_logger(self.rank)
        if self.rank == 0:
            from verl_ppo.distributed import environment_findings

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

        from verl_comm.profiler import VerlProfiler
        from verl_comm.telemetry import CommRecorder

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
        self.scorer = None
        if cfg.reward.async_scoring:
            from verl_ppo.reward.async_scorer import AsyncRewardScorer

            self.scorer = AsyncRewardScorer(self.reward_model, max_workers=1)

        policy = build_policy(cfg.model, self.tokenizer, self.dtype, cfg.seed).to(self.device)
        if cfg.model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        ref_model = copy.deepcopy(policy)
        check_uniform_dtype(policy, self.dtype, "actor")
        self.use_critic = cfg.algorithm.adv_estimator == "gae"
        engines_cfg = dict(
            micro_batch_size=self.d.local_micro_batch_size,
            grad_accum_steps=self.d.grad_accum_steps,
            world_size=self.world,
            bf16=self.dtype == torch.bfloat16,
        )
        actor_strategy = self._strategy(cfg.actor, engines_cfg)
        actor_strategy.init(policy)
        packing, budget = cfg.train.sequence_packing, cfg.train.max_tokens_per_micro_batch
        self.actor = Actor(
            actor_strategy,
            cfg.algorithm,
            self.d.local_micro_batch_size,
            cfg.rollout.temperature,
            packing=packing,
            max_tokens_per_micro_batch=budget,
        )
        self.reference = Reference(
            ref_model, self.d.local_micro_batch_size, cfg.rollout.temperature, packing=packing
        )
        self.engines: dict[str, DeepSpeedStrategy] = {"actor": actor_strategy}
        self.critic: Critic | None = None
        if self.use_critic:
            value_model = build_value_model(policy, self.dtype).to(self.device)
            critic_strategy = self._strategy(cfg.critic, engines_cfg)
            critic_strategy.init(value_model)
            self.critic = Critic(
                critic_strategy,
                cfg.algorithm,
                self.d.local_micro_batch_size,
                packing=packing,
                max_tokens_per_micro_batch=budget,
            )
            self.engines["critic"] = critic_strategy
        self._attach_grad_comm()
        self.hybrid = None
        he = cfg.actor.model_config_.hybrid_engine
        if he.enable:
            from verl_ppo.reshard.hybrid import HybridEngine

            self.hybrid = HybridEngine.build(
                policy.config, he, recorder=self.recorder, zero_stage=cfg.actor.zero_stage
            )
        self._decoder = None
        self.monitor = None
        if cfg.monitor.prometheus_port is not None:
            from verl_ppo.monitor import PrometheusMonitor

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
        self.ckpt = CheckpointManager(cfg.run_dir, self.rank)
        if cfg.train.resume == "auto":
            self._maybe_resume()
        from verl_ppo.tracking import build_tracking

        self.tracking = build_tracking(
            cfg.train, cfg.run_dir, self.rank, self.step, cfg.model_dump(by_alias=True)
        )
        self._ready = True

    @staticmethod
    def _strategy(role_cfg: Any, engines_cfg: dict[str, Any]) -> DeepSpeedStrategy:
        """The DeepSpeed strategy of one role (``actor`` or ``critic`` config section)."""
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
        )

    def _build_reward(self) -> Any:
        """The reward model of ``reward.model`` (rule scorer of the task by default), wrapped in
        the exact-key LRU cache when ``reward.cache_entries`` > 0."""
        from verl_ppo.reward import build_reward_model
        from verl_ppo.reward.cache import CachedReward
        from verl_ppo.reward.rule import RuleReward

        rc = self.config.reward
        if rc.model == "rule":
            model: Any = RuleReward(score_fn=self.task.score)
        else:
            model = build_reward_model(rc.model, device=str(self.device))
        if rc.cache_entries:
            model = CachedReward(model, rc.cache_entries)
        return model

    def _attach_grad_comm(self) -> None:
        """Hand gradient reduction to verl_comm's hooks when compression is on."""
        if self.config.compression.gradient_compression == "none":
            self.grad_comm = {}
            return
        from verl_ppo.grad_comm import attach_grad_comm

        self.grad_comm = {}
        for role, strat in self.engines.items():
            handle = attach_grad_comm(strat.engine, self.config.compression, recorder=self.recorder)
            self.grad_comm[role] = handle
        self.actor.grad_comm = self.grad_comm.get("actor")
        if self.critic is not None:
            self.critic.grad_comm = self.grad_comm.get("critic")

    # --------------------------------------------------------------- rollout
    def _prompts(self, step: int) -> tuple[list[str], list[dict], torch.Tensor]:
        n = self.config.algorithm.n_samples
        lp = self.d.local_prompts
        base = step * lp * self.world + self.rank * lp
        texts, entries, groups = [], [], []
        for i in range(lp):
            s = self.task.sample(self.tokenizer, "train", base + i)
            for _ in range(n):
                texts.append(s.prompt)
                entries.append(s.entry)
                groups.append(base + i)
        return texts, entries, torch.tensor(groups, dtype=torch.long)

    def _encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.config.data
        pad_kw: dict[str, Any] = {"padding": True}
        if data.pad_prompt_to:
            pad_kw = {"padding": "max_length", "max_length": data.pad_prompt_to}
        enc = self.tokenizer(texts, return_tensors="pt", add_special_tokens=False, **pad_kw)
        if enc.input_ids.shape[1] > self.config.data.max_prompt_len:
            raise ValueError(
                f"a prompt has {enc.input_ids.shape[1]} tokens > data.max_prompt_len="
                f"{self.config.data.max_prompt_len}; raise data.max_prompt_len"
            )
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def _generate(
        self, input_ids, attention_mask, greedy: bool, max_new: int, seed: int, model=None
    ):
        """Sample (or greedily decode) with ``model`` (default: the actor's training module;
        the hybrid engine passes its TP rollout model); CUDA graphs when configured."""
        r = self.config.rollout
        gen = torch.Generator(device=self.device).manual_seed(seed)
        kwargs = dict(
            max_new_tokens=max_new,
            eos_token_id=-1 if (r.ignore_eos and not greedy) else self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            do_sample=not greedy,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            generator=gen,
        )
        if model is not None:
            return model.generate(input_ids, attention_mask, **kwargs)
        if r.use_cuda_graph:
            from verl_ppo.rollout.cuda_graph import decoder_for

            self._decoder = decoder_for(
                self._decoder, self.actor.module, input_ids.shape[1], max_new, use_cuda_graph=True
            )
            return self._decoder.generate(input_ids, attention_mask, **kwargs)
        return generate(self.actor.module, input_ids, attention_mask, **kwargs)

    def _reward_batch(self, prompt_ids, prompt_mask, responses, response_mask, entries):
        from verl_ppo.reward.base import RewardBatch

        texts = self._decode(responses, response_mask)
        return RewardBatch.from_padded(
            prompt_ids.cpu(),
            prompt_mask.cpu(),
            responses.cpu(),
            response_mask.cpu(),
            [""] * len(texts),
            texts,
            entries,
        )

    def _score(self, prompt_ids, prompt_mask, responses, response_mask, entries) -> torch.Tensor:
        batch = self._reward_batch(prompt_ids, prompt_mask, responses, response_mask, entries)
        return self.reward_model.score(batch).to(self.device)

    def _decode(self, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return [
            self.tokenizer.decode(r[m > 0].tolist(), skip_special_tokens=True)
            for r, m in zip(responses.cpu(), mask.cpu())
        ]

    # ------------------------------------------------------------------ step
    def train_step(self, step: int) -> dict[str, float]:
        """One PPO step (collective); returns metrics averaged over ranks."""
        cfg = self.config
        timer = PhaseTimer(profiler=self.profiler, sync_cuda=self.cuda)
        m: dict[str, float] = {}
        texts, entries, groups = self._prompts(step)
        prompt_ids, prompt_mask = self._encode(texts)
        P, B = prompt_ids.shape[1], prompt_ids.shape[0]
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        mb = cfg.rollout.micro_batch_size or B
        with contextlib.ExitStack() as stack:
            rollout_model = None
            if self.hybrid is not None:
                with timer.phase("reshard"):
                    rollout_model = stack.enter_context(
                        self.hybrid.rollout(self.actor.strategy.engine)
                    )
            parts, futures, scores = [], [], []
            with timer.phase("gen"):
                self.actor.module.eval()
                for i in range(0, B, mb):
                    seed = cfg.seed * 1_000_003 + step * 7919 + self.rank * 131 + i
                    seqs_i = self._generate(
                        prompt_ids[i : i + mb],
                        prompt_mask[i : i + mb],
                        False,
                        cfg.rollout.max_new_tokens,
                        seed,
                        rollout_model,
                    )
                    parts.append(seqs_i[:, P:])
                    if self.scorer is not None:  # score i while i+1 generates
                        r_i = seqs_i[:, P:]
                        m_i = response_mask_from(r_i, eos, pad)
                        futures.append(
                            self.scorer.submit(
                                self._reward_batch(
                                    prompt_ids[i : i + mb],
                                    prompt_mask[i : i + mb],
                                    r_i,
                                    m_i,
                                    entries[i : i + mb],
                                )
                            )
                        )
            if self.hybrid is not None:
                with timer.phase("reshard"):
                    stack.close()
                m.update(
                    {
                        k: v
                        for k, v in self.hybrid.last_metrics.items()
                        if not k.startswith("timing")
                    }
                )
        R = max(p.shape[1] for p in parts)
        responses = torch.cat(
            [torch.nn.functional.pad(p, (0, R - p.shape[1]), value=pad) for p in parts], 0
        )
        seqs = torch.cat([prompt_ids, responses], 1)
        self.profiler.record_rollout(timer.times["gen"], B)
        rmask = response_mask_from(responses, eos, pad).to(self.device)
        exp = Experience(
            input_ids=seqs,
            attention_mask=torch.cat([prompt_mask, rmask.long()], 1),
            prompt_len=P,
            responses=responses,
            response_mask=rmask,
            group_index=groups.to(self.device),
            entries=entries,
        )
        with timer.phase("reward"):
            if self.scorer is not None:
                scores = [self.scorer.wait(f) for f in futures]
                exp.scores = torch.cat(scores).to(self.device)
                m.update(self.scorer.metrics(reset=True))
            else:
                exp.scores = self._score(prompt_ids, prompt_mask, responses, rmask, entries)
        if hasattr(self.reward_model, "metrics"):
            m.update({k: float(v) for k, v in self.reward_model.metrics().items()})
        with timer.phase("old_log_prob"):
            exp.old_log_prob = self.actor.compute_log_prob(exp)
        with timer.phase("ref"):
            exp.ref_log_prob = self.reference.compute_log_prob(exp)
        if self.critic is not None:
            with timer.phase("values"):
                exp.values = self.critic.compute_values(exp)
        with timer.phase("adv"):
            self._advantages(exp, m)
        if self.critic is not None:
            with timer.phase("update_critic"):
                m.update(self.critic.update(exp, self.d.num_mini_batches, cfg.train.ppo_epochs))
        with timer.phase("update_actor"):
            m.update(self.actor.update(exp, self.d.num_mini_batches, cfg.train.ppo_epochs))
        m.update(timer.metrics())
        lengths = rmask.sum(-1)
        m["reward/mean"] = float(exp.scores.mean())
        m["response/length_mean"] = float(lengths.float().mean())
        m["response/clip_ratio"] = float((lengths >= cfg.rollout.max_new_tokens).float().mean())
        m["perf/tokens"] = float(exp.attention_mask.sum())
        for role, handle in self.grad_comm.items():
            for k, v in handle.hook_state.metrics().items():
                m[f"comm/{role}/{k.split('/', 1)[-1]}"] = float(v)
        m = self._reduce_metrics(m)
        if self.monitor is not None:
            self.monitor.update(m, step=self.step)
        m["perf/tokens"] *= self.world
        m["perf/throughput_tokens_per_s"] = m["perf/tokens"] / max(m["timing_s/step"], 1e-9)
        m["perf/throughput_tokens_per_s_per_gpu"] = m["perf/throughput_tokens_per_s"] / self.world
        self.kl_ctrl.update(m.get("actor/kl", 0.0), cfg.train.rollout_batch_size)
        m["actor/kl_coef"] = self.kl_ctrl.value
        return m

    def _advantages(self, exp: Experience, m: dict[str, float]) -> None:
        alg = self.config.algorithm
        mask = exp.response_mask
        scores_tok = torch.zeros_like(mask)
        last = (mask.sum(-1).long() - 1).clamp_min(0)
        scores_tok[torch.arange(exp.batch_size, device=mask.device), last] = exp.scores.float()
        kl = kl_penalty(exp.old_log_prob, exp.ref_log_prob, alg.kl.estimator) * mask
        m["actor/kl"] = float(masked_mean(kl, mask))
        rewards = scores_tok
        if alg.kl.use_kl_in_reward:
            rewards = scores_tok - self.kl_ctrl.value * kl
        exp.token_level_rewards = rewards
        fn = ADV_ESTIMATORS[alg.adv_estimator]
        exp.advantages, exp.returns = fn(
            token_level_rewards=rewards,
            values=exp.values,
            response_mask=mask,
            gamma=alg.gamma,
            lam=alg.lam,
            group_index=exp.group_index,
            norm_by_std=alg.norm_adv_by_std_in_grpo,
        )
        m["critic/returns_mean"] = float(masked_mean(exp.returns, mask))
        m["actor/advantages_mean"] = float(masked_mean(exp.advantages, mask))
        if exp.values is not None:
            var_r = masked_mean((exp.returns - masked_mean(exp.returns, mask)) ** 2, mask)
            resid = exp.returns - exp.values
            var_e = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
            m["critic/vf_explained_var"] = float(1.0 - var_e / (var_r + 1e-8))

    def _reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        keys = sorted(m)
        t = torch.tensor([m[k] for k in keys], dtype=torch.float64)
        if self.world > 1:
            t = t.to(self.device) if dist.get_backend() == "nccl" else t
            dist.all_reduce(t)
            t = t.cpu() / self.world
        return dict(zip(keys, t.tolist()))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean reward of greedy responses on the held-out split (all ranks, collective)."""
        n = len(self.task.eval)
        mine = list(range(self.rank, n, self.world))
        total = torch.zeros(2, dtype=torch.float64)
        bs = max(self.d.local_rollout_batch_size, 1)
        self.actor.module.eval()
        for i in range(0, len(mine), bs):
            samples = [self.task.sample(self.tokenizer, "eval", j) for j in mine[i : i + bs]]
            ids, mask = self._encode([s.prompt for s in samples])
            seqs = self._generate(ids, mask, True, self.config.rollout.eval_max_new_tokens, 0)
            resp = seqs[:, ids.shape[1] :]
            rmask = response_mask_from(
                resp, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            )
            scores = self._score(ids, mask, resp, rmask.to(self.device), [s.entry for s in samples])
            total += torch.tensor([float(scores.sum()), len(samples)], dtype=torch.float64)
        if self.world > 1:
            t = total.to(self.device) if dist.get_backend() == "nccl" else total
            dist.all_reduce(t)
            total = t.cpu()
        return float(total[0] / max(total[1], 1.0))

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
        metrics of this call's steps. Evaluates at the start and end, checkpoints at the end."""
        from tqdm import tqdm

        if not self._ready:
            self.setup()
        cfg = self.config
        total = num_steps if num_steps is not None else cfg.train.num_steps
        want_eval = cfg.data.eval_size > 0
        if want_eval and self.step == 0:
            e0 = self.evaluate()
            self.tracking.log({"eval/reward": e0}, step=0)
        bar = tqdm(
            total=total, initial=self.step, disable=self.rank != 0, desc="ppo", dynamic_ncols=True
        )
        out = []
        t_start = time.perf_counter()
        self.profiler.start(first_step=self.step + 1)  # numbered as in the log
        while self.step < total:
            m = self.train_step(self.step)
            self.profiler.step()
            self.step += 1
            if want_eval and (
                self.step == total
                or (cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0)
            ):
                m["eval/reward"] = self.evaluate()
            m["step"] = self.step
            self.history.append(m)
            out.append(m)
            if self.step % cfg.train.log_interval == 0 or self.step == total:
                self.tracking.log(m, step=self.step)
            if cfg.train.save_interval and self.step % cfg.train.save_interval == 0:
                self.save_checkpoint()
            bar.update(1)
        bar.close()
        if self.profiler.stop() is not None and self.rank == 0:
            self.log.info(
                "profile in %s; read it with: verl-comm profile report %s",
                self.profiler.output_dir,
                self.profiler.output_dir,
            )
        if not cfg.train.save_interval or self.step % cfg.train.save_interval:
            path = self.save_checkpoint()
            self.log.info("checkpoint %s (%.1f s total)", path, time.perf_counter() - t_start)
        return out

    def close(self) -> None:
        """Free engines and tear the process group down if this trainer created it."""
        import gc

        if getattr(self, "scorer", None) is not None:
            self.scorer.shutdown()
        if getattr(self, "monitor", None) is not None:
            self.monitor.close()
        if getattr(self, "tracking", None) is not None:
            self.tracking.close()
        for attr in ("actor", "critic", "reference", "engines", "hybrid", "_decoder"):
            if hasattr(self, attr):
                setattr(self, attr, None)
        gc.collect()
        if getattr(self, "_owns_group", False) and dist.is_initialized():
            dist.destroy_process_group()
