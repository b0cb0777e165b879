"""Communication records shared by the hooks, the reducer, the resharding engine
and the profiler; the process's resident memory (:func:`rss_bytes`).

A :class:`CommRecorder` is passed in explicitly (hook state, reducer, reshard
executor take ``recorder=``); nothing here is global. Records carry bytes on the
wire per rank, the group size and the wall time of the collective.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class CommRecord:
    """One collective (or one fused group of collectives) as seen by one rank.

    Attributes:
        op: collective name, e.g. ``"all_reduce"``, ``"all_to_all"``, ``"all_gather"``.
        nbytes: bytes this rank sent on the wire (payload, not counting protocol overhead).
        group_size: number of ranks in the process group.
        duration_s: wall time in seconds from issue to completion as measured by the
            caller (CUDA events converted to seconds on GPU, ``time.perf_counter`` on CPU).
        tag: free-form origin, e.g. ``"hook/int8/bucket3"`` or ``"reshard/bucket0"``.
        start_s: ``time.perf_counter()`` at issue, for timelines.
        extra: additional numeric fields (compression ratio, relative error, ...).
    """

    op: str
    nbytes: int
    group_size: int
    duration_s: float
    tag: str = ""
    start_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Return the record as a plain JSON-serialisable dict."""
        return asdict(self)


class CommRecorder:
    """Thread-safe, bounded list of :class:`CommRecord`.

    Args:
        max_records: oldest records are dropped beyond this many (bounded memory).
        enabled: when False, :meth:`record` is a no-op (zero overhead when off).
    """

    def __init__(self, max_records: int = 100_000, enabled: bool = True) -> None:
        if max_records <= 0:
            raise ValueError(f"max_records must be positive, got {max_records}")
        self.max_records = max_records
        self.enabled = enabled
        self._records: list[CommRecord] = []
        self._lock = threading.Lock()

    def record(self, rec: CommRecord) -> None:
        """Append one record (dropped silently when the recorder is disabled)."""
        if not self.enabled:
            return
        with self._lock:
            self._records.append(rec)
            if len(self._records) > self.max_records:
                del self._records[: len(self._records) - self.max_records]

    @contextmanager
    def timed(self, op: str, nbytes: int, group_size: int, tag: str = "") -> Iterator[dict]:
        """Time a blocking region with ``time.perf_counter`` and record it.

        Yields a dict whose items are stored in the record's ``extra``.
        """
        extra: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            yield extra
        finally:
            if self.enabled:
                self.record(
                    CommRecord(op, nbytes, group_size, time.perf_counter() - t0, tag, t0, extra)
                )

    def drain(self) -> list[CommRecord]:
        """Return all records and clear the list."""
        with self._lock:
            out, self._records = self._records, []
        return out

    @property
    def records(self) -> list[CommRecord]:
        """A copy of the records collected so far."""
        with self._lock:
            return list(self._records)

    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over the records collected so far."""
        with self._lock:
            return sum(r.nbytes for r in self._records)


def rss_bytes() -> int:
    """Resident set size of this process in bytes: the current one from ``/proc/self/statm``
    (Linux), elsewhere the peak one from ``getrusage`` (``ru_maxrss``: bytes on macOS, KiB on
    the other systems); 0 where neither exists."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
