"""The rollout generator interface and its one decode loop; the HF eager generator.

Every generator (:class:`HFGenerator` here, the static-KV-cache decoder with or without
CUDA graphs in :mod:`verl_ppo.rollout.cuda_graph`, the tensor-parallel rollout model in
:mod:`verl_ppo.rollout.tp_generate`) has the same contract:

- ``rollout(input_ids, attention_mask, *, max_new_tokens, eos_token_id, pad_token_id,
  params, generator) -> RolloutOutput``; ``generate(...)`` returns only the sequences;
- LEFT-padded prompts ``(B, P)`` in, ``(B, P + R)`` out: prompt, then the response,
  right-padded with ``pad_token_id`` after its first EOS; ``R <= max_new_tokens`` (the loop
  stops at the step where every row is done);
- tokens drawn by :func:`verl_ppo.rollout.sampler.sample_next` with the caller's
  ``torch.Generator``, in one loop (:func:`decode_loop`): the generators differ only in
  how they compute next-token logits (``prefill`` and ``step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from verl_ppo.job.compat import CACHE_KWARG
from verl_ppo.rollout.sampler import SamplingParams, draw_seeds, filter_logits, sample_next
from verl_ppo.step.compiled import eager_layers

__all__ = [
    "HFGenerator",
    "RolloutGenerator",
    "RolloutOutput",
    "SamplingParams",
    "decode_loop",
    "filter_logits",
    "generate",
    "response_mask_from",
]


@dataclass
class RolloutOutput:
    """What a generator returns.

    Attributes:
        sequences: ``(B, P + R)`` int64, prompt then response (pad after EOS).
        log_probs: ``(B, R)`` float32, ``log_softmax(logits / T)`` of each sampled token
            (0 after EOS), as :func:`verl_ppo.rollout.sampler.sample_next` computes it.
    """

    sequences: torch.Tensor
    log_probs: torch.Tensor


class RolloutGenerator(Protocol):
    """The interface the trainer calls (see module docstring)."""

    def rollout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None,
        pad_token_id: int | None,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample responses; see :func:`decode_loop`."""
        ...


def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Raise ValueError unless both are ``(batch, prompt_len)`` of one shape."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be (batch, prompt_len)"
        )


