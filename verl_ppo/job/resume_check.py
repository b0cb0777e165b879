"""What a resume may change: the new resolved config against the run's ``config.yaml``.

A resume (``train.resume=auto`` on a ``run_dir`` holding a complete checkpoint) continues
the optimiser states, the KL controller and the data position of the old run. Keys that
define what those states mean (model, task, algorithm, compression method, parallel
layouts, batch sizes, seed) cannot change mid-run: the new steps would silently mix two
experiments in one ``metrics.jsonl``. Keys that only say how long, how often or where to
report (steps, logging, eval and save intervals, timeouts, profiler) may change and are
listed in the log.

:data:`RESUME_RULES` is the one table that decides: the longest matching dotted prefix
wins; a key no row matches is treated as fixed (a new key is refused until someone decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# (dotted prefix of a key in config.yaml, may change on resume, why)
RESUME_RULES: tuple[tuple[str, bool, str], ...] = (
    ("", False, "defines what the checkpoint's states mean"),
    ("seed", False, "data order and sampling of the run"),
    ("run_dir", True, "the folder itself"),
    ("amp_dtype", False, "the dtype the optimiser states were trained in"),
    ("model", False, "the weights the checkpoint holds"),
    ("data", False, "the prompts and their order"),
    ("data.eval_size", True, "held-out prompts only score"),
    ("data.val_files", True, "held-out prompts only score"),
    ("rollout", False, "how training samples are drawn"),
    ("rollout.eval_max_new_tokens", True, "held-out generation only"),
    ("algorithm", False, "the objective being optimised"),
    ("actor", False, "optimiser, ZeRO stage and layout of the saved engine"),
    ("critic", False, "optimiser, ZeRO stage and layout of the saved engine"),
    ("compression", False, "the gradient reduction and its error-feedback state"),
    ("reward", False, "what is being optimised"),
    ("reward.cache_entries", True, "a cache of exact scores"),
    ("reward.async_scoring", True, "when scores are computed, not their values"),
    ("reward.num_workers", True, "where scores are computed, not their values"),
    ("train", False, "batch sizes and epochs of each update"),
    ("train.num_steps", True, "how long to train"),
    ("train.log_interval", True, "reporting"),
    ("train.eval_interval", True, "reporting"),
    ("train.save_interval", True, "checkpoint frequency"),
    ("train.keep_last_checkpoints", True, "checkpoint rotation"),
    ("train.resume", True, "the resume policy itself"),
    ("train.logger", True, "reporting backends"),
    ("train.export_hf", True, "what is written at the end"),
    ("train.export_critic", True, "what is written at the end"),
    ("train.project_name", True, "reporting"),
    ("train.experiment_name", True, "reporting"),
    ("train.wandb_mode", True, "reporting"),
    ("train.micro_batch_size", True, "gradient accumulation split, same update"),
    ("train.max_tokens_per_micro_batch", True, "gradient accumulation split, same update"),
    ("train.sequence_packing", True, "same tokens, another kernel layout"),
    ("train.fused_log_probs", True, "same maths, another kernel"),
    ("train.torch_compile", True, "same maths, compiled"),
    ("comm", True, "how ranks talk, not what they compute"),
    ("comm.nproc", False, "one trainer state per rank in the checkpoint"),
    ("profiler", True, "observation only"),
    ("monitor", True, "observation only"),
)


def rule_for(key: str) -> tuple[bool, str]:
    """``(may_change, why)`` of dotted ``key`` from :data:`RESUME_RULES` (longest prefix)."""
    best = ("", False, "")
    for prefix, may, why in RESUME_RULES:
        if (key == prefix or key.startswith(prefix + ".") or prefix == "") and len(prefix) >= len(
            best[0]
        ):
            best = (prefix, may, why)
    return best[1], best[2]


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the old run and the new config."""

    key: str
    old: Any
    new: Any
    may_change: bool
    why: str

    def __str__(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)} ({self.why})"


def _show(v: Any) -> str:
    if v is _ABSENT:
        return "(absent)"
    text = yaml.safe_dump(v, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()  # a plain scalar's document end marker


_ABSENT = object()


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and not key.endswith("task_kwargs"):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """The keys whose values differ between two config dumps (``model_dump(mode="json")``
    trees, as ``config.yaml`` holds them), classified by :data:`RESUME_RULES`."""
    a, b = _flatten(old), _flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if va != vb:
            may, why = rule_for(key)
            out.append(Change(key, va, vb, may, why))
    return out


class ResumeConfigError(RuntimeError):
    """A resume would change keys that cannot change mid-run (listed with the ways out)."""


def check_resume_config(run_dir: str | Path, new: Mapping[str, Any], checkpoint: str) -> list[str]:
    """Compare ``new`` (the resolved config dump) with ``run_dir/config.yaml``.

    Args:
        run_dir: the run folder about to be resumed.
        new: ``PPOConfig.model_dump(mode="json", by_alias=True)`` of the new job.
        checkpoint: name of the checkpoint to resume from (for the messages).

    Returns:
        Lines to log: each changed key that may change, or a note when the old run left no
        ``config.yaml`` (nothing to compare).

    Raises:
        ResumeConfigError: a key that cannot change differs; the message lists every
            difference and the ways out (``train.resume=never``, another ``run_dir``).
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return [f"resume from {checkpoint}: {path} is missing, the config was not compared"]
    old = yaml.safe_load(path.read_text()) or {}
    changes = diff_configs(old, new)
    fixed = [c for c in changes if not c.may_change]
    if fixed:
        lines = "\n".join(f"  {c}" for c in fixed)
        raise ResumeConfigError(
            f"run_dir {str(run_dir)!r} holds a run (checkpoint {checkpoint}) whose config "
            f"differs in keys that cannot change mid-run:\n{lines}\n"
            "Ways out: train.resume=never to start over (the old metrics.jsonl and "
            "checkpoints/ are moved aside), another run_dir for the new settings, or the "
            f"run's own values (see {path})"
        )
    return [f"resume from {checkpoint}: {c}" for c in changes]
