"""``verl-ppo eval`` and ``verl-ppo generate``: look at a trained (or any) model.

``--model`` is a run folder (its ``hf/actor`` export, else its latest checkpoint), a HF
model folder, or a Hugging Face model id in the local cache (see
:func:`verl_ppo.data.model_store.resolve_model_path`).

``eval`` scores the held-out split of a reasoning-gym task greedily, exactly as the
trainer's own eval does (the same held-out prompts for every seed, same chat-template
prompts, same per-rank order and batch size, greedy decoding with the KV-cache sampler of
:mod:`verl_ppo.rollout.generate`, the task's scorer on the decoded response). With a run
folder (or ``--config FILE``) the task, seed, task options, response limit, rank count and
batch size default to the run's ``config.yaml`` (or that file); the score then equals the
run's ``eval/reward`` at step 0 for the same model weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_ppo.observe.metrics import progress_bar
from verl_ppo.run.export import EXPORT_DIR, META_DIR, ExportError


@dataclass
class LoadedModel:
    """A causal LM ready to generate, its tokenizer (left padding) and, for a run folder,
    the run's configuration."""

    model: torch.nn.Module
    tokenizer: Any
    source: str
    run_config: Any = None


def load_model(spec: str, device: str = "cpu") -> LoadedModel:
    """Load ``--model``: a run folder, a HF folder or a cached HF model id.

    Raises:
        verl_ppo.data.model_store.ModelStoreError: not a folder and not a cached id.
        verl_ppo.run.export.ExportError: a run folder without export or checkpoint.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_ppo.data.model_store import resolve_model_path
    from verl_ppo.workers.models import tokenizer_for_generation

    run_dir = Path(spec).expanduser()
    run_cfg = None
    if (run_dir / "config.yaml").is_file() and (run_dir / META_DIR).is_dir():
        from verl_ppo.config import load_config

        run_cfg = load_config(run_dir / "config.yaml")
        exported = run_dir / EXPORT_DIR / "actor"
        if (exported / "config.json").is_file():
            folder = exported
        else:  # no end-of-run export: the latest checkpoint, in memory
            from verl_ppo.run.export import checkpoint_state_dict, find_checkpoint

            ckpt = find_checkpoint(run_dir)
            meta = run_dir / META_DIR
            config = AutoConfig.from_pretrained(meta)
            model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
            model.load_state_dict(checkpoint_state_dict(ckpt, "actor"), strict=True)
            tok = tokenizer_for_generation(meta)
            return LoadedModel(model.to(device).eval(), tok, f"{ckpt}", run_cfg)
    else:
        folder = resolve_model_path(spec)
    model = AutoModelForCausalLM.from_pretrained(folder)
    return LoadedModel(
        model.to(device).eval(), tokenizer_for_generation(folder), str(folder), run_cfg
    )


def respond(
    lm: LoadedModel,
    prompts: list[str],
    max_new: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """Responses to a batch of rendered prompts (left padded; special tokens dropped):
    greedy at ``temperature`` 0 (as the trainer's eval), else sampled with ``seed``."""
    from verl_ppo.rollout.generate import generate, response_mask_from

    tok, model = lm.tokenizer, lm.model
    device = next(model.parameters()).device
    enc = tok(prompts, return_tensors="pt", add_special_tokens=False, padding=True)
    ids, mask = enc.input_ids.to(device), enc.attention_mask.to(device)
    seqs = generate(
        model,
        ids,
        mask,
        max_new_tokens=max_new,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        generator=torch.Generator(device=device).manual_seed(seed),
    )
    resp = seqs[:, ids.shape[1] :].cpu()
    rmask = response_mask_from(resp, tok.eos_token_id, tok.pad_token_id)
    return [tok.decode(r[m > 0].tolist(), skip_special_tokens=True) for r, m in zip(resp, rmask)]


@torch.no_grad()
def evaluate(
    lm: LoadedModel,
    task_name: str,
    n: int,
    seed: int = 0,
    task_kwargs: dict | None = None,
    max_new_tokens: int = 24,
    batch_size: int = 8,
    world: int = 1,
    progress: Callable[[int], None] | None = None,
    source: Any = None,
    score: Callable[[str, dict], float] | None = None,
) -> tuple[float, list[dict[str, Any]]]:
    """Greedy mean reward on the first ``n`` held-out prompts of ``task_name`` (or of
    ``source``, e.g. the val files of a :class:`~verl_ppo.data.file_source.FileSource`,
    scored by ``score(response, entry)``, default the source's own rule).

    Prompts are processed as the trainer's ``world`` ranks process them (rank r takes
    indices r, r + world, ..., in batches of ``batch_size``), so padding and therefore every
    floating-point operation match the trainer's eval.

    ``progress`` (optional) is called with the number of prompts done after each batch.

    Returns:
        ``(mean_reward, rows)``, one row per prompt in index order: ``index``, ``question``,
        ``response``, ``expected``, ``score``.
    """
    from verl_ppo.data.tasks import Task

    task = source or Task(
        task_name, train_size=1, eval_size=n, seed=seed, overrides=task_kwargs or {}
    )
    score = score or task.score
    rows: dict[int, dict[str, Any]] = {}
    for r in range(world):
        mine = list(range(r, n, world))
        for i in range(0, len(mine), batch_size):
            idx = mine[i : i + batch_size]
            samples = [task.sample(lm.tokenizer, "eval", j) for j in idx]
            texts = respond(lm, [s.prompt for s in samples], max_new_tokens)
            for j, s, text in zip(idx, samples, texts):
                rows[j] = {
                    "index": j,
                    "question": s.question,
                    "response": text,
                    "expected": s.entry.get(
                        "answer", s.entry.get("reward_model", {}).get("ground_truth")
                    ),
                    "score": score(text, s.entry),
                }
            if progress is not None:
                progress(len(rows))
    ordered = [rows[j] for j in range(n)]
    mean = sum(r["score"] for r in ordered) / max(n, 1)
    return mean, ordered


def _clip(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def print_table(rows: list[dict[str, Any]], limit: int = 8) -> None:
    """A small table of the first ``limit`` samples: question, response, expected, score."""
    print(f"{'#':>3}  {'question':<44}  {'response':<44}  {'expected':<10}  score")
    for r in rows[:limit]:
        print(
            f"{r['index']:>3}  {_clip(r['question'], 44):<44}  {_clip(r['response'], 44):<44}  "
            f"{_clip(r['expected'], 10):<10}  {r['score']:.2f}"
        )


def _load(prog: str, model: str, device: str) -> LoadedModel | None:
    """The model of a command line (progress and errors on stderr); None after an error."""
    from verl_ppo.data.model_store import ModelStoreError

    print(f"{prog}: loading {model} ...", file=sys.stderr, flush=True)
    try:
        return load_model(model, device)
    except (ModelStoreError, ExportError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def _eval_source(cfg: Any, a: argparse.Namespace, tokenizer: Any) -> tuple[str, dict, Any, Any]:
    """``(task name, task kwargs, source, score)`` of ``verl-ppo eval``: the built-in task
    (source and score None), or, with ``--val-files`` or a run trained on files, the val
    files scored by the run's ``reward.custom_reward_function`` (else the rule of verl rows).

    Raises:
        DataFormatError, CustomRewardError: a bad val file or reward function.
    """
    from verl_ppo.data.file_source import FileSource
    from verl_ppo.reward.base import RewardBatch

    task = a.task or cfg.data.task
    kwargs = cfg.data.task_kwargs if task == cfg.data.task else {}
    val = a.val_files or (None if a.task else cfg.data.val_files)
    if not val:
        return task, kwargs, None, None
    d = cfg.data
    source = FileSource([], val, tokenizer, prompt_key=d.prompt_key, eval_size=a.n,
                        max_prompt_length=d.max_prompt_length,
                        filter_overlong=d.filter_overlong_prompts)  # fmt: skip
    fn = cfg.reward.custom_reward_function
    if fn.path is None:
        return "val_files", {}, source, None
    from verl_ppo.reward.custom import CustomReward

    reward = CustomReward(fn.path, fn.name, on_error=fn.on_error)

    def score(text: str, entry: dict) -> float:
        return float(reward.score(RewardBatch([[0]], [[0]], [""], [text], [entry]))[0])

    return "val_files", {}, source, score


def _eval_parser() -> argparse.ArgumentParser:
    """The arguments of ``verl-ppo eval``."""
    p = argparse.ArgumentParser(
        prog="verl-ppo eval", description="Greedy held-out score of a model on a task."
    )
    p.add_argument("--model", required=True, help="run folder, HF folder or cached HF model id")
    p.add_argument(
        "--config",
        default=None,
        help="YAML config whose data/rollout/seed/batch settings are "
        "the defaults (default: the run folder's config.yaml, else the built-in defaults)",
    )
    p.add_argument("--task", default=None, help="reasoning-gym task (default: the run's)")
    p.add_argument(
        "--val-files",
        nargs="+",
        default=None,
        help="verl-format eval files (default: the run's data.val_files), scored by the run's "
        "reward.custom_reward_function, else the rule",
    )
    p.add_argument("--n", type=int, default=64, help="held-out prompts (first n of the split)")
    p.add_argument("--seed", type=int, default=None, help="split seed (default: the run's, 0)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the run's")
    p.add_argument("--batch-size", type=int, default=None, help="default: the run's per rank")
    p.add_argument("--world", type=int, default=None, help="ranks to emulate (default: run's)")
    p.add_argument("--output", default=None, help="JSONL file (default: RUN_DIR/eval or ./)")
    p.add_argument("--show", type=int, default=8, help="samples printed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def eval_main(argv: list[str] | None = None) -> int:
    """``verl-ppo eval --model M [--task T] [--n 64] ...``; returns the exit code."""
    from verl_ppo.config import PPOConfig

    a = _eval_parser().parse_args(argv)
    lm = _load("verl-ppo eval", a.model, a.device)
    if lm is None:
        return 2
    if a.config is not None:
        from verl_ppo.config import ConfigError, load_config

        try:
            cfg = load_config(a.config)
        except ConfigError as exc:
            print(f"verl-ppo eval: {exc}", file=sys.stderr)
            return 2
    else:
        cfg = lm.run_config or PPOConfig()
    has_cfg = lm.run_config is not None or a.config is not None
    world = a.world or (cfg.comm.nproc if has_cfg else 1)
    try:
        task, kwargs, source, score = _eval_source(cfg, a, lm.tokenizer)
    except ValueError as exc:  # DataFormatError, CustomRewardError: file/row/key named
        print(f"verl-ppo eval: {exc}", file=sys.stderr)
        return 2
    batch = a.batch_size or max(cfg.train.rollout_batch_size // world, 1)
    bar = progress_bar(a.n, "eval")
    t0 = time.perf_counter()

    def progress(done: int) -> None:
        bar.update(done - bar.n)
        if bar.disable:  # not a terminal: one plain line per batch
            print(
                f"verl-ppo eval: {done}/{a.n} prompts ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    mean, rows = evaluate(
        lm,
        task,
        a.n,
        seed=cfg.seed if a.seed is None else a.seed,
        task_kwargs=kwargs,
        max_new_tokens=a.max_new_tokens or cfg.rollout.eval_max_new_tokens,
        batch_size=batch,
        world=world,
        progress=progress,
        source=source,
        score=score,
    )
    bar.close()
    print_table(rows, a.show)
    out = Path(a.output) if a.output else None
    if out is None:
        base = Path(a.model) / "eval" if lm.run_config is not None else Path(".")
        out = base / f"eval_{task}_n{a.n}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"mean reward {mean:.4f} over {a.n} held-out {task} prompts (greedy) | {lm.source}")
    print(f"samples written to {out}")
    return 0


def generate_main(argv: list[str] | None = None) -> int:
    """``verl-ppo generate --model M --prompt "..."``: one completion in the chat template."""
    p = argparse.ArgumentParser(
        prog="verl-ppo generate", description="Complete one prompt in the model's chat template."
    )
    p.add_argument("--model", required=True, help="run folder, HF folder or cached HF model id")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    lm = _load("verl-ppo generate", a.model, a.device)
    if lm is None:
        return 2
    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        print(f"verl-ppo generate: {lm.source} has no chat template", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
        {"role": "user", "content": a.prompt}
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        print(respond(lm, [text], a.max_new_tokens, a.temperature, a.seed)[0])
    return 0
