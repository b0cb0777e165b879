"""The next step's prompts, tokenized on the host while this step runs on the device.

Tokenizing a step's prompts is host work that the device would otherwise wait for at the
start of every step. At the benchmark's 128 prompts of 256 tokens it took 52 of the 59 ms
that a step spent outside its phases, on a 2-core CPU with ``TOKENIZERS_PARALLELISM=false``
(``benchmarks/gpu/profile_step_host.py``). verl keeps this off the step's path: its
``RLHFDataset`` tokenizes in ``DataLoader`` workers (``verl/utils/dataset/rl_dataset.py``).
Here, when step ``s`` takes its prompts, the texts of step ``s + 1`` are drawn on the
calling thread and handed to one worker thread, which tokenizes them during step ``s``.

Only the tokenization moves:
- The task is sampled on the calling thread. Tasks generate their train split lazily
  (:class:`verl_ppo.data.tasks._TrainSplit`), and a file source measures its rows with the
  tokenizer it was built with (:meth:`verl_ppo.data.file_source.FileSource.sample`).
  Neither is shared with a second thread.
- The worker tokenizes with its own copy of the tokenizer. A fast tokenizer's padding
  settings are state that two threads must not share, and the caller's tokenizer goes on
  decoding responses meanwhile.

A step's prompts depend only on the step number, so a prefetched batch equals the one built
on demand (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

Texts = tuple[list[str], list[dict], torch.Tensor]  # texts, entries, groups
Tokens = tuple[torch.Tensor, torch.Tensor]  # input_ids, attention_mask


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
    """Tokenizes step ``s + 1``'s prompts on one worker thread while step ``s`` runs.

    Args:
        prompts_of: ``prompts_of(step) -> (texts, entries, groups)``. It is a function of the
            step number only, and is always called on the thread that calls :meth:`get`.
        tokenize: ``tokenize(texts) -> (input_ids, attention_mask)`` on the CPU. It is always
            called on the worker thread.
        last_step: the run's last step (``train.num_steps - 1``); nothing is prefetched
            past it. None: always prefetch.

    Errors are raised in the step they belong to. If drawing or tokenizing step
    ``s + 1``'s prompts fails, :meth:`get` raises for ``s + 1``, not for ``s``.
    """

    def __init__(
        self,
        prompts_of: Callable[[int], Texts],
        tokenize: Callable[[list[str]], Tokens],
        last_step: int | None = None,
    ) -> None:
        self._prompts_of, self._tokenize, self._last = prompts_of, tokenize, last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompts")
        # (step, its texts or None, its tokens: a Future that holds a drawing error too)
        self._next: tuple[int, Texts | None, Future[Tokens]] | None = None
        self.hits = 0  # steps served by a prefetch

    def get(self, step: int) -> StepPrompts:
        """``step``'s prompts (prefetched when the previous call was for ``step - 1``); then
        draws ``step + 1``'s texts and starts tokenizing them. Re-raises what ``prompts_of``
        or ``tokenize`` raised for ``step``."""
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step:
            _, drawn, fut = pending
            self.hits += 1
        else:
            if pending is not None:
                pending[2].cancel()
            drawn = self._prompts_of(step)
            fut = self._pool.submit(self._tokenize, drawn[0])
        ids, mask = fut.result()  # raises a drawing or tokenizing error of this step
        assert drawn is not None  # a drawing error was raised just above
        if self._last is None or step + 1 <= self._last:
            self._next = self._start(step + 1)
        return StepPrompts(*drawn, ids, mask)

    def _start(self, step: int) -> tuple[int, Texts | None, Future[Tokens]]:
        """Draw ``step``'s texts here and submit their tokenization; a drawing error is kept
        in the returned Future, for the call that asks for ``step``."""
        try:
            drawn = self._prompts_of(step)
        except Exception as e:
            failed: Future[Tokens] = Future()
            failed.set_exception(e)
            return step, None, failed
        return step, drawn, self._pool.submit(self._tokenize, drawn[0])

    def close(self) -> None:
        """Drop a pending prefetch and stop the worker (waits for a tokenization in progress)."""
        if self._next is not None:
            self._next[2].cancel()
        self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)
