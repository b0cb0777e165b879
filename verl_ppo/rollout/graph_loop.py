"""The whole decode step in one CUDA graph: the model's step, the draw and the bookkeeping.

:class:`~verl_ppo.rollout.cuda_graph.StaticCacheDecoder` captures the model's step only;
:func:`~verl_ppo.rollout.generate.decode_loop` then samples and keeps its books in Python
between replays: the sampler's two kernels, about a dozen small kernels (finished rows
padded, log-probs zeroed, the finite flag, EOS, positions) and the copies of the next
token, position and slot into the graph's inputs, each dispatched from the host. Here one
graph holds all of it. It reads the step index, positions and cache slot from device
buffers and advances them itself, and it reads step ``t``'s Philox seed from a buffer
filled once per rollout (:func:`~verl_ppo.rollout.sampler.draw_seeds`, the seeds
:func:`decode_loop` draws too), so a replay needs nothing from the host. A rollout is the
prefill, the first draw (eager, the same code), then ``R - 1`` replays with a host check
of "every row done" every ``sync_every`` replays.

The draw is the one sampler's (:func:`~verl_ppo.rollout.sampler.sample_and_record`: the
one-pass kernel of :func:`~verl_ppo.rollout.sampler.sample_next` on the same seeds), and its
combining kernel also does :func:`~verl_ppo.rollout.generate.settle`'s bookkeeping, so the
captured step adds the sampler's two kernels and two counter increments to the model's: the
graph gives :func:`decode_loop`'s tokens and log-probs bit for bit
(``tests/verl_ppo/test_graph_loop.py``, ``tests/kernels/test_sampling_triton.py``).

Used where the one-pass sampler applies (CUDA, no top-k / top-p: its draw needs no host
work) and the caller does not sample itself (the TP path samples on one member and
broadcasts); otherwise the model-step graph and :func:`decode_loop` run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_ppo.rollout.generate import RolloutOutput, eos_list, finish, loop_setup, settle
from verl_ppo.rollout.sampler import (
    SamplingParams,
    draw_seeds,
    fused_applies,
    sample_and_record,
    sample_next,
)


@dataclass
class Captured:
    """One captured loop step and what it baked in: the EOS ids ``(n,)`` int64 (None = no
    EOS) and pad id it compares with, and the weights' addresses it reads."""

    graph: torch.cuda.CUDAGraph
    eos: torch.Tensor | None
    pad: int
    param_ptrs: tuple[int, ...]


@dataclass
class LoopBuffers:
    """The loop's state on the device, at fixed addresses (one set per batch size).

    Attributes:
        seeds: ``(S,)`` int64, step ``t``'s Philox seed at ``t``.
        step: ``(1,)`` int64, the response step the next draw fills.
        done: ``(B,)`` bool, rows that drew an EOS.
        finite: ``()`` bool, every log-prob so far finite.
        tokens: ``(B, S)`` int64 and log_probs ``(B, S)`` float32, column ``t`` = step ``t``.
        graphs: the captured steps by (sampling parameters, EOS ids, pad id), so a run that
            alternates sampled training rollouts and greedy evaluation captures each once.
    """

    seeds: torch.Tensor
    step: torch.Tensor
    done: torch.Tensor
    finite: torch.Tensor
    tokens: torch.Tensor
    log_probs: torch.Tensor
    graphs: dict[tuple, Captured] = field(default_factory=dict)

    @classmethod
    def new(cls, batch: int, slots: int, device: torch.device) -> LoopBuffers:
        """Zeroed buffers for ``batch`` rows and ``slots`` response steps at most."""
        return cls(
            seeds=torch.zeros(slots, dtype=torch.int64, device=device),
            step=torch.zeros(1, dtype=torch.int64, device=device),
            done=torch.zeros(batch, dtype=torch.bool, device=device),
            finite=torch.ones((), dtype=torch.bool, device=device),
            tokens=torch.zeros(batch, slots, dtype=torch.int64, device=device),
            log_probs=torch.zeros(batch, slots, dtype=torch.float32, device=device),
        )


def draw_and_record(
    logits: torch.Tensor,
    lb: LoopBuffers,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: torch.Tensor | None,
    pad: int,
) -> None:
    """Draw step ``lb.step``'s tokens from ``logits (B, V)``, keep the books
    (:func:`~verl_ppo.rollout.generate.settle` with ``eos``, ``pad``), and make them the
    next model step's input: ``inputs = (tok (B, 1), pos (B, 1), slot (1,))`` of the model
    step; the position and the slot advance by one, and so does ``lb.step``.

    Where the one-pass sampler draws, it does the bookkeeping in its own combining kernel
    (:func:`~verl_ppo.rollout.sampler.sample_and_record`) with the seed ``lb.seeds[step]``
    and ``generator`` is not touched, so this runs inside a captured graph: four kernels (the
    sampler's two, two counters). Otherwise: :func:`sample_next` and
    :func:`~verl_ppo.rollout.generate.settle` in torch (the eager reference).
    """
    tok_in, pos_in, slot_in = inputs
    if fused_applies(logits, params, generator):  # the bookkeeping in the sampler's kernel
        from verl_comm.kernels.sampling import Record

        rec = Record(lb.step, lb.done, lb.finite, lb.tokens, lb.log_probs, tok_in, pos_in, eos, pad)
        sample_and_record(logits, params, lb.seeds, rec)
    else:
        seed = lb.seeds.index_select(0, lb.step) if params.do_sample else None
        tok, lp = sample_next(logits, params, generator, seed)
        tok, lp = settle(tok, lp, lb.done, lb.finite, eos, pad)
        lb.tokens.index_copy_(1, lb.step, tok[:, None])
        lb.log_probs.index_copy_(1, lb.step, lp[:, None])
        tok_in.copy_(tok[:, None])
        pos_in.add_(1)
    slot_in.add_(1)
    lb.step.add_(1)


