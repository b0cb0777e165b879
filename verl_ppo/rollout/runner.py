"""The rollout the trainer calls: picks the generator for the model in hand and keeps the
static-cache decoder (its KV cache and CUDA graph) between steps.

- the hybrid engine's TP rollout model: its static-cache decoder, CUDA graph or eager;
- otherwise, with ``use_cuda_graph``: the static-cache decoder over the actor's own
  parameters (captured once; recaptured if the parameters move);
- otherwise: :class:`~verl_ppo.rollout.generate.HFGenerator` (HF's own forward).

All three decode through :func:`~verl_ppo.rollout.generate.decode_loop` and
:func:`~verl_ppo.rollout.sampler.sample_next`.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ppo.rollout.generate import HFGenerator, RolloutOutput
from verl_ppo.rollout.sampler import SamplingParams


class RolloutRunner:
    """Generates with the right generator and keeps its state between steps.

    Args:
        use_cuda_graph: decode steps as CUDA graphs (resolved ``rollout.use_cuda_graph``).
    """

    def __init__(self, use_cuda_graph: bool) -> None:
        self.use_cuda_graph = use_cuda_graph
        self.decoder: Any = None

    @property
    def graph_captures(self) -> int:
        """CUDA graphs captured so far (a recapture follows moved weights)."""
        return getattr(self.decoder, "captures", 0)

    def run(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None,
        pad_token_id: int | None,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample responses with ``model`` (a HF causal LM, a DeepSpeed engine around one,
        or a :class:`~verl_ppo.rollout.tp_generate.TPRolloutModel`); see
        :func:`~verl_ppo.rollout.generate.decode_loop` for the contract."""
        from verl_ppo.rollout.tp_generate import TPRolloutModel

        kw = dict(
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            params=params,
            generator=generator,
        )
        if isinstance(model, TPRolloutModel):
            out = model.rollout(
                input_ids,
                attention_mask,
                use_cuda_graph=self.use_cuda_graph,
                reuse=self.decoder,
                **kw,
            )
            self.decoder = model.decoder
            return out
        if self.use_cuda_graph:
            from verl_ppo.rollout.cuda_graph import decoder_for

            self.decoder = decoder_for(
                self.decoder, model, input_ids.shape[1], max_new_tokens, use_cuda_graph=True
            )
            return self.decoder.rollout(input_ids, attention_mask, **kw)
        return HFGenerator(model).rollout(input_ids, attention_mask, **kw)
