"""Where a pipeline stage gets its weights from, by HF parameter name.

- A pretrained HF folder: tensors are read one by one from its safetensors files
  (``safetensors.safe_open``), so a rank reads only its stage's tensors and never holds
  the full model.
- A randomly initialised ``model.tiny`` model: it is built once, seeded exactly as the
  data-parallel path builds it (so both layouts start from the same weights), its stage's
  tensors are taken and the rest is released by :meth:`WeightSource.release` before the
  engines are created. This transient full copy exists for random-init models only.

The critic's names are its backbone's under ``backbone.`` plus ``value_head.*`` (zeros, as
:class:`~verl_ppo.roles.critic.ValueModel` starts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from verl_ppo.job.model_family import LLAMA_NAMES


class WeightSource:
    """Tensors by HF name, cast to ``dtype``.

    Args:
        config: the HF config of the policy.
        dtype: parameter dtype of the engines.
        tensors: name -> tensor (random-init models), or None.
        folder: a HF folder with ``model.safetensors`` (or an index of shards), or None.
    """

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        tensors: dict[str, torch.Tensor] | None = None,
        folder: Path | None = None,
    ) -> None:
        self.config, self.dtype = config, dtype
        self._tensors = tensors
        self._folder = folder
        self._index: dict[str, str] | None = None
        if folder is not None:
            idx = folder / "model.safetensors.index.json"
            if idx.is_file():
                self._index = json.loads(idx.read_text())["weight_map"]
            elif not (folder / "model.safetensors").is_file():
                raise FileNotFoundError(
                    f"{folder} holds no model.safetensors (pipeline training reads it)"
                )

    @classmethod
    def from_model(cls, model: torch.nn.Module, dtype: torch.dtype) -> WeightSource:
        """Tensors of an in-memory HF causal LM (kept until :meth:`release`)."""
        sd = {n: p.detach() for n, p in model.named_parameters()}
        return cls(model.config, dtype, tensors=sd)

    def _raw(self, name: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[name]
        from safetensors import safe_open

        file = "model.safetensors" if self._index is None else self._index[name]
        with safe_open(str(self._folder / file), framework="pt") as f:
            return f.get_tensor(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor named ``name`` (HF name; ``backbone.X`` = the policy's ``model.X``;
        ``value_head.*`` zeros; a tied ``lm_head.weight`` = the embedding).

        Raises:
            KeyError: unknown name.
        """
        if name.startswith("value_head."):
            shape = (1, self.config.hidden_size) if name.endswith("weight") else (1,)
            return torch.zeros(shape, dtype=self.dtype)
        if name.startswith("backbone."):
            name = LLAMA_NAMES.base + name[len("backbone.") :]
        if name == LLAMA_NAMES.head_weight() and getattr(self.config, "tie_word_embeddings", False):
            name = LLAMA_NAMES.embed_weight()
        return self._raw(name).to(self.dtype).clone()

    def release(self) -> None:
        """Drop the in-memory full model (random-init case); later reads raise."""
        self._tensors = {} if self._tensors is not None else None
