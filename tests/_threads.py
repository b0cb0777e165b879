"""Run one function per simulated rank on threads (the thread collectives of
``verl_comm.compression.collective`` pair them)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_threads(rank: Callable[[int], None], n: int = 2, timeout_s: float = 60.0) -> None:
    """Call ``rank(r)`` for r in 0..n-1, each on its own thread, and join them.

    Raises:
        TimeoutError: a thread still runs after ``timeout_s`` (a collective never paired).
    """
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        raise TimeoutError(f"rank threads {alive} still running after {timeout_s} s")