def eos_list(eos_token_id: int | list[int] | None) -> list[int]:
    """EOS ids as a list (None = no EOS; negative ids never match)."""
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def settle(
    tok: torch.Tensor,
    lp: torch.Tensor,
    done: torch.Tensor,
    finite: torch.Tensor,
    eos: torch.Tensor | None,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's bookkeeping, shared by :func:`decode_loop` and the captured decode step
    (:mod:`verl_ppo.rollout.graph_loop`): rows already done get ``pad`` and a 0 log-prob,
    ``finite`` (``()`` bool) is and-ed with "every log-prob finite", and ``done`` (``(B,)``
    bool) takes the rows that drew an EOS id of ``eos`` (``(n,)`` int64; None = no EOS).
    ``done`` and ``finite`` are updated in place. Returns the step's ``(tokens, log_probs)``.
    """
    tok = torch.where(done, torch.full_like(tok, pad), tok)
    finite &= torch.isfinite(lp).all()
    lp = torch.where(done, torch.zeros_like(lp), lp)
    if eos is not None:
        done |= torch.isin(tok, eos)
    return tok, lp


def finish(
    input_ids: torch.Tensor,
    tokens: torch.Tensor,
    log_probs: torch.Tensor,
    finite: torch.Tensor,
    eos: torch.Tensor | None,
) -> RolloutOutput:
    """The rollout's result from its ``(B, n)`` tokens and log-probs: raises on non-finite
    log-probs (one host read), trims to the first step at which every row was done.

    Raises:
        RuntimeError: a step's logits held NaN or Inf.
    """
    if not bool(finite):
        raise RuntimeError(
            "rollout: the next-token logits hold NaN or Inf (the model's weights or its "
            "forward diverged); lower the learning rate or check the checkpoint"
        )
    if eos is not None:  # trim to the first step at which every row was done
        is_eos = torch.isin(tokens, eos)
        if bool(is_eos.any(-1).all()):
            n = int(is_eos.long().argmax(-1).max()) + 1
            tokens, log_probs = tokens[:, :n], log_probs[:, :n]
    return RolloutOutput(torch.cat([input_ids, tokens.to(input_ids.dtype)], 1), log_probs)


def loop_setup(
    eos_token_id: int | list[int] | None, pad_token_id: int | None, device: torch.device
) -> tuple[torch.Tensor | None, int]:
    """``(EOS ids as a (n,) int64 tensor on device or None, the pad id)``: pad defaults to
    the first EOS id, else 0."""
    eos = eos_list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
    return eos_t, pad


def decode_loop(
    prefill: Callable[[], torch.Tensor],
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    pick: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
    | None = None,
    sync_every: int = 8,
) -> RolloutOutput:
    """The decode loop every generator shares.

    Args:
        prefill: ``() -> (B, V)`` logits after the prompt.
        step: ``(tokens (B,), positions (B,), t) -> (B, V)`` logits after feeding ``tokens``
            at ``positions``; ``t`` is the response step (cache slot ``P + t``).
        input_ids, attention_mask: ``(B, P)`` left-padded prompts.
        max_new_tokens: ``R_max >= 1``.
        eos_token_id: int, list or None; a row is done after emitting one.
        pad_token_id: fills rows after EOS (None: the first EOS id, else 0).
        params, generator: passed to :func:`sample_next`. Where the one-pass sampler
            applies, the seeds of all steps are drawn from ``generator`` once, after the
            prefill (:func:`~verl_ppo.rollout.sampler.draw_seeds`), and step ``t`` draws with
            ``seeds[t]``.
        pick: replaces ``sample_next(logits, params, generator, seed)``; called as
            ``pick(logits, seed)`` (the TP path samples on one member and broadcasts).
        sync_every: steps between host checks of "every row done" (each a device sync);
            the result is trimmed to the step where all were done, so it does not change.

    Returns:
        :class:`RolloutOutput`.

    Raises:
        ValueError: bad shapes or ``max_new_tokens < 1``.
        RuntimeError: non-finite logits (checked once, at the end: no per-step sync).
    """
    check_prompts(input_ids, attention_mask)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if pick is None:

        def pick(
            logits: torch.Tensor, seed: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return sample_next(logits, params, generator, seed)

    B, dev = input_ids.shape[0], input_ids.device
    eos_t, pad = loop_setup(eos_token_id, pad_token_id, dev)
    next_pos = attention_mask.long().sum(-1)  # positions count real tokens only
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    finite = torch.ones((), dtype=torch.bool, device=dev)
    tokens, logps = [], []
    logits = prefill()
    seeds = draw_seeds(logits.device, params, generator, max_new_tokens)
    for t in range(max_new_tokens):
        tok, lp = pick(logits, None if seeds is None else seeds[t : t + 1])
        tok, lp = settle(tok, lp, done, finite, eos_t, pad)
        tokens.append(tok)
        logps.append(lp)
        if t == max_new_tokens - 1:
            break
        if eos_t is not None and (t + 1) % max(sync_every, 1) == 0 and bool(done.all()):
            break
        logits = step(tok, next_pos, t)
        next_pos = next_pos + 1
    return finish(input_ids, torch.stack(tokens, 1), torch.stack(logps, 1), finite, eos_t)


class HFGenerator:
    """Eager decoding through the HF model's own forward with its dynamic KV cache.

    The path for every model type (and the CPU default): no hand-written forward.

    Args:
        model: a HF causal LM (``forward(input_ids, attention_mask, position_ids,
            past_key_values, use_cache)`` returning ``logits`` and ``past_key_values``),
            or a DeepSpeed engine around one.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @torch.no_grad()
    def rollout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None,
        pad_token_id: int | None,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        sync_every: int = 1,
    ) -> RolloutOutput:
        """See :func:`decode_loop`."""
        check_prompts(input_ids, attention_mask)
        state: dict = {"mask": attention_mask.long()}

        def prefill() -> torch.Tensor:
            mask = state["mask"]
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
                use_cache=True,
            )
            state["past"] = out.past_key_values
            return out.logits[:, -1, :]

        def step(tok: torch.Tensor, pos: torch.Tensor, t: int) -> torch.Tensor:
            mask = state["mask"]
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=pos[:, None],
                use_cache=True,
                **{CACHE_KWARG: state["past"]},
            )
            state["mask"], state["past"] = mask, out.past_key_values
            return out.logits[:, -1, :]

        try:
            with eager_layers(self.model):  # a new KV-cache shape every step: no compile
                return decode_loop(
                    prefill,
                    step,
                    input_ids,
                    attention_mask,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id,
                    params=params,
                    generator=generator,
                    sync_every=sync_every,
                )
        finally:
            state.clear()  # free the KV cache now

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw) -> torch.Tensor:
        """:meth:`rollout` without the log-probs (keyword arguments of :func:`generate`)."""
        return self.rollout(input_ids, attention_mask, **sampling_kwargs(kw)).sequences


def sampling_kwargs(kw: dict) -> dict:
    """Fold ``do_sample, temperature, top_p, top_k`` keywords into ``params``."""
    kw = dict(kw)
    names = ("do_sample", "temperature", "top_k", "top_p")
    if "params" not in kw:
        kw["params"] = SamplingParams(**{n: kw.pop(n) for n in names if n in kw})
    return kw


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sequences ``(B, P + R)`` int64 of :class:`HFGenerator` (see :func:`decode_loop`).

    Raises:
        ValueError: shapes of ``input_ids`` and ``attention_mask`` differ.
    """
    return HFGenerator(model).generate(
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        generator=generator,
    )


def response_mask_from(
    responses: torch.Tensor, eos_token_id: int, pad_token_id: int
) -> torch.Tensor:
    """Mask ``(B, R)`` float: 1 up to and including the first EOS, 0 after.

    When ``pad_token_id == eos_token_id`` (SmolLM2), padding after EOS is told apart from
    the EOS itself by position, never by value.
    """
    is_eos = responses == eos_token_id
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = ~after
    if pad_token_id != eos_token_id:
        mask = mask & (responses != pad_token_id)
    return mask.float()
