"""Forward passes shared by the roles."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from verl_ppo.algorithms.losses import entropy_from_logits


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``(B, L)`` counting only unmasked tokens (left padding -> 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def sequence_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of the response tokens under ``model``.

    Args:
        input_ids, attention_mask: ``(B, P + R)``.
        prompt_len: ``P``; the logits at positions ``P-1 .. P+R-2`` predict the response.
        temperature: the sampling temperature (log-probs of the distribution sampled from).
        fused: run the LM head through :func:`verl_ppo.roles.fused_head.chunked_head_log_probs`
            on the positions that predict a valid response token only (no ``(B, L, V)``
            fp32 logits); the model must pass :func:`~verl_ppo.roles.fused_head.head_weight`.

    Returns:
        ``(log_prob (B, R) float32, entropy (B, R) float32 or None)``; with ``fused``, 0 at
        padded response positions (callers mask them).
    """
    pos = position_ids_from(attention_mask)
    if fused:
        from verl_ppo.job.model_family import decoder_of
        from verl_ppo.roles.fused_head import chunked_head_log_probs, head_weight

        h = decoder_of(model)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False
        ).last_hidden_state[:, prompt_len - 1 : -1]
        valid = attention_mask[:, prompt_len:].bool()
        idx = valid.reshape(-1).nonzero().squeeze(-1)
        targets = input_ids[:, prompt_len:].reshape(-1)[idx]
        hs = h.reshape(-1, h.shape[-1])[idx]
        logp, ent = chunked_head_log_probs(
            hs, head_weight(model), targets, temperature, with_entropy
        )
        B, R = valid.shape

        def back(x: torch.Tensor) -> torch.Tensor:
            return x.new_zeros(B * R).index_put((idx,), x).view(B, R)

        return back(logp), (back(ent) if ent is not None else None)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=pos,
        use_cache=False,
    )
    return response_log_probs(out.logits, input_ids[:, prompt_len:], temperature, with_entropy)


