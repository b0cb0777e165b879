"""The workload of ``benchmarks/ppo_throughput.py`` (and ``profile_ppo.py``): model shapes,
the :class:`Setup` of one run, fixed-length prompts, the :class:`FixedLengthTask` handed to
the trainer, SmolLM2's tokenizer."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    "qwen15b": {  # the wider shape (Qwen2.5-1.5B's dims; head_dim 128)
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
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
    torch_profile: str | None = None  # folder for the last timed step's kernel table
    trl_micro_batch: int | None = None  # TRL's per_device_train_batch_size (None: micro_batch)
    trl_compile: bool = False  # TRL's own TrainingArguments.torch_compile

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Setup:
        """From parsed options (:func:`add_workload_args` plus ``warmup``, ``steps``)."""
        names = ("shape", "layers", "prompt_len", "response_len", "rollout_batch")
        names += ("micro_batch", "warmup", "steps", "model_dir", "run_id", "variant")
        names += ("torch_profile", "trl_micro_batch", "trl_compile")
        kw = {n: getattr(a, n, None) for n in names}
        kw["trl_compile"] = bool(kw["trl_compile"])
        return cls(**kw)

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


def load_tokenizer(model_dir: str | None) -> Any:
    """SmolLM2's tokenizer from ``model_dir`` (or the packaged model), left padding,
    pad = eos when unset (what ``verl_ppo.workers.models.load_tokenizer`` does)."""
    from types import SimpleNamespace

    from verl_ppo.workers.models import load_tokenizer as _load

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
