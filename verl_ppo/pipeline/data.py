"""Rollouts -> the pipeline's training batch.

Every rank generates its own share of the rollout batch (generation is data parallel over
all ranks, whatever the training layout). The stages of one pipeline must train on the
same sequences, so after scoring the members of each pipeline group all-gather their
``Experience``: prompts left-padded and responses right-padded to the group's longest, then
concatenated so that PPO mini-batch ``k`` of the pipeline holds mini-batch ``k`` of every
member. The optimizer then sees the same global mini-batches as under pure data parallelism
(the equality test against DP relies on it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl_ppo.step.experience import Experience


def _gather(t: torch.Tensor, group: dist.ProcessGroup, n: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def gather_pipeline_experience(
    exp: Experience, group: dist.ProcessGroup, num_mini_batches: int, pad_token_id: int
) -> tuple[Experience, torch.Tensor]:
    """All-gather ``exp`` over ``group`` (a pipeline: one rank per stage, group-rank order).

    Args:
        exp: this rank's scored rollout (``input_ids``, ``attention_mask``, ``responses``,
            ``response_mask``, ``group_index``, ``scores``, ``entries``); ``B`` sequences.
        group: the pipeline group; every member has the same ``B``.
        num_mini_batches: PPO mini-batches per step; ``B`` must divide by it.
        pad_token_id: fills the added prompt (left) and response (right) padding.

    Returns:
        ``(Experience, source)``: ``B x group size`` sequences, the same on every member,
        ordered mini-batch by mini-batch (chunk ``k`` of every member, then ``k + 1``), and
        ``source`` ``(B x group size,)`` int64, the group rank that generated each row.

    Raises:
        ValueError: ``B`` not divisible by ``num_mini_batches``.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return exp, torch.zeros(exp.batch_size, dtype=torch.long, device=exp.input_ids.device)
    b, p = exp.batch_size, exp.prompt_len
    r = exp.responses.shape[1]
    if b % num_mini_batches:
        raise ValueError(
            f"{b} sequences per rank do not split into {num_mini_batches} mini-batches"
        )
    sizes = torch.tensor([p, r], dtype=torch.int64, device=exp.input_ids.device)
    dims = _gather(sizes, group, n)
    pm, rm = max(int(d[0]) for d in dims), max(int(d[1]) for d in dims)
    ids = exp.input_ids
    prompt = torch.nn.functional.pad(ids[:, :p], (pm - p, 0), value=pad_token_id)
    pmask = torch.nn.functional.pad(exp.attention_mask[:, :p], (pm - p, 0), value=0)
    resp = torch.nn.functional.pad(exp.responses, (0, rm - r), value=pad_token_id)
    rmask = torch.nn.functional.pad(exp.response_mask, (0, rm - r), value=0)
    amask = torch.nn.functional.pad(exp.attention_mask[:, p:], (0, rm - r), value=0)
    fields = {
        "prompt": prompt,
        "pmask": pmask,
        "resp": resp,
        "rmask": rmask,
        "amask": amask,
        "group_index": exp.group_index,
        "scores": exp.scores,
        "rollout_lp": None
        if exp.rollout_log_prob is None
        else torch.nn.functional.pad(exp.rollout_log_prob, (0, rm - r), value=0.0),
    }
    got = {k: _gather(v, group, n) for k, v in fields.items() if v is not None}
    entries: list = [None] * n
    dist.all_gather_object(entries, list(exp.entries), group=group)
    chunk = b // num_mini_batches
    order = [
        (m, slice(k * chunk, (k + 1) * chunk)) for k in range(num_mini_batches) for m in range(n)
    ]

    def cat(key: str) -> torch.Tensor:
        return torch.cat([got[key][m][s] for m, s in order], 0)

    resp_all, prompt_all = cat("resp"), cat("prompt")
    source = torch.tensor(
        [m for m, s in order for _ in range(s.start, s.stop)], device=exp.input_ids.device
    )
    out = Experience(
        input_ids=torch.cat([prompt_all, resp_all], 1),
        attention_mask=torch.cat([cat("pmask"), cat("amask")], 1),
        prompt_len=pm,
        responses=resp_all,
        response_mask=cat("rmask"),
        group_index=cat("group_index"),
        entries=[e for m, s in order for e in entries[m][s]],
        scores=cat("scores") if "scores" in got else None,
        rollout_log_prob=cat("rollout_lp") if "rollout_lp" in got else None,
    )
    return out, source


def per_rollout(exp: Experience, source: torch.Tensor, fn) -> list:
    """Run ``fn(sub)`` on the rows of each generating rank (``source``) and write the
    sub-batches' ``token_level_rewards``, ``advantages`` and ``returns`` back into ``exp``.

    Batch statistics (GAE's advantage whitening, GRPO groups) are then taken over each
    rank's own rollout, as under pure data parallelism. Returns ``fn``'s results in
    source order."""
    outs = []
    fields = ("token_level_rewards", "advantages", "returns")
    for f in fields:
        setattr(exp, f, None)
    for src in sorted(set(source.tolist())):
        idx = (source == src).nonzero().squeeze(-1)
        sub = exp.slice(idx)
        outs.append(fn(sub))
        for f in fields:
            v = getattr(sub, f)
            if getattr(exp, f) is None:
                setattr(
                    exp,
                    f,
                    torch.zeros((exp.batch_size, *v.shape[1:]), dtype=v.dtype, device=v.device),
                )
            getattr(exp, f)[idx] = v
    return outs
