"""PPO throughput, ours (verl_ppo) vs TRL's PPO trainer, same model, lengths and batch.

Protocol (issue 8, "GPU throughput, side by side"):

* Model: a Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` with random weights (``--shape qwen05b``:
  hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864, vocab 151936, tied embeddings),
  SmolLM2's tokenizer (vocab 49152 fits the 151936 embedding). Critic / value model: the same
  backbone with a scalar head in both systems.
* Prompts: ``--prompt-len`` (256) real tokens each, no padding: common English words whose
  tokenization is checked to be exactly that long. Both systems get the same prompt texts.
* Responses: exactly ``--response-len`` (256) sampled tokens (ours: ``rollout.ignore_eos``;
  TRL: no stop token). Checked after every step (fail loudly otherwise).
* Batch: ``--rollout-batch`` sequences per step, global (128 = 64 per GPU on 2 GPUs), one
  optimizer step per PPO step for actor and critic (mini-batch = rollout batch, 1 epoch),
  ``--micro-batch`` sequences per forward/backward per rank. TRL: ``per_device_train_batch_size
  = micro``, ``gradient_accumulation_steps = local batch / micro``, ``num_mini_batches = 1``,
  ``local_rollout_forward_batch_size = local batch``; gradient checkpointing off in both.
* dtype: bf16 on GPU in both (ours: DeepSpeed bf16; TRL: bf16 weights + ``bf16=True``).
* Reward: ours a rule (string match, CPU); TRL needs a reward *model*: a 1-layer model of
  the same width, so that its reward costs little, like ours.
* Timing: ``--warmup`` steps untimed, then ``--steps`` steps; each step's wall time is taken
  between CUDA-synchronized points and the max over ranks is kept; the median over steps is
  reported. tokens/s/GPU = rollout batch x (prompt + response) / median step time / GPUs.
  Phase breakdown: ours from the trainer's ``timing_s/*`` (CUDA-synchronized phases); TRL
  from wrappers (synchronized) around its module functions ``batch_generation`` (gen),
  ``forward`` without grad (ref) and ``get_reward`` (values + reward);
  ``update_and_other`` = step minus those (log-probs from the generation scores, GAE, the
  PPO update of policy and value, TRL's logging and cache emptying). TRL computes the old
  log-probs from its generation logits; ours runs a separate ``old_log_prob`` forward.
* Each system runs in its own launch (``torchrun --nproc_per_node=2``): separate processes
  so that neither inherits the other's allocator state or process group.

The fixed-length prompts are not a reasoning-gym task (and reasoning-gym is not installed
on the GPU machine), so the benchmark hands the trainer a :class:`FixedLengthTask` in place
of ``verl_ppo.trainer.Task`` for the duration of the run (same ``sample``/``score``
interface). TRL 1.12.0 (the last release with ``trl.experimental.ppo``) imports pandas,
datasets and pyarrow at module level although its PPO training loop never calls them; where
they are not installed (the GPU machine; pyarrow + pandas would exceed the 64 MiB carried
there), :func:`install_import_stand_ins` serves import-time stand-ins whose classes raise on
use. Records say which (``trl_stand_ins``).

Usage::

    python benchmarks/ppo_throughput.py --smoke --out /tmp/ppo     # CPU, tiny model, < 90 s
    python benchmarks/ppo_throughput.py --export-tokenizer .whl/tok  # tokenizer folder for GPU
    torchrun --nproc_per_node=2 benchmarks/ppo_throughput.py --system verl_ppo \
        --model-dir .whl/tok --out OUT
    torchrun --nproc_per_node=2 benchmarks/ppo_throughput.py --system trl_ppo \
        --model-dir .whl/tok --out OUT
    python benchmarks/ppo_throughput.py --report --out OUT           # markdown + speedup
    (benchmarks/gpu_ppo_throughput.sh OUTDIR does all of that on 2 x H200)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BENCH = "ppo_throughput"
REPO = Path(__file__).resolve().parents[1]
TARGET_SPEEDUP = 3.0  # issue 15: ours with default settings >= 3x TRL tokens/s/GPU
TARGET_MFU = 0.35  # issue 15: actor and critic updates
SHAPES: dict[str, dict[str, Any]] = {
    "qwen05b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    },
}
WORDS = (
    "the of and to in is was for on as with by at from that this which are be or an have "
    "not but all were when there can more one their has been would who will its into time "
    "only about also new other some could these two may first then any like over such than "
    "most made after many where through back years much before good great world own well "
    "long same day year work life way just state part place between high under last city"
).split()


@dataclass
class Setup:
    """One benchmark configuration (sizes in sequences/tokens; batch global over ranks)."""

    shape: str = "qwen05b"
    layers: int | None = None  # override of the shape's num_hidden_layers (quick checks)
    prompt_len: int = 256
    response_len: int = 256
    rollout_batch: int = 128
    micro_batch: int = 8
    warmup: int = 1
    steps: int = 3
    seed: int = 0
    model_dir: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None  # shared by every record of one device call
    variant: str | None = None  # name of the overrides (None: "default" or the overrides)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Setup:
        """From parsed options (:func:`add_workload_args` plus ``warmup``, ``steps``)."""
        names = ("shape", "layers", "prompt_len", "response_len", "rollout_batch")
        names += ("micro_batch", "warmup", "steps", "model_dir", "run_id", "variant")
        return cls(**{n: getattr(a, n, None) for n in names})

    def model_fields(self) -> dict[str, Any]:
        """HF config fields of the model (``model_type`` included)."""
        fields = dict(SHAPES[self.shape])
        if self.layers is not None:
            fields["num_hidden_layers"] = self.layers
        return fields


# ----------------------------------------------------------------- prompts and task
def fixed_length_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[str]:
    """``n`` texts of common words, each exactly ``length`` tokens under ``tokenizer``
    (``add_special_tokens=False``).

    Raises:
        RuntimeError: a text's tokenization does not round-trip to ``length`` tokens.
    """
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = tokenizer(
            " ".join(rng.choice(WORDS) for _ in range(2 * length)), add_special_tokens=False
        ).input_ids[:length]
        text = tokenizer.decode(ids)
        got = len(tokenizer(text, add_special_tokens=False).input_ids)
        if got != length:
            raise RuntimeError(f"prompt {i}: {got} tokens after a round trip, wanted {length}")
        out.append(text)
    return out


@dataclass
class _Sample:
    prompt: str
    question: str
    entry: dict


class FixedLengthTask:
    """Stand-in for :class:`verl_ppo.data.tasks.Task` with fixed-length prompts.

    ``sample(tokenizer, split, index)`` cycles over ``prompts``; ``score`` is 1.0 when the
    completion contains the entry's answer word (a cheap rule, like reasoning-gym's).
    """

    def __init__(self, prompts: list[str], seed: int = 0) -> None:
        rng = random.Random(seed + 1)
        self.train = [{"question": p, "answer": rng.choice(WORDS)} for p in prompts]
        self.eval = self.train[:1]
        self.name = "fixed_length"

    def sample(self, tokenizer: Any, split: str, index: int) -> _Sample:
        """The ``index``-th prompt (cycled), its text used verbatim (no chat template)."""
        ds = self.train if split == "train" else self.eval
        e = ds[index % len(ds)]
        return _Sample(e["question"], e["question"], e)

    def score(self, completion: str, entry: dict) -> float:
        """1.0 if ``entry["answer"]`` occurs as a word in ``completion``, else 0.0."""
        return float(entry["answer"] in completion.split())


# ----------------------------------------------------------------- environment helpers
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise max of ``values`` over ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    t = torch.tensor(values, dtype=torch.float64, device=dev or "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "deepspeed", "trl", "accelerate", "pydantic"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _device(world: int) -> str:
    if torch.cuda.is_available():
        return f"{world} x {torch.cuda.get_device_name(0)}"
    return f"cpu ({world} process{'es' if world > 1 else ''})"


def _commit() -> str:
    if os.environ.get("VERL_COMMIT"):
        return os.environ["VERL_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def load_tokenizer(model_dir: str | None) -> Any:
    """SmolLM2's tokenizer from ``model_dir`` (or the packaged model), left padding,
    pad = eos when unset (what ``verl_ppo.models.load_tokenizer`` does)."""
    from types import SimpleNamespace

    from verl_ppo.models import load_tokenizer as _load

    return _load(SimpleNamespace(path=model_dir))


def export_tokenizer(dest: str, shape: str = "qwen05b") -> Path:
    """Write a model folder holding only ``config.json`` (the ``shape``) and SmolLM2's
    tokenizer files (a few MB): usable as ``model.path`` with ``model.tiny`` weights."""
    from transformers import AutoConfig

    p = Path(dest)
    p.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(None)
    tok.save_pretrained(p)
    fields = dict(SHAPES[shape])
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(p)
    return p


# ----------------------------------------------------------------- ours
@contextmanager
def _task_replaced(task: FixedLengthTask):
    import verl_ppo.trainer as trainer_mod

    saved = trainer_mod.Task
    trainer_mod.Task = lambda *a, **k: task  # the trainer calls Task(name, train_size=...)
    try:
        yield
    finally:
        trainer_mod.Task = saved


def _check_finite(m: dict[str, float], what: str) -> None:
    bad = [k for k, v in m.items() if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"{what}: non-finite metrics {bad}")


def run_verl(s: Setup, run_dir: str) -> list[dict[str, Any]]:
    """Time ``s.warmup + s.steps`` steps of :class:`verl_ppo.PPOTrainer`; returns per-step
    dicts ``{"step_s", "phases": {name: s}, "trainer_tokens_per_s_per_gpu", ...}`` (all
    ranks hold the same values).

    Raises:
        RuntimeError: non-finite metrics, or responses/prompts not of the fixed lengths.
    """
    from verl_ppo import PPOTrainer

    cfg = {
        "seed": s.seed,
        "run_dir": run_dir,
        "model": {"path": s.model_dir, "tiny": s.model_fields()},
        "data": {
            "eval_size": 0,
            "max_prompt_len": s.prompt_len,
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
            t0 = time.perf_counter()
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
        out[0]["fast_path"] = trainer.fast.reasons
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
    logits = (
        model(input_ids=out.sequences, attention_mask=full, position_ids=position_ids_from(full))
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


# ----------------------------------------------------------------- TRL
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helper module
from import_stand_ins import install_import_stand_ins  # noqa: E402


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
    if local * world != s.rollout_batch or local % s.micro_batch:
        raise ValueError(
            f"--rollout-batch {s.rollout_batch} must split into {world} ranks x a multiple of "
            f"--micro-batch {s.micro_batch}"
        )
    args = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=local // s.micro_batch,
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


# ----------------------------------------------------------------- records
def summarize(
    system: str, s: Setup, steps: list[dict[str, Any]], world: int, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Records for the timed steps (after warm-up): tokens/s/GPU, step time, phases."""
    timed = steps[s.warmup :]
    step_med = statistics.median(x["step_s"] for x in timed)
    tokens = s.rollout_batch * (s.prompt_len + s.response_len)
    base = {
        "benchmark": BENCH,
        "system": system,
        "device": _device(world),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "world_size": world,
        "shape": s.shape if s.layers is None else f"{s.shape}, {s.layers} layers",
        "prompt_len": s.prompt_len,
        "response_len": s.response_len,
        "rollout_batch": s.rollout_batch,
        "micro_batch": s.micro_batch,
        "warmup_steps": s.warmup,
        "timed_steps": len(timed),
        "overrides": s.overrides,
        "variant": s.variant or _variant(s.overrides),
        "run_id": s.run_id,
        **extra,
    }
    numerics = steps[0].get("numerics")
    base["numerics_ok"] = bool(numerics["ok"]) if numerics else None
    base["numerics"] = numerics or "TRL: finite policy and value losses checked every step"
    if steps[0].get("fast_path"):
        base["fast_path"] = steps[0]["fast_path"]
    recs = [
        {
            **base,
            "metric": "tokens_per_s_per_gpu",
            "value": tokens / step_med / world,
            "unit": "tokens/s/GPU",
            "tokens_per_step": tokens,
            "step_s_all": [round(x["step_s"], 4) for x in timed],
        },
        {**base, "metric": "step_time_s", "value": step_med, "unit": "s"},
    ]
    for name in timed[0]["phases"]:
        recs.append(
            {
                **base,
                "metric": "phase_time_s",
                "phase": name,
                "value": statistics.median(x["phases"].get(name, 0.0) for x in timed),
                "unit": "s",
            }
        )
    if "trainer_tokens_per_s_per_gpu" in timed[0]:
        recs.append(
            {
                **base,
                "metric": "trainer_tokens_per_s_per_gpu",
                "value": statistics.median(x["trainer_tokens_per_s_per_gpu"] for x in timed),
                "unit": "tokens/s/GPU",
                "note": "the trainer's perf/throughput_tokens_per_s_per_gpu: non-pad tokens "
                "over the sum of its phase times",
            }
        )
    units = {"perf/mfu/": ("mfu", "fraction"), "perf/tflops/": ("tflops", "TFLOP/s/GPU")}
    units["memory/peak_gib/"] = ("peak_memory", "GiB")
    for key in timed[0].get("perf", {}):
        vals = [x["perf"][key] for x in timed if key in x.get("perf", {})]
        for prefix, (metric, unit) in units.items():
            if key.startswith(prefix):
                recs.append(
                    {**base, "metric": metric, "phase": key[len(prefix) :], "unit": unit,
                     "value": statistics.median(vals)}
                )  # fmt: skip
        if key.startswith("perf/decode"):
            unit = "x" if key.endswith("vs_floor") else "tokens/s/GPU"
            recs.append(
                {**base, "metric": key.split("/", 1)[1], "unit": unit,
                 "value": statistics.median(vals)}
            )  # fmt: skip
    return recs