def response_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` from full-sequence ``logits``.

    Args:
        logits: ``(B, P + R, V)``; positions ``P-1 .. P+R-2`` predict the response.
        targets: ``(B, R)`` int64 response tokens.
        temperature: the sampling temperature.

    Returns:
        ``(log_prob (B, R) float32, entropy (B, R) float32 or None)``.
    """
    prompt_len = logits.shape[1] - targets.shape[1]
    logits = logits[:, prompt_len - 1 : -1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def log_prob_fn(packing: bool, fused: bool = False):
    """``sequence_log_probs`` or its packed equivalent (same signature and result), with
    the fused LM head when ``fused``."""
    import functools

    if packing:
        from verl_ppo.step.packing import packed_log_probs

        return functools.partial(packed_log_probs, fused=fused)
    return functools.partial(sequence_log_probs, fused=fused)


def micro_batches(exp, micro_batch_size: int, max_tokens: int | None, packing: bool, group=None):
    """Split ``exp`` into micro-batches: fixed ``micro_batch_size`` sequences, or, with a
    token budget, :func:`verl_ppo.step.batching.plan_micro_batches` (same count on every rank)."""
    if max_tokens is None:
        return exp.split(micro_batch_size)
    from verl_ppo.step.batching import plan_micro_batches

    lengths = exp.attention_mask.sum(-1)
    plan = plan_micro_batches(lengths, max_tokens, "packed" if packing else "padded", group)
    dev = exp.input_ids.device
    return [exp.slice(torch.tensor(ix, dtype=torch.long, device=dev)) for ix in plan]


def forward_in_micro_batches(
    exp: Any,
    fn: Callable[[Any], torch.Tensor],
    micro_batch_size: int,
    max_tokens: int | None,
    packing: bool = False,
) -> torch.Tensor:
    """``fn`` over micro-batches of ``exp`` (a no-grad forward), results in ``exp``'s row order.

    Args:
        fn: ``micro Experience -> (b, ...)`` tensor.
        micro_batch_size: sequences per micro-batch when ``max_tokens`` is None.
        max_tokens: token budget (:func:`verl_ppo.step.batching.token_budget_micro_batches`;
            no collective: no-grad forwards need no equal count across ranks).

    Returns:
        ``(B, ...)``, row ``i`` computed from sequence ``i``.
    """
    if max_tokens is None:
        return torch.cat([fn(mb) for mb in exp.split(micro_batch_size)], 0)
    from verl_ppo.step.batching import token_budget_micro_batches

    lengths = exp.attention_mask.sum(-1)
    plan = token_budget_micro_batches(lengths, max_tokens, "packed" if packing else "padded")
    out = None
    for ix in plan:
        idx = torch.tensor(ix, dtype=torch.long, device=exp.input_ids.device)
        r = fn(exp.slice(idx))
        if out is None:
            out = r.new_zeros((exp.batch_size, *r.shape[1:]))
        out[idx] = r
    return out


def log_probs_in_micro_batches(role: Any, model: torch.nn.Module, exp: Any) -> torch.Tensor:
    """Log-probs ``(B, R)`` float32 of ``exp``'s responses under ``model``, through
    ``role.lp_fn`` at ``role.temperature`` in the role's no-grad micro-batches
    (``micro_batch_size``, ``max_tokens_no_grad``, ``packing``); the caller disables grad."""
    return forward_in_micro_batches(
        exp,
        lambda mb: role.lp_fn(
            model, mb.input_ids, mb.attention_mask, exp.prompt_len, role.temperature
        )[0],
        role.micro_batch_size,
        role.max_tokens_no_grad,
        role.packing,
    )


def micro_step(strategy, loss: torch.Tensor, boundary: bool | None) -> None:
    """Backward of one micro-batch's loss (with the strategy's gradient communication), then
    DeepSpeed's step (which only updates at the accumulation boundary). ``boundary``
    overrides DeepSpeed's own micro-step count (token-budget micro-batches vary in number)."""
    if boundary is not None:
        strategy.engine.set_gradient_accumulation_boundary(boundary)
    strategy.backward(loss)
    strategy.step()


def run_update(
    role: Any,
    exp: Any,
    num_mini_batches: int,
    ppo_epochs: int,
    prefix: str,
    loss_fn: Callable[[Any, float], tuple[torch.Tensor, dict[str, float]]],
) -> dict[str, float]:
    """The PPO update loop shared by actor and critic.

    ``ppo_epochs`` passes over ``exp`` split into ``num_mini_batches`` mini-batches (one
    optimizer step each), each split into micro-batches (fixed size or token budget).
    ``loss_fn(micro, divisor)`` returns the micro-batch loss (``token-mean`` divisor already
    applied) and float metrics; metrics are averaged and returned as ``<prefix>/<name>``,
    plus ``<prefix>/grad_norm``.

    Args:
        role: an object with ``strategy``, ``module``, ``group``,
            ``micro_batch_size``, ``max_tokens``, ``packing`` and ``algo``.
    """
    role.module.train()
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    mini = max(exp.batch_size // num_mini_batches, 1)
    seq_scaled = role.algo.loss_agg_mode != "token-mean"
    for _ in range(ppo_epochs):
        for mb_exp in exp.split(mini):
            divisor = global_token_divisor(mb_exp.response_mask, role.group)
            micros = micro_batches(
                mb_exp, role.micro_batch_size, role.max_tokens, role.packing, role.group
            )
            for j, micro in enumerate(micros):
                boundary = None if role.max_tokens is None else j == len(micros) - 1
                loss, metrics = loss_fn(micro, divisor)
                if seq_scaled:  # per-sequence means: weight micro-batches by their share
                    loss = loss * micro.batch_size / max(mb_exp.batch_size, 1)
                micro_step(role.strategy, loss, boundary)
                for k, v in metrics.items():
                    sums[f"{prefix}/{k}"] += float(v)
                    counts[f"{prefix}/{k}"] += 1
            gn = role.strategy.engine.get_global_grad_norm()
            if gn is not None:
                sums[f"{prefix}/grad_norm"] += float(gn)
                counts[f"{prefix}/grad_norm"] += 1
    return {k: sums[k] / counts[k] for k in sums}


def global_token_divisor(mask: torch.Tensor, group: Any = None) -> float:
    """Valid tokens of ``mask`` summed over the data-parallel group, divided by its size.

    Used as the ``token-mean`` divisor so that the loss is invariant to the number of
    ranks and micro-batches (see :func:`verl_ppo.algorithms.agg_loss`).
    """
    import torch.distributed as dist

    n = mask.sum().to(torch.float64).reshape(1)
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(n, group=group)
        world = dist.get_world_size(group)
    return max(float(n.item()) / world, 1.0)
