"""The next step's prompts, prepared on the host while this step runs on the device.

A step's prompts (the task's samples, their chat template, tokenization of the batch) are
host work that the device would otherwise wait for at the start of every step: at the
benchmark's 128 prompts of 256 tokens, tokenizing took 52 of the 59 ms a step spent outside
its phases on a 2-core CPU with ``TOKENIZERS_PARALLELISM=false``
(``benchmarks/gpu/profile_step_host.py``). verl keeps this off the step's path with its
``RLHFDataset`` tokenizing in ``DataLoader`` workers (``verl/utils/dataset/rl_dataset.py``);
here one worker thread builds step ``s + 1``'s prompts as soon as step ``s`` has taken its
own. The prompts of a step depend on the step number only, so a prefetched batch equals the
one built on demand (tested).

Every build runs on the worker thread, on demand too, so the task's train split (generated
lazily, :class:`verl_ppo.data.tasks._TrainSplit`) is never used by two threads. The builder
receives its own copy of the tokenizer: a fast tokenizer's padding settings are state that
two threads must not share (the caller's tokenizer keeps decoding responses meanwhile).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepPrompts:
    """One rank's prompts of one step, on the host.

    Attributes:
        texts: ``B`` prompt texts (each prompt repeated ``algorithm.n_samples`` times).
        entries: ``B`` task entries (what the scorer needs).
        groups: ``(B,)`` int64 group index (samples of one prompt share it).
        input_ids, attention_mask: ``(B, P)`` int64, left-padded, on the CPU.
    """

    texts: list[str]
    entries: list[dict]
    groups: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class PromptPrefetcher:
    """Builds step ``s + 1``'s :class:`StepPrompts` on one worker thread while step ``s`` runs.

    Args:
        build: ``build(step) -> StepPrompts``, a function of the step number only; it is
            always called on the worker thread.

    After the run's last step one batch is built that no step takes (the run may be
    extended by ``PPOTrainer.run(num_steps)``); :meth:`close` waits for it.
    """

    def __init__(self, build: Callable[[int], StepPrompts]) -> None:
        self._build = build
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")
        self._next: tuple[int, Future[StepPrompts]] | None = None
        self.hits = 0  # steps served by a prefetch

    def get(self, step: int) -> StepPrompts:
        """``step``'s prompts (the prefetched batch when it is for ``step``); then starts
        building ``step + 1``'s. Re-raises what ``build`` raised."""
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step:
            fut = pending[1]
            self.hits += 1
        else:
            if pending is not None:
                pending[1].cancel()
            fut = self._pool.submit(self._build, step)
        out = fut.result()
        self._next = (step + 1, self._pool.submit(self._build, step + 1))
        return out

    def close(self) -> None:
        """Drop a pending prefetch and stop the worker (waits for a build in progress)."""
        if self._next is not None:
            self._next[1].cancel()
            self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)


def private_tokenizer(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` for the worker thread (see the module docstring)."""
    return copy.deepcopy(tokenizer)