def floor_record(s: Setup, world: int, base: dict[str, Any]) -> dict[str, Any] | None:
    """The step-time floor of the workload from the model shape (1 x the device peaks):
    matmul FLOPs of what PPO needs (actor and critic updates, ref and values forwards; the
    LM head on response positions) at peak FLOP/s plus the rollout's decode floor
    (:mod:`verl_ppo.perf`). None off CUDA or on an unknown device."""
    from types import SimpleNamespace

    from verl_ppo.perf import ModelFlops, device_peaks

    if not torch.cuda.is_available():
        return None
    peak = device_peaks(torch.device("cuda", torch.cuda.current_device()))
    if peak is None:
        return None
    mf = ModelFlops.of(SimpleNamespace(**s.model_fields()))
    local = s.rollout_batch // world
    lens = torch.full((local,), s.prompt_len + s.response_len)
    resp = local * s.response_len
    fa, fc = mf.forward(lens, resp), mf.forward(lens, 0)
    model_s = (3 * fa + 3 * fc + fa + fc) / peak[0]
    gen_s = mf.decode_floor_s(local, s.prompt_len, s.response_len, peak)
    step = model_s + gen_s
    tokens = s.rollout_batch * (s.prompt_len + s.response_len)
    return {
        **{k: base.get(k) for k in ("benchmark", "device", "versions", "date", "commit", "run_id")},
        "system": "floor",
        "variant": "model shape at 100% of peak",
        "world_size": world,
        "metric": "tokens_per_s_per_gpu",
        "value": tokens / step / world,
        "unit": "tokens/s/GPU",
        "step_s": step,
        "model_flops_s": model_s,
        "gen_floor_s": gen_s,
        "peak_flops": peak[0],
        "hbm_bytes_per_s": peak[1],
    }


