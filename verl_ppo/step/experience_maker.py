"""The rollout of one PPO step: prompts -> (reshard) -> generation -> scoring -> an
:class:`~verl_ppo.step.experience.Experience`.

OpenRLHF's ``experience_maker.py`` is the model: the trainer asks for one rank's experience
and gets a typed batch back; log-probs, values and advantages are filled in by the phases
that follow. Phases timed here: ``reshard`` (with the hybrid engine, into and out of the
rollout layout), ``gen`` (with scoring of micro-batch ``i`` overlapped while ``i + 1``
generates when ``reward.async_scoring``) and ``reward`` (waiting for the scores).

Shapes: ``B`` sequences on this rank (``local_prompts * n_samples``), ``P`` prompt length
(left-padded), ``R`` response length (right-padded, at most ``rollout.max_new_tokens``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from verl_ppo.config import Derived, PPOConfig
from verl_ppo.data.tasks import Task
from verl_ppo.observe.metrics import PhaseTimer
from verl_ppo.reward.async_scorer import AsyncRewardScorer
from verl_ppo.reward.base import RewardBatch, RewardModel
from verl_ppo.roles import Actor
from verl_ppo.rollout.generate import RolloutOutput, response_mask_from
from verl_ppo.rollout.runner import RolloutRunner
from verl_ppo.rollout.sampler import SamplingParams
from verl_ppo.step.experience import Experience
from verl_ppo.step.prompt_prefetch import PromptPrefetcher, StepPrompts


class ExperienceMaker:
    """Builds one rank's :class:`Experience` per step, and scores greedy evaluation batches.

    Args:
        config: the validated job config.
        derived: ``config.derived(world_size)`` (per-rank sizes).
        tokenizer: the HF tokenizer of the policy.
        task: the prompt source and rule scorer.
        actor: the trained policy (generates unless the hybrid engine gives a rollout model).
        reward_model: scores ``RewardBatch`` es; with ``reward.async_scoring`` it runs in one
            worker thread while the next micro-batch generates.
        rank, world_size: this rank and the number of data-parallel ranks.
        device: where prompts, responses and scores live.
        timeout_s: deadline in seconds of waiting for one micro-batch's scores
            (``comm.timeout_s``: a hung reward fails here rather than in the next collective).
        hybrid: the :class:`~verl_ppo.reshard.hybrid.HybridEngine`, or None.
        profiler: receives the rollout time and batch size (``record_rollout``).
        use_cuda_graph: the resolved ``rollout.use_cuda_graph`` (:mod:`verl_ppo.job.fast_path`).
    """

    def __init__(
        self,
        config: PPOConfig,
        derived: Derived,
        tokenizer: Any,
        task: Task,
        actor: Actor,
        reward_model: RewardModel,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        hybrid: Any = None,
        profiler: Any = None,
        use_cuda_graph: bool = False,
    ) -> None:
        self.config = config
        self.d = derived
        self.tokenizer = tokenizer
        self.task = task
        self.actor = actor
        self.reward_model = reward_model
        self.rank = rank
        self.world = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.hybrid = hybrid
        self.profiler = profiler
        self.scorer: AsyncRewardScorer | None = None
        if config.reward.async_scoring:
            self.scorer = AsyncRewardScorer(reward_model, max_workers=1)
        self.rollout_runner = RolloutRunner(use_cuda_graph)
        self._prefetch: PromptPrefetcher | None = None  # made at the first step

    # ---------------------------------------------------------------- inputs
    def prompts(self, step: int) -> tuple[list[str], list[dict], torch.Tensor]:
        """This rank's prompts of ``step``, each repeated ``n_samples`` times: ``(texts,
        entries, group_index (B,) int64)`` (samples of one prompt share an index)."""
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

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``(input_ids, attention_mask)``, both ``(B, P)`` int64 on the device.

        Raises:
            ValueError: a prompt longer than ``data.max_prompt_length`` (names the key).
        """
        ids, mask = self._tokenize(texts, self.tokenizer)
        return ids.to(self.device), mask.to(self.device)

    def _tokenize(self, texts: list[str], tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode` on the CPU."""
        data = self.config.data
        pad_kw: dict[str, Any] = {"padding": True}
        if data.pad_prompt_to:
            pad_kw = {"padding": "max_length", "max_length": data.pad_prompt_to}
        enc = tokenizer(texts, return_tensors="pt", add_special_tokens=False, **pad_kw)
        if enc.input_ids.shape[1] > data.max_prompt_length:
            raise ValueError(
                f"a prompt has {enc.input_ids.shape[1]} tokens > data.max_prompt_length="
                f"{data.max_prompt_length}; raise data.max_prompt_length"
            )
        return enc.input_ids, enc.attention_mask

    def step_prompts(self, step: int) -> StepPrompts:
        """``step``'s prompts, tokenized on the CPU; the next step's are then drawn here and
        tokenized on a worker thread (:mod:`verl_ppo.step.prompt_prefetch`).

        Raises:
            ValueError: as :meth:`encode`.
        """
        if self._prefetch is None:
            tok = copy.deepcopy(self.tokenizer)  # the worker's own (prompt_prefetch.py)
            self._prefetch = PromptPrefetcher(
                self.prompts,
                lambda texts: self._tokenize(texts, tok),
                last_step=self.config.train.num_steps - 1,
            )
        return self._prefetch.get(step)

    # ------------------------------------------------------------ generation
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        greedy: bool,
        max_new: int,
        seed: int,
        model: Any = None,
    ) -> RolloutOutput:
        """Sample (or greedily decode) with ``model`` (default: the actor's training module;
        the hybrid engine passes its TP rollout model) through
        :class:`~verl_ppo.rollout.runner.RolloutRunner` (CUDA graphs when resolved on);
        returns ``(B, P + R)`` sequences and the sampled tokens' ``(B, R)`` log-probs."""
        r = self.config.rollout
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return self.rollout_runner.run(
            model if model is not None else self.actor.module,
            input_ids,
            attention_mask,
            max_new_tokens=max_new,
            eos_token_id=-1 if (r.ignore_eos and not greedy) else self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            params=SamplingParams(not greedy, r.temperature, r.top_k, r.top_p),
            generator=gen,
        )

    def _response_mask(self, responses: torch.Tensor) -> torch.Tensor:
        return response_mask_from(
            responses, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        ).to(self.device)

    # --------------------------------------------------------------- scoring
    def reward_batch(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        prompts: list[str],
        responses: torch.Tensor,
        response_mask: torch.Tensor,
        entries: list[dict],
    ) -> RewardBatch:
        """The CPU :class:`RewardBatch` of padded prompts ``(B, P)`` and responses ``(B, R)``.

        ``prompts`` are the B prompt texts as the policy saw them (rendered with its chat
        template, :meth:`Task.render`), so a classifier reward scores ``prompt + response``:
        the whole conversation in the model's template.
        """
        texts = self.decode(responses, response_mask)
        return RewardBatch.from_padded(
            prompt_ids.cpu(),
            prompt_mask.cpu(),
            responses.cpu(),
            response_mask.cpu(),
            list(prompts),
            texts,
            entries,
        )

    def score(
        self, prompt_ids, prompt_mask, prompts, responses, response_mask, entries
    ) -> torch.Tensor:
        """Scores ``(B,)`` float32 on the device, computed in this thread."""
        batch = self.reward_batch(
            prompt_ids, prompt_mask, prompts, responses, response_mask, entries
        )
        return self.reward_model.score(batch).to(self.device)

    def decode(self, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Response texts (special tokens dropped) of ``responses (B, R)`` under ``mask``."""
        return [
            self.tokenizer.decode(r[m > 0].tolist(), skip_special_tokens=True)
            for r, m in zip(responses.cpu(), mask.cpu())
        ]

    # ------------------------------------------------------------------ step
    def make_experience(self, step: int, timer: PhaseTimer) -> tuple[Experience, dict[str, float]]:
        """Prompts, generation (inside the rollout layout with the hybrid engine) and scores of
        ``step``; returns the :class:`Experience` (``scores`` filled, log-probs not yet) and
        this rank's rollout metrics (hybrid-engine reshard bytes, reward latency/cache).

        Raises:
            TimeoutError: a micro-batch's scores did not arrive within ``timeout_s``.
        """
        m: dict[str, float] = {}
        sp = self.step_prompts(step)
        texts, entries, groups = sp.texts, sp.entries, sp.groups
        prompt_ids, prompt_mask = sp.input_ids.to(self.device), sp.attention_mask.to(self.device)
        P, B = prompt_ids.shape[1], prompt_ids.shape[0]
        pad = self.tokenizer.pad_token_id
        with contextlib.ExitStack() as stack:
            rollout_model = None
            if self.hybrid is not None:
                with timer.phase("reshard"):
                    held = self.actor.strategy.hf_named_parameters()  # real holdings
                    rollout_model = stack.enter_context(self.hybrid.rollout(held))
            with timer.phase("gen"):
                parts, lp_parts, futures = self._generate(
                    step, prompt_ids, prompt_mask, texts, entries, rollout_model
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
        if self.profiler is not None:
            self.profiler.record_rollout(timer.times["gen"], B)
        rmask = self._response_mask(responses)
        rollout_lp = torch.cat([torch.nn.functional.pad(x, (0, R - x.shape[1])) for x in lp_parts])
        exp = Experience(
            input_ids=torch.cat([prompt_ids, responses], 1),
            attention_mask=torch.cat([prompt_mask, rmask.long()], 1),
            prompt_len=P,
            responses=responses,
            response_mask=rmask,
            group_index=groups.to(self.device),
            entries=entries,
            rollout_log_prob=rollout_lp * rmask,
        )
        m["rollout/cuda_graph_captures"] = float(self.rollout_runner.graph_captures)
        with timer.phase("reward"):
            if self.scorer is not None:
                scores = [self.scorer.wait(f, timeout=self.timeout_s) for f in futures]
                exp.scores = torch.cat(scores).to(self.device)
                m.update(self.scorer.metrics(reset=True))
            else:
                exp.scores = self.score(prompt_ids, prompt_mask, texts, responses, rmask, entries)
        if hasattr(self.reward_model, "metrics"):
            m.update({k: float(v) for k, v in self.reward_model.metrics(reset=True).items()})
        return exp, m

    def _generate(
        self,
        step: int,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        texts: list[str],
        entries: list[dict],
        rollout_model: Any,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """Generate ``rollout.micro_batch_size`` prompts at a time, submitting each
        micro-batch's scoring while the next one generates; returns the responses
        ``(b, R_i)``, their rollout log-probs ``(b, R_i)`` and the scoring futures."""
        cfg, P, B = self.config, prompt_ids.shape[1], prompt_ids.shape[0]
        mb, pad = cfg.rollout.micro_batch_size or B, self.tokenizer.pad_token_id
        parts, lp_parts, futures = [], [], []
        self.actor.module.eval()
        for i in range(0, B, mb):
            seed = cfg.seed * 1_000_003 + step * 7919 + self.rank * 131 + i
            out_i = self.generate(
                prompt_ids[i : i + mb],
                prompt_mask[i : i + mb],
                False,
                cfg.rollout.max_new_tokens,
                seed,
                rollout_model,
            )
            r_i = out_i.sequences[:, P:]
            parts.append(r_i)
            lp_parts.append(out_i.log_probs)
            if self.scorer is not None:  # score i while i+1 generates
                batch = self.reward_batch(
                    prompt_ids[i : i + mb],
                    prompt_mask[i : i + mb],
                    texts[i : i + mb],
                    r_i,
                    response_mask_from(r_i, self.tokenizer.eos_token_id, pad),
                    entries[i : i + mb],
                )
                futures.append(self.scorer.submit(batch))
        return parts, lp_parts, futures

    @torch.no_grad()
    def greedy_scores(
        self, split: str, indices: list[int], texts: list[str] | None = None, model: Any = None
    ) -> torch.Tensor:
        """Scores ``(len(indices),)`` float32 of greedy responses (at most
        ``rollout.eval_max_new_tokens``) to the samples ``indices`` of ``split``; the decoded
        responses are appended to ``texts`` when given (the printed eval samples)."""
        samples = [self.task.sample(self.tokenizer, split, j) for j in indices]
        ids, mask = self.encode([s.prompt for s in samples])
        max_new = self.config.rollout.eval_max_new_tokens
        seqs = self.generate(ids, mask, True, max_new, 0, model).sequences  # model: TP rollout
        resp = seqs[:, ids.shape[1] :]
        rmask = self._response_mask(resp)
        if texts is not None:
            texts.extend(self.decode(resp, rmask))
        prompts = [s.prompt for s in samples]
        return self.score(ids, mask, prompts, resp, rmask, [s.entry for s in samples])

    def close(self) -> None:
        """Stop the scoring and prompt threads and drop the CUDA-graph decoder."""
        if self.scorer is not None:
            self.scorer.shutdown()
        if self._prefetch is not None:
            self._prefetch.close()
            self._prefetch = None
        self.rollout_runner = RolloutRunner(False)


def rollout_metrics(exp: Experience, max_new_tokens: int) -> dict[str, float]:
    """``reward/mean``, ``response/length_mean``, ``response/clip_ratio`` (share of responses
    that hit ``max_new_tokens``) and ``perf/tokens`` (this rank's prompt + response tokens)."""
    lengths = exp.response_mask.sum(-1)
    return {
        "reward/mean": float(exp.scores.mean()),
        "response/length_mean": float(lengths.float().mean()),
        "response/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
        "perf/tokens": float(exp.attention_mask.sum()),
    }
