"""Generation with a KV cache on the TP rollout model, same contract as the non-TP
``verl_ppo.rollout.generate``: LEFT-padded prompts in, ``prompt + response`` out,
right-padded with ``pad_token_id`` after EOS.

Within a TP group every member runs the same sequences: the members' batches are
all-gathered (padded to the group's longest prompt and largest batch), generated
together, and each member gets its own rows back (verl's TP rollout does the same).
Sampling happens on TP index 0 with the caller's ``torch.Generator`` through the shared
sampler (:mod:`verl_ppo.rollout.sampler`) and the chosen tokens are broadcast, so all
members pick the same tokens whatever their RNG states. Decoding itself is the static-cache
decoder of :mod:`verl_ppo.rollout.cuda_graph` (eager, or as a CUDA graph).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from verl_ppo.rollout.generate import RolloutOutput, check_prompts, eos_list, sampling_kwargs
from verl_ppo.rollout.sampler import SamplingParams, filter_logits, sample_next
from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup

if TYPE_CHECKING:
    from verl_ppo.rollout.cuda_graph import StaticCacheDecoder

__all__ = ["TPRolloutModel", "filter_logits", "tp_generate", "tp_rollout"]


def _gather_group_batch(ids: torch.Tensor, mask: torch.Tensor, tp: TPGroup, pad: int):
    """All-gather the TP members' left-padded batches; returns (ids, mask, my row slice, P_max)."""
    if tp.size == 1:
        return ids, mask, slice(0, ids.shape[0]), ids.shape[1]
    shape = torch.tensor([ids.shape[0], ids.shape[1]], dtype=torch.int64, device=ids.device)
    shapes = [torch.empty_like(shape) for _ in range(tp.size)]
    dist.all_gather(shapes, shape, group=tp.group)
    by_global = dict(zip(sorted(tp.members), shapes))
    sizes = [by_global[g].tolist() for g in tp.members]  # TP-index order
    bmax, pmax = max(s[0] for s in sizes), max(s[1] for s in sizes)
    b, p = ids.shape
    pid = torch.full((bmax, pmax), pad, dtype=ids.dtype, device=ids.device)
    pm = torch.zeros((bmax, pmax), dtype=mask.dtype, device=mask.device)
    pid[:b, pmax - p :], pm[:b, pmax - p :] = ids, mask
    parts_i = [torch.empty_like(pid) for _ in range(tp.size)]
    parts_m = [torch.empty_like(pm) for _ in range(tp.size)]
    dist.all_gather(parts_i, pid, group=tp.group)
    dist.all_gather(parts_m, pm, group=tp.group)
    gi, gm = dict(zip(sorted(tp.members), parts_i)), dict(zip(sorted(tp.members), parts_m))
    all_ids = torch.cat([gi[g][: s[0]] for g, s in zip(tp.members, sizes)])
    all_mask = torch.cat([gm[g][: s[0]] for g, s in zip(tp.members, sizes)])
    start = sum(s[0] for s in sizes[: tp.index])
    return all_ids, all_mask, slice(start, start + b), pmax


@torch.no_grad()
def tp_rollout(
    model: TPCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    use_cuda_graph: bool = False,
    reuse: StaticCacheDecoder | None = None,
) -> tuple[RolloutOutput, StaticCacheDecoder]:
    """Generate up to ``max_new_tokens`` tokens per prompt on the TP rollout model.

    The TP group's batches are gathered, decoded together by a
    :class:`~verl_ppo.rollout.cuda_graph.StaticCacheDecoder` (eager, or with the decode
    step as a CUDA graph) through the shared loop; TP index 0 samples and broadcasts.

    Args:
        model: the TP rollout model (every member of its TP group must call together).
        input_ids: ``(B, P)`` int64, LEFT-padded prompts. attention_mask: ``(B, P)`` 0/1.
        eos_token_id, pad_token_id, params, generator: as
            :func:`verl_ppo.rollout.generate.decode_loop` (``generator`` used on TP index 0).
        use_cuda_graph: capture the decode step (CUDA; NCCL collectives inside the graph).
        reuse: the decoder of an earlier call, kept when it fits (its cache and graph).

    Returns:
        ``(RolloutOutput of this member's rows, the decoder used)``; sequences
        ``(B, P + R)``, ``R`` the steps the group ran, right-padded after EOS.

    Raises:
        ValueError: mismatched shapes or ``max_new_tokens < 1``.
    """
    from verl_ppo.rollout.cuda_graph import decoder_for

    check_prompts(input_ids, attention_mask)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = eos_list(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    dev, tp = model.device, model.tp
    own_p = input_ids.shape[1]
    ids, mask, mine, pmax = _gather_group_batch(
        input_ids.to(dev, torch.int64), attention_mask.to(dev, torch.int64), tp, pad
    )
    dec = decoder_for(reuse, model, pmax, max_new_tokens, use_cuda_graph)

    def pick(logits: torch.Tensor, seed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b = logits.shape[0]
        if tp.index == 0:
            tok, lp = sample_next(logits, params, generator, seed)
        else:
            tok = torch.empty(b, dtype=torch.int64, device=dev)
            lp = torch.empty(b, dtype=torch.float32, device=dev)
        return tp.broadcast_from_first(tok), tp.broadcast_from_first(lp)

    out = dec.rollout(
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        params=params,
        generator=generator,  # the seeds are drawn on every member, used on TP index 0
        pick=pick,
        sync_every=1 if not use_cuda_graph else 8,
    )
    seq = out.sequences[mine][:, pmax - own_p :].to(input_ids.device)
    return RolloutOutput(seq, out.log_probs[mine].to(input_ids.device)), dec


def tp_generate(
    model: TPCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sequences ``(B, P + R)`` int64 of :func:`tp_rollout` (eager).

    Raises:
        ValueError: mismatched shapes or ``max_new_tokens < 1``.
    """
    out, _ = tp_rollout(
        model,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        params=SamplingParams(do_sample, temperature, top_k, top_p),
        generator=generator,
    )
    return out.sequences


class TPRolloutModel:
    """What ``HybridEngine.rollout()`` yields: a TP model with the rollout ``generate``.

    Args:
        model: the TP model on this rank's rollout shards.
    """

    def __init__(self, model: TPCausalLM) -> None:
        self.model: TPCausalLM | None = model
        self.decoder: StaticCacheDecoder | None = None

    @property
    def tp(self) -> TPGroup:
        """The TP group the model runs on."""
        return self._live().tp

    def _live(self) -> TPCausalLM:
        if self.model is None:
            raise RuntimeError("the rollout model was released (used outside hybrid.rollout())")
        return self.model

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
        use_cuda_graph: bool = False,
        reuse: StaticCacheDecoder | None = None,
    ) -> RolloutOutput:
        """See :func:`tp_rollout`; the decoder used is kept in ``self.decoder``.

        Raises:
            RuntimeError: the model was released.
        """
        out, self.decoder = tp_rollout(
            self._live(),
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            params=params,
            generator=generator,
            use_cuda_graph=use_cuda_graph,
            reuse=reuse,
        )
        return out

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw) -> torch.Tensor:
        """:meth:`rollout`'s sequences; keywords as :func:`tp_generate`.

        Raises:
            RuntimeError: the model was released.
        """
        return self.rollout(input_ids, attention_mask, **sampling_kwargs(kw)).sequences

    def release(self) -> None:
        """Drop the weights (rollout shards); later calls raise."""
        if self.model is not None:
            self.model.w = {}
            self.model.embed = self.model.head = None
            self.model = None
