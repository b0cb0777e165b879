"""Ours in ``benchmarks/ppo_throughput.py``: timed steps of :class:`verl_ppo.PPOTrainer` on
the fixed-length workload, after the numerics check of its log-probs against a plain HF
forward."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from _ppo_env import _max_over_ranks, _sync
from _ppo_workload import FixedLengthTask, Setup, fixed_length_prompts, load_tokenizer


@contextmanager
def _task_replaced(task: FixedLengthTask):
    import verl_ppo.trainer as trainer_mod

    saved = trainer_mod.build_prompt_source
    # the trainer takes its prompts from build_prompt_source(cfg, tokenizer, log)
    trainer_mod.build_prompt_source = lambda *a, **k: task
    try:
        yield
    finally:
        trainer_mod.build_prompt_source = saved


def _check_finite(m: dict[str, float], what: str) -> None:
    bad = [k for k, v in m.items() if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"{what}: non-finite metrics {bad}")


def _kernel_profiler(s: Setup) -> Any:
    """A ``torch.profiler.profile`` for the last timed step (``--torch-profile``), or None.
    That step's time includes the profiler's overhead; the table is written on exit."""
    if not s.torch_profile:
        return None
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out = Path(s.torch_profile)

    def write(p: Any) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        out.mkdir(parents=True, exist_ok=True)
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = p.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90)
        (out / f"kernels_{s.variant or 'default'}.txt").write_text(table)

    return profile(activities=acts, on_trace_ready=write)


def verl_config(s: Setup, run_dir: str) -> dict[str, Any]:
    """The trainer config of the fixed-length workload (``s.overrides`` not applied: the
    trainer takes them as dotted overrides): no eval, prompts padded to ``s.prompt_len``,
    ``s.response_len`` tokens per response (``ignore_eos``), one PPO mini-batch per rollout
    batch, ``s.warmup + s.steps`` steps, never resumed. A fresh dict the caller may extend
    (``benchmarks/gpu/_overlap_rank.py`` adds its async keys)."""
    return {
        "seed": s.seed,
        "run_dir": run_dir,
        "model": {"path": s.model_dir, "tiny": s.model_fields()},
        "data": {
            "eval_size": 0,
            "max_prompt_length": s.prompt_len,
            "pad_prompt_to": s.prompt_len,
        },
        "rollout": {"max_new_tokens": s.response_len, "ignore_eos": True},
        "train": {
            "num_steps": s.warmup + s.steps,
            "rollout_batch_size": s.rollout_batch,
            "ppo_mini_batch_size": s.rollout_batch,
            "micro_batch_size": s.micro_batch,
            "resume": "never",
        },
    }


def run_verl(s: Setup, run_dir: str) -> list[dict[str, Any]]:
    """Time ``s.warmup + s.steps`` steps of :class:`verl_ppo.PPOTrainer`; returns per-step
    dicts ``{"step_s", "phases": {name: s}, "trainer_tokens_per_s_per_gpu", ...}`` (all
    ranks hold the same values).

    Raises:
        RuntimeError: non-finite metrics, or responses/prompts not of the fixed lengths.
    """
    from verl_ppo import PPOTrainer

    cfg = verl_config(s, run_dir)
    tok = load_tokenizer(s.model_dir)
    task = FixedLengthTask(fixed_length_prompts(tok, s.rollout_batch, s.prompt_len, s.seed))
    trainer = PPOTrainer(cfg, **s.overrides)
    out = []
    with _task_replaced(task):
        trainer.setup()
        world = trainer.world
        numerics = check_log_probs_vs_hf(trainer, task, s)
        want_tokens = s.rollout_batch * (s.prompt_len + s.response_len)
        # as PPOTrainer.run(): steps numbered as in the log, from 1; a no-op unless enabled
        trainer.profiler.start(first_step=1)
        for step in range(s.warmup + s.steps):
            _sync()
            if world > 1:
                dist.barrier()
            last = step == s.warmup + s.steps - 1
            prof = (_kernel_profiler(s) if last else None) or nullcontext()
            t0 = time.perf_counter()
            with prof:
                m = trainer.train_step(step)
            _sync()
            (dt,) = _max_over_ranks([time.perf_counter() - t0])
            trainer.profiler.step()
            trainer.step = step + 1
            _check_finite(m, f"verl_ppo step {step}")
            # ignore_eos: every response is response_len long unless EOS is sampled by
            # chance (then the trainer masks after it); prompts are never padded.
            if m["response/length_mean"] < 0.95 * s.response_len:
                raise RuntimeError(
                    f"verl_ppo step {step}: mean response length {m['response/length_mean']}"
                    f" < 0.95 x {s.response_len}: rollout.ignore_eos not in effect?"
                )
            if not 0.95 * want_tokens <= m["perf/tokens"] <= want_tokens:
                raise RuntimeError(
                    f"verl_ppo step {step}: {m['perf/tokens']} tokens, expected ~{want_tokens}"
                )
            phases = {
                k.split("/", 1)[1]: v
                for k, v in m.items()
                if k.startswith("timing_s/") and k != "timing_s/step"
            }
            out.append(
                {
                    "step_s": dt,
                    "phases": phases,
                    "trainer_tokens_per_s_per_gpu": m["perf/throughput_tokens_per_s_per_gpu"],
                    "response_length_mean": m["response/length_mean"],
                    "perf": {
                        k: v
                        for k, v in m.items()
                        if k.startswith(("perf/mfu/", "perf/tflops/", "perf/decode", "memory/peak"))
                    },
                    "auto": {k: v for k, v in m.items() if k.startswith("auto/")},
                }
            )
        trainer.profiler.stop()
        out[0]["fast_path"] = dict(trainer.job.reasons)
        out[0]["token_budget"] = trainer.job.max_tokens_per_micro_batch  # None: fixed
        out[0]["numerics"] = numerics
    trainer.close()
    return out


@torch.no_grad()
def check_log_probs_vs_hf(trainer: Any, task: FixedLengthTask, s: Setup) -> dict[str, Any]:
    """Numerics before timing: the first rollout's log-probs, as the trainer computes them
    (the rollout path in use, then the actor's log-prob forward with its settings: fused
    head, packing), against a plain HF forward of the same weights (``model(...).logits``,
    fp32 ``log_softmax``).

    Bound a wrong result fails: the mean absolute difference must stay below 0.2 x the
    difference between the plain forward's log-probs and the same forward's log-probs
    of the next token (an off-by-one position, the most likely bug).

    Returns:
        ``{"ok", "rollout_vs_hf", "actor_vs_hf", "shifted_vs_hf", "bound", "tokens"}``.

    Raises:
        RuntimeError: the check fails (nothing is timed then).
    """
    from verl_ppo.roles.common import position_ids_from
    from verl_ppo.rollout.generate import response_mask_from

    n = min(8, s.rollout_batch)
    texts = [task.sample(trainer.tokenizer, "train", i).prompt for i in range(n)]
    ids, mask = trainer.experience_maker.encode(texts)
    out = trainer.experience_maker.generate(ids, mask, False, s.response_len, seed=123)
    P = ids.shape[1]
    resp = out.sequences[:, P:]
    rmask = response_mask_from(resp, -1, trainer.tokenizer.pad_token_id).to(ids.device)
    rmask = torch.ones_like(rmask)  # ignore_eos: every response token is real
    full = torch.cat([mask, rmask.long()], 1)
    model = trainer.actor.module
    model.eval()
    T = trainer.config.rollout.temperature
    from verl_ppo.step.compiled import eager_layers

    with eager_layers(model):  # the plain forward: HF's eager layers, whatever is compiled
        logits = (
            model(
                input_ids=out.sequences,
                attention_mask=full,
                position_ids=position_ids_from(full),
                use_cache=False,
            )
            .logits[:, P - 1 : -1]
            .float()
            / T
        )
    lsm = torch.log_softmax(logits, -1)
    ref = lsm.gather(-1, resp[..., None]).squeeze(-1)
    shifted = lsm[:, :-1].gather(-1, resp[:, 1:, None]).squeeze(-1)
    actor_lp = trainer.actor.lp_fn(model, out.sequences, full, P, T)[0]
    d_roll = float((out.log_probs - ref).abs().mean())
    d_actor = float((actor_lp - ref).abs().mean())
    d_shift = float((shifted - ref[:, :-1]).abs().mean())
    bound = 0.2 * d_shift
    res = {
        "ok": d_roll < bound and d_actor < bound,
        "rollout_vs_hf": d_roll,
        "actor_vs_hf": d_actor,
        "shifted_vs_hf": d_shift,
        "bound": bound,
        "tokens": int(rmask.sum()),
    }
    print(json.dumps({"numerics": res}))
    if not res["ok"]:
        raise RuntimeError(f"numerics check failed: {res}")
    return res
