"""Forward passes shared by the roles."""

from __future__ import annotations

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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of the response tokens under ``model``.

    Args:
        input_ids, attention_mask: ``(B, P + R)``.
        prompt_len: ``P``; the logits at positions ``P-1 .. P+R-2`` predict the response.
        temperature: the sampling temperature (log-probs of the distribution sampled from).

    Returns:
        ``(log_prob (B, R) float32, entropy (B, R) float32 or None)``.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from(attention_mask),
        use_cache=False,
    )
    logits = out.logits[:, prompt_len - 1 : -1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, prompt_len:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def log_prob_fn(packing: bool):
    """``sequence_log_probs`` or its packed equivalent (same signature and result)."""
    if packing:
        from verl_ppo.packing import packed_log_probs

        return packed_log_probs
    return sequence_log_probs


def micro_batches(exp, micro_batch_size: int, max_tokens: int | None, packing: bool, group=None):
    """Split ``exp`` into micro-batches: fixed ``micro_batch_size`` sequences, or, with a
    token budget, :func:`verl_ppo.batching.plan_micro_batches` (same count on every rank)."""
    if max_tokens is None:
        return exp.split(micro_batch_size)
    from verl_ppo.batching import plan_micro_batches

    lengths = exp.attention_mask.sum(-1)
    plan = plan_micro_batches(lengths, max_tokens, "packed" if packing else "padded", group)
    dev = exp.input_ids.device
    return [exp.slice(torch.tensor(ix, dtype=torch.long, device=dev)) for ix in plan]


def micro_step(strategy, loss: torch.Tensor, grad_comm, boundary: bool | None) -> None:
    """Backward of one micro-batch's loss, verl_comm's reduction if attached, then DeepSpeed's
    step (which only updates at the accumulation boundary). ``boundary`` overrides
    DeepSpeed's own micro-step count (token-budget micro-batches vary in number)."""
    if boundary is not None:
        strategy.engine.set_gradient_accumulation_boundary(boundary)
    strategy.backward(loss)
    if grad_comm is not None:
        grad_comm.after_backward()
    strategy.step()
