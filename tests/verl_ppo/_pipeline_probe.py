"""One PPO update of actor and critic on a fixed synthetic batch, in either training layout.

Used by tests/verl_ppo/test_pipeline.py to compare the pipeline engine's update with the
data-parallel one where nothing upstream of the update can differ: the batch (token ids,
masks, advantages, returns) is drawn from one seeded generator on every rank, every rank
trains on the rows pure DP would give it, and the advantages are O(1) random numbers, so
the policy and value gradients are dense and large. The trainer's state (weights and
optimizer, both roles) is saved before the probe and loaded back after it, so the PPO steps
that follow run as if the probe had never happened.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ppo.step.experience import Experience

PROBE_EPOCHS = 2  # 2 epochs x 2 mini-batches: 4 optimizer steps per role


def synthetic_batch(n: int, vocab: int, pad_id: int, p: int = 5, r: int = 6) -> dict:
    """``n`` rows of prompt (left-padded), response (right-padded), advantages, returns and
    perturbations of the old and the reference log-probs; the same on every rank (fixed
    seed)."""
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(3, vocab, (n, p), generator=g)
    resp = torch.randint(3, vocab, (n, r), generator=g)
    pmask = torch.ones(n, p, dtype=torch.long)
    rmask = torch.ones(n, r)
    for i in range(n):
        pmask[i, : i % 3] = 0
        prompt[i, : i % 3] = pad_id
        rmask[i, r - i % 4 :] = 0
        resp[i, r - i % 4 :] = pad_id
    return {
        "prompt": prompt,
        "pmask": pmask,
        "resp": resp,
        "rmask": rmask,
        "adv": torch.randn(n, r, generator=g) * rmask,
        "ret": 0.5 * torch.randn(n, r, generator=g) * rmask,
        "old_noise": 0.1 * torch.randn(n, r, generator=g) * rmask,
        "ref_noise": 0.1 * torch.randn(n, r, generator=g) * rmask,
    }


def layout_rows(rank: int, per_rank: int, num_mini: int, pipe_ranks: list[int] | None) -> list:
    """Rows of the synthetic batch this rank trains on: its own ``per_rank`` rows under DP;
    under PP its pipeline's members' rows, mini-batch by mini-batch, as
    :func:`verl_ppo.pipeline.data.gather_pipeline_experience` orders them."""
    members = [rank] if pipe_ranks is None else pipe_ranks
    chunk = per_rank // num_mini
    return [
        m * per_rank + k * chunk + j for k in range(num_mini) for m in members for j in range(chunk)
    ]


def _experience(b: dict, rows: list[int]) -> Experience:
    idx = torch.tensor(rows)
    resp, rmask = b["resp"][idx], b["rmask"][idx]
    return Experience(
        input_ids=torch.cat([b["prompt"][idx], resp], 1),
        attention_mask=torch.cat([b["pmask"][idx], rmask.long()], 1),
        prompt_len=b["prompt"].shape[1],
        responses=resp,
        response_mask=rmask,
        group_index=idx.clone(),
        entries=[{} for _ in rows],
    )


def _first_step_grads(strategy: Any) -> tuple[dict, dict, Any]:
    """The gradients of the optimizer's first step by HF name, before and after DeepSpeed's
    gradient clipping, and a function that removes the hooks.

    ZeRO-0 only (the engine's optimizer is then the torch AdamW over the parameters
    themselves; at ZeRO-1 it steps flat partitions): both dicts stay empty otherwise. The
    unclipped gradients show a wrong loss scale, the clipped ones a wrong global norm.
    """
    raw: dict[str, torch.Tensor] = {}
    clipped: dict[str, torch.Tensor] = {}
    engine = strategy.engine
    opt = engine.optimizer
    if not isinstance(opt, torch.optim.Optimizer):  # ZeRO-1: flat partitions
        return raw, clipped, lambda: None

    def snap(into: dict) -> None:
        if not into:
            for n, p in strategy.hf_named_parameters().items():
                if p.grad is not None:
                    into[n] = p.grad.detach().clone()

    clip = engine.clip_fp32_gradients  # DeepSpeedEngine._take_model_step calls it first

    def clip_and_snap() -> None:
        snap(raw)
        clip()

    engine.clip_fp32_gradients = clip_and_snap
    handle = opt.register_step_pre_hook(lambda o, a, k: snap(clipped))

    def remove() -> None:
        handle.remove()
        del engine.clip_fp32_gradients

    return raw, clipped, remove


def probe_update(trainer: Any, rank: int, world: int, ckpt_dir: str) -> dict:
    """Run :data:`PROBE_EPOCHS` PPO epochs of actor and critic on the synthetic batch.

    Returns this rank's actor and critic weights after the update, the actor's first-step
    gradients before and after clipping (by HF name; ZeRO-0), and the metrics of both
    updates; the trainer's state is restored.
    """
    actor, critic = trainer.actor, trainer.critic
    pipe = trainer.pipeline is not None
    d = trainer.d
    per_rank = trainer.config.train.rollout_batch_size // world
    b = synthetic_batch(
        per_rank * world, trainer.policy_config.vocab_size, trainer.tokenizer.pad_token_id
    )
    rows = layout_rows(
        rank, per_rank, d.num_mini_batches, actor.strategy.pipe_ranks if pipe else None
    )
    exp = _experience(b, rows)
    idx = torch.tensor(rows)
    for role in ("actor", "critic"):
        getattr(trainer, role).strategy.save(ckpt_dir, f"probe_{role}")
    exp.old_log_prob = actor.compute_log_prob(exp) + b["old_noise"][idx]
    # the reference moved off the policy too, so a KL loss term has a gradient from step 1
    exp.ref_log_prob = trainer.reference.compute_log_prob(exp) + b["ref_noise"][idx]
    exp.values = critic.compute_values(exp)
    exp.advantages, exp.returns = b["adv"][idx], b["ret"][idx]
    raw, grads, remove = _first_step_grads(actor.strategy)
    m = actor.update(exp, d.num_mini_batches, PROBE_EPOCHS)
    remove()
    m.update(critic.update(exp, d.num_mini_batches, PROBE_EPOCHS))
    out = {
        "metrics": m,
        "grads": grads,
        "raw_grads": raw,
        "actor": {n: p.detach().clone() for n, p in actor.strategy.hf_named_parameters().items()},
        "critic": {n: p.detach().clone() for n, p in critic.strategy.hf_named_parameters().items()},
    }
    for role in ("actor", "critic"):
        getattr(trainer, role).strategy.load(ckpt_dir, f"probe_{role}")
    return out
