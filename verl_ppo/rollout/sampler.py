"""The one sampler every rollout path draws its tokens with (HF eager, static cache with or
without CUDA graphs, tensor-parallel).

Filtering follows HF's logits warpers (``transformers.generation.logits_process``:
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` with
``min_tokens_to_keep=1``), applied in that order; the draw is :func:`sample_next` (see
there). Same logits and same generator state in, same tokens out, whichever path calls it
(``tests/verl_ppo/test_rollout_paths.py``).

Besides the token the sampler returns its log-probability under the temperature-scaled,
unfiltered distribution, ``log_softmax(logits / T)[token]``: the quantity the actor's
``old_log_prob`` forward computes (see :mod:`verl_ppo.roles.common`), so a rollout can hand
it over instead of a second forward (``actor.old_log_prob: auto``, bypass mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verl_comm.kernels.sampling import Record


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked.

    Attributes:
        do_sample: False = greedy (argmax of the raw logits).
        temperature: > 0; logits are divided by it before filtering and sampling.
        top_k: keep the ``top_k`` largest logits; 0 = off.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``
            (at least one); 1.0 = off.

    Raises:
        ValueError: temperature <= 0, top_k < 0 or top_p outside (0, 1].
    """

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need top_k >= 0 and 0 < top_p <= 1, got top_k={self.top_k}, top_p={self.top_p}"
            )


def filter_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Temperature, top-k, then top-p (nucleus) filtering, as HF's warpers do.

    Args:
        logits: ``(batch, vocab)``, any float dtype (computed in fp32).
        temperature: > 0. top_k: 0 = off. top_p: 1.0 = off.

    Returns:
        ``(batch, vocab)`` fp32, ``logits / temperature`` with filtered entries at ``-inf``.

    Raises:
        ValueError: as :class:`SamplingParams`.
    """
    SamplingParams(True, temperature, top_k, top_p)
    x = logits.float() / temperature if temperature != 1.0 else logits.float()
    return _filter(x, top_k, top_p)


def _filter(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=False)
        remove = sorted_x.softmax(-1).cumsum(-1) <= (1 - top_p)
        remove[..., -1:] = False  # always keep the most likely token
        x = x.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    return x


def fused_sampler_on(
    device: torch.device, params: SamplingParams, generator: torch.Generator | None
) -> bool:
    """Whether :func:`sample_next` draws with the one-pass Triton sampler
    (:func:`verl_comm.kernels.sampling.gumbel_sample`) for logits on ``device``: CUDA, no
    top-k / top-p filter, and the generator (if any) on that device."""
    if device.type != "cuda" or params.top_k != 0 or params.top_p != 1.0:
        return False
    if generator is None:
        return True
    gd = generator.device  # torch.Generator("cuda").device may carry no index
    index = gd.index if gd.index is not None else torch.cuda.current_device()
    dev_index = device.index if device.index is not None else torch.cuda.current_device()
    return gd.type == "cuda" and index == dev_index


def fused_applies(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> bool:
    """:func:`fused_sampler_on` for ``logits``' device."""
    return fused_sampler_on(logits.device, params, generator)


def draw_seeds(
    device: torch.device,
    params: SamplingParams,
    generator: torch.Generator | None,
    steps: int,
) -> torch.Tensor | None:
    """The Philox seeds of ``steps`` draws of the one-pass sampler, drawn at once.

    A rollout draws them before its first token and hands ``seeds[t]`` to step ``t``'s
    :func:`sample_next`, so the seeds are device data known in advance: a decode step that
    samples inside a captured CUDA graph reads its seed from a buffer and never touches the
    generator (whose state a graph cannot advance), and every path that draws them the
    same way (:func:`verl_ppo.rollout.generate.decode_loop`) gets the same tokens.

    Returns:
        ``(steps,)`` int64 on ``device``, or None where the draw does not use them (greedy,
        or the torch sampler: see :func:`fused_sampler_on`).
    """
    if not params.do_sample or not fused_sampler_on(device, params, generator):
        return None
    return torch.randint(0, 2**62, (steps,), dtype=torch.int64, device=device, generator=generator)


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of every row, without a host sync.

    Two implementations, chosen by :func:`fused_applies` (so every rollout path on one device
    draws with the same one):

    - CUDA logits without top-k / top-p: the one-pass Triton sampler (Gumbel-max over
      ``logits / T`` with a Philox seed drawn from ``generator``; logits read once);
    - otherwise torch: :func:`filter_logits`' chain, then ``torch.multinomial``'s own
      one-sample algorithm, ``argmax(probs / Exp(1))`` (same draws as ``torch.multinomial``
      for the same generator state) without its ``.item()`` validity check.

    Args:
        logits: ``(batch, vocab)`` next-token logits (any float dtype).
        params: the :class:`SamplingParams`.
        generator: RNG of the draw; may live on another device than ``logits`` (the draw
            then happens there, so CPU and CUDA callers can share one seed).
        seed: ``(1,)`` int64 on ``logits``' device, the one-pass sampler's Philox seed (one
            element of :func:`draw_seeds`); None = draw it from ``generator``. Unused by the
            torch sampler and when greedy.

    Returns:
        ``(tokens (batch,) int64, log_probs (batch,) float32)``; ``log_probs`` is
        ``log_softmax(logits / temperature)[token]`` (unfiltered). Non-finite logits give
        non-finite log-probs (:func:`verl_ppo.rollout.generate.decode_loop` raises on them).
    """
    if fused_applies(logits, params, generator):
        from verl_comm.kernels.sampling import gumbel_sample

        if not params.do_sample:
            seed = None
        elif seed is None:
            seed = torch.randint(
                0, 2**62, (1,), dtype=torch.int64, device=logits.device, generator=generator
            )
        return gumbel_sample(logits.contiguous(), params.temperature, seed)
    z = logits.float()
    if params.temperature != 1.0:
        z = z / params.temperature
    if not params.do_sample:
        tok = logits.argmax(-1)
    else:
        probs = _filter(z, params.top_k, params.top_p).softmax(-1)
        if generator is not None and generator.device.type != probs.device.type:
            probs = probs.cpu()
        q = torch.empty_like(probs).exponential_(1, generator=generator)
        tok = probs.div_(q).argmax(-1).to(logits.device)
    logp = z.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return tok, logp


def sample_and_record(
    logits: torch.Tensor,
    params: SamplingParams,
    seeds: torch.Tensor | None,
    record: Record,
) -> None:
    """:func:`sample_next`'s one-pass draw (where :func:`fused_applies`) with step ``t``'s
    seed ``seeds[t]``, ``t = record.step``, and the decode loop's bookkeeping
    (:func:`verl_ppo.rollout.generate.settle`, the token and log-prob stored at column ``t``,
    the next step's token and position) done by the sampler's own combining kernel: the
    captured decode step's draw (:mod:`verl_ppo.rollout.graph_loop`), no launch beyond the
    sampler's two. Same tokens as :func:`sample_next` with ``seed=seeds[t:t+1]``.

    Args:
        logits: ``(B, V)`` on CUDA (or CPU under ``TRITON_INTERPRET=1``).
        seeds: :func:`draw_seeds`' ``(S,)`` seeds; None when greedy.
        record: the loop state the kernel updates.
    """
    from verl_comm.kernels.sampling import gumbel_sample

    gumbel_sample(
        logits.contiguous(),
        params.temperature,
        seeds if params.do_sample else None,
        record=record,
    )
