"""The communication worker of a hook state: one thread that runs bucket jobs in order.

On gloo (CPU tensors) a hook hands each bucket's compress -> communicate -> decompress chain
to this worker and returns a Future at once, so backward keeps computing while the link
works. Collectives are never started from a ``Future.then`` callback (on gloo that deadlocks
or reorders between ranks, see docs/ARCHITECTURE.md): the worker starts and waits on them in
its own thread, in submission order, which is DDP's bucket order (DDP calls the hook of
bucket ``i + 1`` only after that of bucket ``i``), so the collective order is identical on
every rank. The Future of a bucket completes when its reduction is done.

Failure model: the first exception of a job is wrapped in :class:`CommWorkerError` (naming
the bucket and iteration) and set on that bucket's Future; every later job fails at once with
the same error, without starting a collective (a rank that skipped a collective cannot join
the next one in order). A peer blocked in a collective of the failed bucket gets its process
group's timeout, which its worker turns into the same kind of error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch


class CommWorkerError(RuntimeError):
    """A bucket's reduction failed on the communication worker (this rank or a peer)."""


class CommWorker:
    """A daemon thread running ``job()`` callables one after another (FIFO).

    Args:
        name: thread name (shows in stack dumps).

    Attributes:
        error: the first :class:`CommWorkerError`, or None.
    """

    def __init__(self, name: str = "verl-comm-worker") -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._submitted = 0
        self._done = 0
        self.error: CommWorkerError | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(
        self,
        job: Callable[[], Any],
        fut: torch.futures.Future,
        what: str,
        fatal: Callable[[BaseException], bool] = lambda e: True,
    ) -> None:
        """Queue ``job``; its result (or error) completes ``fut``.

        Args:
            job: runs on the worker; returns the Future's value.
            fut: completed with the value, or with a :class:`CommWorkerError` /
                the job's own exception.
            what: names the job in error messages (e.g. ``"bucket 3 at iteration 7"``).
            fatal: whether an exception poisons later jobs (transport failures do; a
                non-finite verdict, identical on every rank, does not).
        """
        with self._cv:
            if not self._thread.is_alive():
                raise CommWorkerError("the comm hook worker was closed; build a new hook state")
            self._submitted += 1
        self._q.put((job, fut, what, fatal))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, fut, what, fatal = item
            try:
                if self.error is not None:
                    raise self.error
                value = job()
            except BaseException as e:  # noqa: BLE001 - every error goes to the Future
                if isinstance(e, CommWorkerError) or not fatal(e):
                    err = e
                else:
                    err = CommWorkerError(
                        f"comm hook worker: {what} failed: {type(e).__name__}: {e}. Every later "
                        "bucket of this hook state fails too; if this rank is healthy, a peer "
                        "rank failed or left the collective (see its error)"
                    )
                    err.__cause__ = e
                    self.error = err
                self._finish(fut.set_exception, err)
            else:
                self._finish(fut.set_result, value)

    def _finish(self, complete: Callable[[Any], None], arg: Any) -> None:
        try:
            complete(arg)  # the Future is done before drain() can return
        finally:
            with self._cv:
                self._done += 1
                self._cv.notify_all()

    def drain(self, timeout_s: float) -> None:
        """Block until every submitted job has finished.

        Raises:
            TimeoutError: jobs still running after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._done < self._submitted:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"comm hook worker: {self._submitted - self._done} bucket(s) still in "
                        f"flight after {timeout_s:g} s; a peer rank may be stuck or dead"
                    )
                self._cv.wait(left)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not finished."""
        with self._cv:
            return self._submitted - self._done

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after the queued jobs (idempotent)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout_s)
