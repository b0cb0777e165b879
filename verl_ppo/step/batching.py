"""Dynamic micro-batch sizing by a token budget.

A fixed ``micro_batch_size`` (sequences) wastes memory on short batches and runs out of it
on long ones. Here a batch's sequences are split into micro-batches whose token cost stays
under ``max_tokens_per_micro_batch``:

- ``packed`` cost (with :mod:`verl_ppo.step.packing`): the sum of the valid lengths;
- ``padded`` cost (the plain forward): ``len(micro) * max(lengths in micro)``.

Algorithm (sequences sorted by length, descending, ties by index, so the result is
deterministic: same lengths in, same micro-batches out, on every rank):

- ``packed``: the fewest bins ``k = ceil(total / budget)`` first, then
  longest-processing-time greedy (each sequence goes to the least-loaded bin where it fits);
  when one fits nowhere, ``k`` grows by one and the assignment restarts. Loads end within
  one sequence of each other. This is the balanced partition verl uses for
  ``use_dynamic_bsz`` (``verl/utils/seqlen_balancing.py``, there with Karmarkar-Karp).
- ``padded``: consecutive runs of the sorted order, each as long as the budget allows
  (``count * longest <= budget``): similar lengths share a micro-batch, which minimises
  the padding computed.

Loss weights (:func:`micro_batch_weights`) make the accumulated loss equal to the loss of the
whole batch: for ``token-mean`` a micro-batch's mean over its tokens is weighted by its
share of the tokens; for ``seq-mean-token-mean`` by its share of the sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

COST_MODES = ("packed", "padded")


def _cost(n: int, longest: int, total: int, mode: str) -> int:
    return n * longest if mode == "padded" else total


def _assign(order: list[int], lengths: list[int], k: int, budget: int, mode: str):
    bins: list[list[int]] = [[] for _ in range(k)]
    total = [0] * k
    longest = [0] * k
    for i in order:
        n = lengths[i]
        best, best_cost = -1, None
        for b in range(k):
            c = _cost(len(bins[b]) + 1, max(longest[b], n), total[b] + n, mode)
            if c <= budget and (best_cost is None or c < best_cost):
                best, best_cost = b, c
        if best < 0:
            return None
        bins[best].append(i)
        total[best] += n
        longest[best] = max(longest[best], n)
    return bins


def _padded_runs(order: list[int], lens: list[int], budget: int, min_bins: int):
    bins: list[list[int]] = []
    for i in order:  # descending: the first of a run is its longest
        if bins and (len(bins[-1]) + 1) * max(lens[bins[-1][0]], 1) <= budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    while len(bins) < min(min_bins, len(lens)):  # split the most populous run in two
        j = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        run = bins.pop(j)
        bins[j:j] = [run[: len(run) // 2], run[len(run) // 2 :]]
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def token_budget_micro_batches(
    lengths: Sequence[int] | torch.Tensor,
    max_tokens_per_micro_batch: int,
    mode: str = "packed",
    min_micro_batches: int = 1,
) -> list[list[int]]:
    """Split sequence indices into micro-batches under a token budget.

    Args:
        lengths: ``(B,)`` valid tokens per sequence (e.g. ``attention_mask.sum(-1)``).
        max_tokens_per_micro_batch: the budget, in tokens (``packed``: valid tokens;
            ``padded``: sequences x longest length).
        mode: ``"packed"`` or ``"padded"`` (see module docstring).
        min_micro_batches: at least this many micro-batches (e.g. to give every rank the same
            count; empty ones are never returned, so at most ``B``).

    Returns:
        A list of micro-batches, each a sorted list of indices into ``lengths``; together
        they hold every index exactly once. Ordered by their first index.

    Raises:
        ValueError: a sequence alone exceeds the budget (raise the budget to at least its
            length), the budget is not positive, ``mode`` is unknown, or a length is negative.
    """
    if mode not in COST_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {COST_MODES}")
    if max_tokens_per_micro_batch <= 0:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} must be positive"
        )
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if not lens:
        return []
    if min(lens) < 0:
        raise ValueError(f"lengths must be >= 0, got {min(lens)}")
    worst = max(lens)
    if worst > max_tokens_per_micro_batch:
        raise ValueError(
            f"a sequence of {worst} tokens exceeds max_tokens_per_micro_batch="
            f"{max_tokens_per_micro_batch}; set it to at least {worst}"
        )
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    if mode == "padded":
        return _padded_runs(order, lens, max_tokens_per_micro_batch, min_micro_batches)
    k = max(math.ceil(sum(lens) / max_tokens_per_micro_batch), min_micro_batches, 1)
    k = min(k, len(lens))
    while True:
        bins = _assign(order, lens, k, max_tokens_per_micro_batch, mode)
        if bins is not None:
            break
        k += 1  # terminates: with k == len(lens) every sequence has its own bin
    out = [sorted(b) for b in bins if b]
    return sorted(out, key=lambda b: b[0])


def micro_batch_weights(
    micro_batches: list[list[int]],
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
) -> list[float]:
    """Weights ``w_j`` with ``sum_j w_j * loss_j == loss(whole batch)``.

    Args:
        micro_batches: from :func:`token_budget_micro_batches`.
        response_mask: ``(B, R)`` float/bool, the tokens the loss averages over.
        loss_agg_mode: ``"token-mean"`` (``loss_j`` = mean over micro-batch ``j``'s tokens)
            or ``"seq-mean-token-mean"`` (``loss_j`` = mean over its sequences).

    Returns:
        One float per micro-batch, summing to 1.

    Raises:
        ValueError: unknown ``loss_agg_mode`` or the mask has no token (token-mean).
    """
    if loss_agg_mode == "token-mean":
        per_seq = response_mask.float().sum(-1)
        total = float(per_seq.sum())
        if total <= 0:
            raise ValueError("response_mask has no token: token-mean weights are undefined")
        return [float(per_seq[mb].sum()) / total for mb in micro_batches]
    if loss_agg_mode == "seq-mean-token-mean":
        n = sum(len(mb) for mb in micro_batches)
        return [len(mb) / n for mb in micro_batches]
    raise ValueError(
        f"loss_agg_mode={loss_agg_mode!r}: expected 'token-mean' or 'seq-mean-token-mean'"
    )


def padding_efficiency(lengths: Sequence[int], micro_batches: list[list[int]]) -> float:
    """Valid tokens / padded tokens computed when each micro-batch is padded to its longest."""
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches if mb)
    return sum(lengths[i] for mb in micro_batches for i in mb) / max(padded, 1)


def plan_micro_batches(
    lengths: torch.Tensor,
    max_tokens_per_micro_batch: int,
    mode: str = "packed",
    group: Any = None,
) -> list[list[int]]:
    """:func:`token_budget_micro_batches` with the same number of micro-batches on every rank.

    Each rank plans its own sequences, then the counts are all-reduced (MAX) over ``group``
    and ranks with fewer split further (``min_micro_batches``). Equal counts keep DeepSpeed's
    per-micro-batch collectives (ZeRO-2 reduces buckets on every backward) in lockstep.
    Collective when a process group is initialised: every rank of ``group`` must call it.

    Args:
        lengths: ``(B,)`` valid tokens per local sequence (on the device the group uses).
        max_tokens_per_micro_batch, mode: as in :func:`token_budget_micro_batches`.
        group: data-parallel process group (None = WORLD).

    Returns:
        This rank's micro-batches (index lists into ``lengths``).

    Raises:
        ValueError: as :func:`token_budget_micro_batches`, or the agreed count exceeds this
            rank's ``B`` (ranks hold different batch sizes; give every rank the same ``B``).
    """
    plan = token_budget_micro_batches(lengths, max_tokens_per_micro_batch, mode)
    if not (dist.is_available() and dist.is_initialized()):
        return plan
    while True:  # counts only grow and are bounded by B: at most a few rounds
        n = [len(plan), -len(plan), -len(lengths)]
        n = torch.tensor(n, dtype=torch.int64, device=lengths.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        k, k_min, b_min = int(n[0]), -int(n[1]), -int(n[2])
        if k == k_min:
            return plan
        if k > b_min:  # every rank sees the same numbers, so all raise together
            raise ValueError(
                f"a rank needs {k} micro-batches but another holds only {b_min} sequences; "
                "give every rank the same number of sequences"
            )
        if len(plan) < k:
            plan = token_budget_micro_batches(
                lengths, max_tokens_per_micro_batch, mode, min_micro_batches=k
            )