def graph_rollout(
    model_step: Callable[[], torch.Tensor],
    prefill: Callable[[], torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    lb: LoopBuffers,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    param_ptrs: tuple[int, ...],
    capture: bool = True,
    sync_every: int = 8,
    on_capture: Callable[[], None] | None = None,
) -> RolloutOutput:
    """:func:`~verl_ppo.rollout.generate.decode_loop`'s rollout with each decode step one
    graph replay (or, with ``capture=False``, the same step run eagerly).

    Args:
        model_step: ``() -> (B, V)`` logits of the model's step on ``inputs`` (it writes the
            cache at the slot in ``inputs``).
        prefill: ``() -> (B, V)`` logits after the prompt (fills cache slots ``0 .. P-1``).
        inputs: the model step's ``(tok (B, 1), pos (B, 1), slot (1,))`` buffers.
        lb: this batch size's :class:`LoopBuffers`; the graph of (``params``, EOS ids, pad
            id) is captured when missing, and again when ``param_ptrs`` (the weights'
            addresses) moved since.
        input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, params,
        generator, sync_every: as :func:`decode_loop`; ``max_new_tokens`` at most the
            buffers' ``S``.
        on_capture: called after each capture (the decoder counts them).

    Raises:
        ValueError: ``max_new_tokens`` outside ``1 .. S``, or ``capture`` where the one-pass
            sampler does not apply (a draw inside a graph cannot use the generator).
        RuntimeError: non-finite logits.
    """
    B, P = input_ids.shape
    if not 1 <= max_new_tokens <= lb.tokens.shape[1]:
        raise ValueError(f"max_new_tokens must be in 1..{lb.tokens.shape[1]}, got {max_new_tokens}")
    dev = lb.tokens.device
    pos_in, slot_in = inputs[1:]
    eos_t, pad = loop_setup(eos_token_id, pad_token_id, dev)
    seeds = draw_seeds(dev, params, generator, max_new_tokens)
    cap = None
    if capture:
        if params.do_sample and seeds is None:
            raise ValueError(
                "a captured decode step draws with the one-pass sampler only (CUDA, no "
                "top_k / top_p, the generator on the logits' device)"
            )
        key = (params, tuple(eos_list(eos_token_id)), pad)
        cap = lb.graphs.get(key)
        if cap is None or cap.param_ptrs != param_ptrs:
            lb.graphs.pop(key, None)  # free the stale graph's pool first
            cap = lb.graphs[key] = Captured(
                _capture(model_step, lb, inputs, params, eos_t, pad), eos_t, pad, param_ptrs
            )
            if on_capture is not None:
                on_capture()
    if seeds is not None:
        lb.seeds[:max_new_tokens].copy_(seeds)
    lb.done.zero_()
    lb.finite.fill_(True)
    lb.step.zero_()
    logits = prefill()
    pos_in.copy_(attention_mask.long().sum(-1, keepdim=True) - 1)  # the prompt's last position
    slot_in.fill_(P - 1)
    draw_and_record(logits, lb, inputs, params, generator, eos_t, pad)
    n = 1
    while n < max_new_tokens:
        if eos_t is not None and n % max(sync_every, 1) == 0 and bool(lb.done.all()):
            break
        if cap is not None:
            cap.graph.replay()
        else:
            draw_and_record(model_step(), lb, inputs, params, generator, eos_t, pad)
        n += 1
    # finish copies the tokens into the sequences; the log-probs leave the static buffer here
    return finish(input_ids, lb.tokens[:, :n], lb.log_probs[:, :n].clone(), lb.finite, eos_t)


def capture(fn: Callable[[], Any], device: torch.device, warmups: int = 2) -> tuple[Any, Any]:
    """``fn`` run ``warmups`` times on a side stream (allocator and Triton warm-up, as
    ``torch.cuda.graph`` asks), then captured; returns ``(graph, fn's result inside the
    capture)``. The decoders' model-step graph and the loop's graph are both made here."""
    s = torch.cuda.Stream(device=device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _capture(
    model_step: Callable[[], torch.Tensor],
    lb: LoopBuffers,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    params: SamplingParams,
    eos: torch.Tensor | None,
    pad: int,
) -> torch.cuda.CUDAGraph:
    """The model step and the draw captured as one graph.

    The warm-ups write cache slots 0 and 1 and the loop's buffers (from slot 0 on); the
    rollout resets the buffers after, and the prefill rewrites the cache and its
    valid-slot mask.
    """
    for t in (*inputs, lb.step):
        t.zero_()
    return capture(
        lambda: draw_and_record(model_step(), lb, inputs, params, None, eos, pad),
        lb.tokens.device,
    )[0]
