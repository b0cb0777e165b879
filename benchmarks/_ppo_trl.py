"""TRL in ``benchmarks/ppo_throughput.py``: timed steps of TRL's
``trl.experimental.ppo.PPOTrainer`` on the same workload, phases from synchronised wrappers
around its module functions."""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from _ppo_env import _max_over_ranks, _sync
from _ppo_workload import Setup, fixed_length_prompts, load_tokenizer
from import_stand_ins import install_import_stand_ins


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


def run_trl(s: Setup, out_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Time TRL's ``trl.experimental.ppo.PPOTrainer`` on the same setup; returns the
    per-step dicts (as :func:`run_verl`) and the stand-in module names used.

    Raises:
        RuntimeError: a generation shorter than prompt + response, or non-finite losses.
    """
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    stand_ins = install_import_stand_ins()
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    tok = load_tokenizer(s.model_dir)
    texts = fixed_length_prompts(tok, s.rollout_batch, s.prompt_len, s.seed)
    rows = [{"input_ids": tok(t, add_special_tokens=False).input_ids} for t in texts]
    fields = s.model_fields()
    model_type = fields.pop("model_type")
    cfg = AutoConfig.for_model(model_type, pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(s.seed)
    policy = AutoModelForCausalLM.from_config(cfg).to(dtype)
    ref = AutoModelForCausalLM.from_config(cfg).to(dtype)
    ref.load_state_dict(policy.state_dict())
    vcfg = AutoConfig.for_model(model_type, pad_token_id=tok.pad_token_id, num_labels=1, **fields)
    value = AutoModelForSequenceClassification.from_config(vcfg).to(dtype)
    # The reward model: 1 layer, so its forward costs little (own config object: models
    # keep a reference to theirs).
    rfields = {**fields, "num_hidden_layers": 1}
    rcfg = AutoConfig.for_model(model_type, pad_token_id=tok.pad_token_id, num_labels=1, **rfields)
    reward = AutoModelForSequenceClassification.from_config(rcfg).to(dtype)
    if len(value.model.layers) != fields["num_hidden_layers"] or value.config is rcfg:
        raise RuntimeError("TRL value model does not have the policy's depth")

    world = int(os.environ.get("WORLD_SIZE", 1))
    local = s.rollout_batch // world
    micro = s.trl_micro_batch or s.micro_batch
    if local * world != s.rollout_batch or local % micro:
        raise ValueError(
            f"--rollout-batch {s.rollout_batch} must split into {world} ranks x a multiple of "
            f"TRL's micro-batch {micro} (--trl-micro-batch, else --micro-batch)"
        )
    args = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=local // micro,
        torch_compile=s.trl_compile,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=s.rollout_batch * (s.warmup + s.steps),
        local_rollout_forward_batch_size=local,
        response_length=s.response_len,
        stop_token=None,
        missing_eos_penalty=None,
        num_sample_generations=0,
        temperature=1.0,
        learning_rate=1e-6,
        gradient_checkpointing=False,
        bf16=cuda,
        use_cpu=not cuda,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=s.seed,
    )
    acc: dict[str, float] = {"gen": 0.0, "ref": 0.0, "values_reward": 0.0}
    want_len = s.prompt_len + s.response_len

    def timed(fn, key, check_len=False, only_no_grad=False):
        def wrapper(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            _sync()
            t0 = time.perf_counter()
            res = fn(*a, **k)
            _sync()
            acc[key] += time.perf_counter() - t0
            if check_len and res[0].shape[1] != want_len:
                raise RuntimeError(f"TRL generated {res[0].shape[1]} positions, not {want_len}")
            return res

        return wrapper

    ppo_mod.batch_generation = timed(ppo_mod.batch_generation, "gen", check_len=True)
    ppo_mod.forward = timed(ppo_mod.forward, "ref", only_no_grad=True)
    ppo_mod.get_reward = timed(ppo_mod.get_reward, "values_reward")
    steps: list[dict[str, Any]] = []

    class Clock(TrainerCallback):
        """Synchronised wall-clock marks around TRL's training phases (seconds)."""

        def on_train_begin(self, *a, **k):
            _sync()
            self.t = time.perf_counter()

        def on_log(self, _args, state, control, logs=None, **k):
            bad = [
                x
                for x in ("loss/policy_avg", "loss/value_avg")
                if not math.isfinite(float(logs[x]))
            ]
            if bad:
                raise RuntimeError(f"TRL step {state.global_step}: non-finite {bad}")

        def on_step_end(self, *a, **k):
            _sync()
            now = time.perf_counter()
            vals = _max_over_ranks([now - self.t, acc["gen"], acc["ref"], acc["values_reward"]])
            phases = dict(zip(("gen", "ref", "values_reward"), vals[1:]))
            phases["update_and_other"] = max(vals[0] - sum(vals[1:]), 0.0)
            steps.append({"step_s": vals[0], "phases": phases})
            for key in acc:
                acc[key] = 0.0
            self.t = time.perf_counter()

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=_ListDataset(rows),
        eval_dataset=_ListDataset(rows[: max(world, 1)]),
        callbacks=[Clock()],
    )
    trainer.train()
    if len(steps) != s.warmup + s.steps:
        raise RuntimeError(f"TRL ran {len(steps)} steps, expected {s.warmup + s.steps}")
    return steps, stand_ins
