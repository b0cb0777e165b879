"""Generation with a KV cache on the TP rollout model, same contract as the non-TP
``verl_ppo.rollout.generate``: LEFT-padded prompts in, ``prompt + response`` out,
right-padded with ``pad_token_id`` after EOS.

Within a TP group every member runs the same sequences: the members' batches are
all-gathered (padded to the group's longest prompt and largest batch), generated
together, and each member gets its own rows back (verl's TP rollout does the same).
Sampling happens on TP index 0 with the caller's ``torch.Generator`` and the chosen tokens
are broadcast, so all members pick the same tokens whatever their RNG states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Temperature, top-k then top-p (nucleus) filtering as HF's logits warpers do.

    Args:
        logits: ``(batch, vocab)`` fp32.
        temperature: > 0. top_k: 0 = off. top_p: 1.0 = off.

    Returns:
        ``(batch, vocab)`` fp32 with filtered entries at ``-inf``.

    Raises:
        ValueError: temperature <= 0, top_k < 0 or top_p outside (0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=False)
        remove = sorted_x.softmax(-1).cumsum(-1) <= (1 - top_p)
        remove[..., -1:] = False
        x = x.masked_fill(remove.scatter(1, idx, remove), float("-inf"))
    return x


def _sample(logits, do_sample, temperature, top_k, top_p, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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
    """Generate up to ``max_new_tokens`` tokens per prompt.

    Args:
        model: the TP rollout model (every member of its TP group must call together).
        input_ids: ``(B, P)`` int64, LEFT-padded prompts.
        attention_mask: ``(B, P)`` 0/1, 1 = real token.
        eos_token_id: int or list; a row stops after emitting one.
        pad_token_id: fills rows after EOS (default: the first EOS id, else 0).
        generator: RNG for sampling (used on TP index 0 only).

    Returns:
        ``(B, P + R)`` int64, prompt then response, ``R <= max_new_tokens`` (the number of
        steps the TP group ran), right-padded with ``pad_token_id`` after EOS.

    Raises:
        ValueError: mismatched shapes or ``max_new_tokens < 1``.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must both be (batch, prompt_len)"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos = (
        []
        if eos_token_id is None
        else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    )
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    dev = model.device
    own_p = input_ids.shape[1]
    ids, mask, mine, pmax = _gather_group_batch(
        input_ids.to(dev, torch.int64), attention_mask.to(dev, torch.int64), model.tp, pad
    )
    b = ids.shape[0]
    keys = torch.zeros((b, pmax + max_new_tokens), dtype=torch.bool, device=dev)
    keys[:, :pmax] = mask.bool()
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones((pmax, pmax), dtype=torch.bool, device=dev).tril()
    attn = causal[None] & keys[:, None, :pmax]
    attn |= torch.eye(pmax, dtype=torch.bool, device=dev)[
        None
    ]  # padded queries see themselves (no NaN rows)
    cache = model.new_cache(b, pmax + max_new_tokens)
    logits = model.forward(ids, pos, cache, attn[:, None])
    next_pos = mask.long().sum(-1, keepdim=True)
    eos_t = torch.tensor(eos, dtype=torch.int64, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    out = []
    for step in range(max_new_tokens):
        tok = (
            _sample(logits, do_sample, temperature, top_k, top_p, generator)
            if model.tp.index == 0
            else None
        )
        tok = model.tp.broadcast_from_first(
            tok if tok is not None else torch.empty(b, dtype=torch.int64, device=dev)
        )
        tok = torch.where(done, torch.full_like(tok, pad), tok)
        out.append(tok)
        if eos:
            done |= torch.isin(tok, eos_t)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        keys[:, pmax + step] = True
        logits = model.forward(
            tok[:, None], next_pos, cache, keys[:, None, None, : pmax + step + 1]
        )
        next_pos = next_pos + 1
    seq = torch.cat([ids, torch.stack(out, dim=1)], dim=1)[mine]
    return seq[:, pmax - own_p :].to(input_ids.device)


class TPRolloutModel:
    """What ``HybridEngine.rollout()`` yields: a TP model with the rollout ``generate``.

    Args:
        model: the TP model on this rank's rollout shards.
    """

    def __init__(self, model: TPCausalLM) -> None:
        self.model: TPCausalLM | None = model

    @property
    def tp(self) -> TPGroup:
        """The TP group the model runs on."""
        return self._live().tp

    def _live(self) -> TPCausalLM:
        if self.model is None:
            raise RuntimeError("the rollout model was released (used outside hybrid.rollout())")
        return self.model

    def generate(
        self,
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
        """See :func:`tp_generate`; ``(B, P)`` LEFT-padded in, ``(B, P + R)`` int64 out.

        Raises:
            RuntimeError: the model was released.
        """
        return tp_generate(
            self._live(),
            input_ids,
            attention_mask,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            generator=generator,
        )

    def release(self) -> None:
        """Drop the weights (rollout shards); later calls raise."""
        if self.model is not None:
            self.model.w = {}
            self.model.embed = self.model.head = None
            self.model = None