def append_records(out: Path, recs: list[dict[str, Any]]) -> None:
    """Append JSON lines to ``out/ppo_throughput.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{BENCH}.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")


def _variant(overrides: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "default"


def _fmt(rec: dict[str, Any] | None, spec: str) -> str:
    return "-" if rec is None else format(rec["value"], spec)


def write_report(out: Path, run_id: str | None = None) -> dict[str, Any] | None:
    """Write ``out/ppo_throughput.md`` from the JSON lines of one run (``run_id``; default:
    that of the last record) and append a ``speedup_vs_trl`` record (ours with default
    settings over TRL) when both were measured; returns that record or None.

    Tables: every system and variant next to TRL and the floor of the model shape; then,
    for ours, MFU, TFLOP/s and peak memory per phase; then the targets as measured."""
    recs = [json.loads(x) for x in (out / f"{BENCH}.jsonl").read_text().splitlines() if x]
    run_id = run_id or next((r.get("run_id") for r in reversed(recs) if r.get("run_id")), None)
    recs = [r for r in recs if r.get("run_id") == run_id]
    last: dict[tuple, dict[str, Any]] = {}
    for r in recs:
        if r["metric"] != "speedup_vs_trl":
            last[(r["system"], r.get("variant", "default"), r["metric"], r.get("phase"))] = r
    rows = sorted(
        {k[:2] for k in last if k[2] == "tokens_per_s_per_gpu"},
        key=lambda k: (k[0] == "floor", k[0], k[1] != "default", k[1]),
    )
    get = last.get
    trl = get(("trl_ppo", "default", "tokens_per_s_per_gpu", None))
    floor = next((last[(*k, "tokens_per_s_per_gpu", None)] for k in rows if k[0] == "floor"), None)
    lines = [f"# {BENCH}", "", f"run_id `{run_id}`", ""]
    real = [k for k in rows if k[0] != "floor"]
    if real:
        r0 = last[(*real[0], "tokens_per_s_per_gpu", None)]
        lines += [
            f"{r0['device']}; {r0['shape']} shape (random weights), prompt {r0['prompt_len']}"
            f" + response {r0['response_len']} tokens, rollout batch {r0['rollout_batch']} "
            f"(global), micro-batch {r0['micro_batch']} per rank (ours: unless a token budget "
            f"applies); median of {r0['timed_steps']} steps after {r0['warmup_steps']} warm-up; "
            "each system in its own launch. tokens/s/GPU = batch x (prompt + response) / "
            "step time / GPUs. Floor: the model shape's matmul FLOPs of PPO (updates 3x, ref and "
            "values 1x a forward) at the dense bf16 peak plus the decode floor (weights + KV "
            "cache read per step at HBM bandwidth).",
            "",
            "| system | variant | tokens/s/GPU | vs TRL | of floor | step (s) | phases: median s "
            "| numerics | commit, date |",
            "|---|---|---:|---:|---:|---:|---|---|---|",
        ]
    for row in rows:
        tps = last[(*row, "tokens_per_s_per_gpu", None)]
        st = get((*row, "step_time_s", None))
        ph = ", ".join(
            f"{k[3]} {v['value']:.3g}" for k, v in last.items() if k[:3] == (*row, "phase_time_s")
        )
        if row[0] == "floor":
            ph = f"model FLOPs {tps['model_flops_s']:.3g}, gen {tps['gen_floor_s']:.3g}"
        num = tps.get("numerics")
        if isinstance(num, dict):
            num = (
                f"{'ok' if num['ok'] else 'FAILED'}: |rollout-HF| {num['rollout_vs_hf']:.3g}, "
                f"|actor-HF| {num['actor_vs_hf']:.3g} < {num['bound']:.3g}"
            )
        vs_trl = f"{tps['value'] / trl['value']:.2f}" if trl else "-"
        of_floor = f"{tps['value'] / floor['value']:.0%}" if floor else "-"
        step = tps.get("step_s") if st is None else st["value"]
        lines.append(
            f"| {row[0]} | {row[1]} | {tps['value']:.0f} | {vs_trl} | {of_floor} | {step:.3g} "
            f"| {ph} | {num or '-'} | {tps['commit']}, {tps['date']} |"
        )
    ours = [k for k in real if k[0] == "verl_ppo"]
    if ours:
        lines += [
            "",
            "Ours per phase (median over the timed steps): MFU = model FLOPs (verl's counting, "
            "verl_ppo/perf.py) / time / dense bf16 peak; peak = max CUDA memory allocated.",
            "",
            "| variant | phase | MFU | TFLOP/s | peak GiB |",
            "|---|---|---:|---:|---:|",
        ]
        for row in ours:
            phases = sorted({k[3] for k in last if k[:2] == row and k[2] == "peak_memory"})
            phases += sorted(
                {k[3] for k in last if k[:2] == row and k[2] in ("mfu", "tflops")} - set(phases)
            )
            for ph in phases:
                mfu, tf = get((*row, "mfu", ph)), get((*row, "tflops", ph))
                mem = get((*row, "peak_memory", ph))
                lines.append(
                    f"| {row[1]} | {ph} | {_fmt(mfu, '.1%')} | {_fmt(tf, '.0f')} | "
                    f"{_fmt(mem, '.1f')} |"
                )
            dec, fl = get((*row, "decode_tokens_per_s", None)), get((*row, "decode_vs_floor", None))
            if dec and fl:
                lines.append(
                    f"| {row[1]} | gen: decode {dec['value']:.0f} tokens/s | "
                    f"{fl['value']:.0%} of the floor | | |"
                )
        fp = last[(*ours[0], "tokens_per_s_per_gpu", None)].get("fast_path")
        if fp:
            lines += ["", "What `auto` resolved to (ours, default):", ""]
            lines += [f"- `{k}` = {v}" for k, v in fp.items()]
    for k, r in last.items():
        if k[2] == "skipped":
            lines.append(f"\n{k[0]} skipped: {r['reason']}")
    speed = None
    if trl and ("verl_ppo", "default") in set(rows):
        o = last[("verl_ppo", "default", "tokens_per_s_per_gpu", None)]
        ratio = o["value"] / trl["value"]
        speed = {
            **{
                k: o.get(k) for k in ("benchmark", "device", "versions", "date", "commit", "run_id")
            },
            "system": "verl_ppo",
            "variant": "default",
            "world_size": o.get("world_size"),
            "metric": "speedup_vs_trl",
            "value": ratio,
            "unit": "x",
            "target": TARGET_SPEEDUP,
            "met": ratio >= TARGET_SPEEDUP,
            "trl_stand_ins": trl.get("trl_stand_ins"),
        }
        append_records(out, [speed])
        lines += ["", "Targets (issue 15), as measured:", ""]
        lines.append(
            f"- ours with default settings >= {TARGET_SPEEDUP} x TRL tokens/s/GPU: "
            f"{ratio:.2f} x -> {'met' if speed['met'] else 'NOT met'}"
        )
        for ph in ("actor", "critic"):
            mfu = get(("verl_ppo", "default", "mfu", ph))
            if mfu:
                ok = mfu["value"] >= TARGET_MFU
                lines.append(
                    f"- MFU of the {ph} update (default) >= {TARGET_MFU:.0%}: "
                    f"{mfu['value']:.1%} -> {'met' if ok else 'NOT met'}"
                )
        if trl.get("trl_stand_ins"):
            lines.append(
                f"\nTRL {trl['versions'].get('trl')} ran with import-time stand-ins for "
                f"{', '.join(trl['trl_stand_ins'])} (not installed; unused by its PPO loop)."
            )
    (out / f"{BENCH}.md").write_text("\n".join(lines) + "\n")
    return speed


# ----------------------------------------------------------------- CLI
def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's options (model folder and shape, lengths, batch sizes); shared with
    ``benchmarks/profile_ppo.py``."""
    p.add_argument("--model-dir", default=None, help="config.json + tokenizer folder")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's depth")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--rollout-batch", type=int, default=128, help="sequences per step, global")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per fwd/bwd per rank")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="verl_ppo config override, e.g. gradient_compression=int8 (repeatable)",
    )  # fmt: skip


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 1+1 steps, for CI")
    p.add_argument("--system", choices=("verl_ppo", "trl_ppo", "both"), default="both")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output folder")
    add_workload_args(p)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--report", action="store_true", help="only write the markdown report")
    p.add_argument(
        "--run-id", default=os.environ.get("VERL_RUN_ID"),
        help="id shared by every record of one device call (default: $VERL_RUN_ID, else new)",
    )  # fmt: skip
    p.add_argument("--variant", default=None, help="name of this run's --set overrides")
    p.add_argument("--export-tokenizer", metavar="DIR", help="write the tokenizer folder, exit")
    a = p.parse_args(argv)
    if not a.run_id and not a.report:
        a.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if a.smoke:
        a.shape, a.prompt_len, a.response_len = "tiny", 16, 8
        a.rollout_batch, a.micro_batch, a.warmup, a.steps = 4, 2, 1, 1
    return a


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 = all requested systems measured)."""
    a = _args(argv)
    out = Path(a.out)
    if a.export_tokenizer:
        print(export_tokenizer(a.export_tokenizer, a.shape))
        return 0
    if a.report:
        print(write_report(out, a.run_id))
        return 0
    from verl_ppo.config import parse_overrides

    s = Setup.from_args(a)
    systems = ["verl_ppo", "trl_ppo"] if a.system == "both" else [a.system]
    status = 0
    for system in systems:
        with tempfile.TemporaryDirectory(prefix=f"{system}_") as tmp:
            if system == "verl_ppo":
                s.overrides = _flatten(parse_overrides(a.set))
                env = dict(os.environ)
                steps = run_verl(s, tmp)
                extra: dict[str, Any] = {}
                # Outside torchrun the trainer sets RANK/MASTER_PORT/... for its own one-rank
                # group (destroyed by close()); TRL must not try to join that one.
                for k in set(os.environ) - set(env):
                    del os.environ[k]
            else:
                s.overrides = {}
                if importlib.util.find_spec("trl") is None:
                    reason = "trl is not installed (pip install trl==1.12.0 accelerate)"
                    print(f"# {system} skipped: {reason}")
                    if _rank_world()[0] == 0:
                        append_records(out, [_skip_record(system, reason, s.run_id)])
                    continue
                steps, stand_ins = run_trl(s, tmp)
                extra = {"trl_stand_ins": stand_ins, "trl_reward_model_layers": 1}
        rank, world = _rank_world()
        recs = summarize(system, s, steps, world, extra)
        if system == "verl_ppo":
            fl = floor_record(s, world, recs[0])
            recs += [fl] if fl else []
        if rank == 0:
            append_records(out, recs)
            print(json.dumps({"system": system, "tokens_per_s_per_gpu": recs[0]["value"]}))
    if _rank_world()[0] == 0 and (a.smoke or a.system == "both"):
        write_report(out, s.run_id)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return status


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _skip_record(system: str, reason: str, run_id: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "benchmark": BENCH,
        "system": system,
        "metric": "skipped",
        "value": None,
        "unit": None,
        "reason": reason,
        "device": _device(1),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
    }


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "FixedLengthTask",
    "Setup",
    "export_tokenizer",
    "fixed_length_prompts",
    "install_import_stand_ins",
    "run_trl",
    "run_verl",
    "summarize",
    "write_report",
]
