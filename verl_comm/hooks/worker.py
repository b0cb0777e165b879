"""The communication worker of a hook state: lanes of threads that run bucket jobs in order.

On gloo (CPU tensors) a hook hands each bucket's compress -> communicate -> decompress chain
to this worker and returns a Future at once, so backward keeps computing while the link
works. Collectives are never started from a ``Future.then`` callback (on gloo that deadlocks
or reorders between ranks, see docs/ARCHITECTURE.md): a lane thread starts and waits on them
itself. The Future of a bucket completes when its reduction is done.

Lanes (issue 28). With one thread, a bucket's chain is serial: while it quantizes, casts or
dequantizes, the link is idle, and the next bucket waits for the whole chain of the previous
one. torch's ``fp16_compress_hook`` instead launches async gloo all-reduces, which gloo's
two threads per process group run side by side. A worker with ``L`` lanes runs bucket ``i``
on lane ``i % L``; lane ``k`` has its own thread and its own process group (lane 0 the
state's, the others duplicates made by :meth:`CommWorker.open_lanes`), so one bucket's
compute overlaps another's transfer. Every process group still sees its collectives in the
same order on every rank: a lane runs its buckets in submission order, which is DDP's bucket
order (DDP calls the hook of bucket ``i + 1`` only after that of bucket ``i``), and the
assignment ``i % L`` is the same on every rank. Only chains that touch no state shared
between buckets may run on lanes other than 0 (see :mod:`verl_comm.hooks.lanes`).

Failure model: the first exception of a job is wrapped in :class:`CommWorkerError` (naming
the bucket and iteration) and set on that bucket's Future; every later job fails at once with
the same error, without starting a collective (a rank that skipped a collective cannot join
the next one in order). A peer blocked in a collective of the failed bucket gets its process
group's timeout, which its worker turns into the same kind of error.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


class CommWorkerError(RuntimeError):
    """A bucket's reduction failed on the communication worker (this rank or a peer)."""


class CommWorker:
    """Daemon lane threads running ``job(collective)`` callables, FIFO per lane.

    Args:
        name: thread name prefix (shows in stack dumps).

    Attributes:
        error: the first :class:`CommWorkerError`, or None.
    """

    def __init__(self, name: str = "verl-comm-worker") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._unfinished: set[int] = set()
        self._local = threading.local()
        self._closed = False
        self.error: CommWorkerError | None = None
        self._lanes: list[tuple[queue.SimpleQueue, threading.Thread]] = []
        self._colls: list[Any] = [None]
        self._add_lane()

    def _add_lane(self) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        k = len(self._lanes)
        t = threading.Thread(target=self._run, args=(q,), name=f"{self._name}-{k}", daemon=True)
        self._lanes.append((q, t))
        t.start()

    @property
    def lanes(self) -> int:
        """Number of lanes opened (1 until :meth:`open_lanes`)."""
        return len(self._lanes)

    def open_lanes(self, n: int, make_collective: Callable[[], Any]) -> None:
        """Open lanes up to ``n``, each with the collective ``make_collective()`` returns
        (a new process group over the same ranks: collective, so call it on every rank at
        the same point, e.g. in a hook body). Idempotent."""
        while len(self._lanes) < n:
            self._colls.append(make_collective())
            self._add_lane()

    def submit(
        self,
        job: Callable[[Any], Any],
        fut: torch.futures.Future,
        what: str,
        fatal: Callable[[BaseException], bool] = lambda e: True,
        lane: int = 0,
    ) -> None:
        """Queue ``job`` on ``lane``; its result (or error) completes ``fut``.

        Args:
            job: runs on the lane thread, called with the lane's collective (None on lane
                0: the caller's own); returns the Future's value.
            fut: completed with the value, or with a :class:`CommWorkerError` /
                the job's own exception.
            what: names the job in error messages (e.g. ``"bucket 3 at iteration 7"``).
            fatal: whether an exception poisons later jobs (transport failures do; a
                non-finite verdict, identical on every rank, does not).
            lane: ``0 <= lane < lanes``.

        Raises:
            CommWorkerError: the worker was closed.
            ValueError: no such lane.
        """
        if not 0 <= lane < len(self._lanes):
            raise ValueError(f"lane {lane} not open (lanes: {len(self._lanes)})")
        with self._cv:
            if self._closed:
                raise CommWorkerError("the comm hook worker was closed; build a new hook state")
            seq = self._submitted
            self._submitted += 1
            self._unfinished.add(seq)
        self._lanes[lane][0].put((job, fut, what, fatal, seq, self._colls[lane]))

    def wait_earlier(self, timeout_s: float) -> None:
        """Called from a job: block until every job submitted before it has finished (on
        any lane), e.g. before closing a step that the earlier buckets belong to.

        Raises:
            TimeoutError: still waiting after ``timeout_s`` seconds.
        """
        seq = self._local.seq
        self._wait_until(
            lambda: not (self._unfinished and min(self._unfinished) < seq),
            timeout_s,
            lambda: "earlier bucket(s)",
        )

    def _run(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            job, fut, what, fatal, seq, coll = item
            self._local.seq = seq
            try:
                if self.error is not None:
                    raise self.error
                value = job(coll)
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
                self._finish(fut.set_exception, err, seq)
            else:
                self._finish(fut.set_result, value, seq)

    def _finish(self, complete: Callable[[Any], None], arg: Any, seq: int) -> None:
        try:
            complete(arg)  # the Future is done before drain() can return
        finally:
            with self._cv:
                self._done += 1
                self._unfinished.discard(seq)
                self._cv.notify_all()

    def drain(self, timeout_s: float) -> None:
        """Block until every submitted job has finished.

        Raises:
            TimeoutError: jobs still running after ``timeout_s`` seconds.
        """
        self._wait_until(
            lambda: self._done >= self._submitted,
            timeout_s,
            lambda: f"{self._submitted - self._done} bucket(s)",
        )

    def _wait_until(
        self, done: Callable[[], bool], timeout_s: float, pending: Callable[[], str]
    ) -> None:
        """Block until ``done()`` holds (read under the lock, re-read at every finished job).

        Raises:
            TimeoutError: naming ``pending()`` (what is still in flight) after ``timeout_s``.
        """
        with self._cv:
            if not self._cv.wait_for(done, timeout_s):
                raise TimeoutError(
                    f"comm hook worker: {pending()} still in flight after {timeout_s:g} s; "
                    "a peer rank may be stuck or dead"
                )

    def is_alive(self) -> bool:
        """Whether any lane thread is running."""
        return any(t.is_alive() for _, t in self._lanes)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not finished."""
        with self._cv:
            return self._submitted - self._done

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the lane threads after their queued jobs (idempotent)."""
        with self._cv:
            self._closed = True
        for q, t in self._lanes:
            if t.is_alive():
                q.put(None)
        for _, t in self._lanes:
            t.join(timeout_s)
        for coll in self._colls[1:]:  # the lanes' own process groups (local teardown)
            group = getattr(coll, "group", None)
            if group is not None and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group(group)
        self._colls = [None]
