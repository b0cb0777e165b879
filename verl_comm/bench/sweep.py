"""Pure helpers of the collective benchmark: sizes, bandwidth factors, statistics.

Nothing here touches a process group, so all of it is unit-tested in one process.

Bandwidth definitions follow NVIDIA/nccl-tests ``doc/PERFORMANCE.md``:
``algbw = S / t`` with ``S`` the bytes of the collective's buffer (all_reduce: the buffer;
reduce_scatter: the input, i.e. the total; all_gather: the output, i.e. the total;
all_to_all: the per-rank buffer; broadcast: the buffer) and
``busbw = algbw * factor(n)`` with ``factor = 2(n-1)/n`` for all_reduce, ``(n-1)/n`` for
reduce_scatter, all_gather and all_to_all, and ``1`` for broadcast. Bandwidths are in
GB/s (1e9 bytes per second), as nccl-tests prints them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?[bB])?\s*$")
_MULT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str | int, field: str = "size") -> int:
    """Parse a byte count such as ``"8"``, ``"64K"``, ``"1M"``, ``"1G"``, ``"512MiB"``.

    Suffixes are binary, as in nccl-tests (``K`` = 1024 bytes).

    Args:
        text: the size, an int or a string with an optional K/M/G suffix.
        field: the option name used in error messages (e.g. ``"-b/--minbytes"``).

    Returns:
        The number of bytes (int, >= 1).

    Raises:
        ValueError: when the text is not a positive size; the message names ``field``.
    """
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m:
            raise ValueError(
                f"{field}: cannot read {text!r} as a size; write bytes with an optional "
                "K/M/G suffix, e.g. 8, 64K, 1M, 1G"
            )
        value = int(float(m.group(1)) * _MULT[m.group(2).upper()])
    if value < 1:
        raise ValueError(f"{field}: size must be at least 1 byte, got {text!r}")
    return value


def size_sweep(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """Sizes ``minbytes, minbytes*factor, ...`` up to and including ``maxbytes``.

    Args:
        minbytes: first size in bytes (>= 1).
        maxbytes: last size in bytes (>= minbytes).
        factor: multiplicative step (> 1), as nccl-tests' ``-f``.

    Returns:
        Strictly increasing list of sizes in bytes.

    Raises:
        ValueError: on an empty range or a factor <= 1.
    """
    if minbytes < 1:
        raise ValueError(f"-b/--minbytes must be >= 1, got {minbytes}")
    if maxbytes < minbytes:
        raise ValueError(f"-e/--maxbytes ({maxbytes}) must be >= -b/--minbytes ({minbytes})")
    if minbytes == maxbytes:
        return [minbytes]
    if not factor > 1:
        raise ValueError(f"-f/--stepfactor must be > 1, got {factor}")
    sizes: list[int] = []
    size = float(minbytes)
    while int(size) <= maxbytes:
        if not sizes or int(size) > sizes[-1]:
            sizes.append(int(size))
        size *= factor
    return sizes


def element_count(collective: str, nbytes: int, elem_size: int, world_size: int) -> int:
    """Number of elements of the collective's buffer (the ``S`` buffer) for ``nbytes``.

    Collectives that split the buffer into ``world_size`` equal chunks (reduce_scatter,
    all_gather, all_to_all) round the count down to a multiple of ``world_size``.
    Returns 0 when the size is too small to hold one element per chunk.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"--op must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    count = nbytes // elem_size
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        count = (count // world_size) * world_size
    return count


def busbw_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` on ``world_size`` ranks."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"--op must be one of {', '.join(COLLECTIVES)}, got {collective!r}")


def bandwidths(
    collective: str, nbytes: int, seconds: float, world_size: int
) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for ``nbytes`` moved in ``seconds``.

    Returns ``(nan, nan)`` when ``seconds`` is not positive.
    """
    if not seconds > 0:
        return math.nan, math.nan
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * busbw_factor(collective, world_size)


def latency_stats(times_s: Sequence[float]) -> dict[str, float]:
    """Mean, P50, P99, min and max of per-iteration times, returned in microseconds.

    Percentiles use linear interpolation between order statistics (numpy's default);
    with fewer than 100 iterations P99 lies between the two largest samples.

    Raises:
        ValueError: when ``times_s`` is empty.
    """
    arr = np.asarray(times_s, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("latency_stats needs at least one timed iteration (-n/--iters >= 1)")
    us = arr * 1e6
    return {
        "time_us_mean": float(us.mean()),
        "time_us_p50": float(np.percentile(us, 50)),
        "time_us_p99": float(np.percentile(us, 99)),
        "time_us_min": float(us.min()),
        "time_us_max": float(us.max()),
    }


def iterations_for_budget(
    iters: int, est_seconds_per_iter: float, budget_s: float | None, min_iters: int
) -> int:
    """Number of timed iterations: ``iters`` capped so that they fit in ``budget_s`` seconds.

    Args:
        iters: requested iterations (``-n``).
        est_seconds_per_iter: estimated time of one iteration (from the warm-up), seconds.
        budget_s: per-size time budget in seconds, or None for no cap.
        min_iters: lower bound of the cap (>= 1), so that P50/P99 stay meaningful.
    """
    if budget_s is None or est_seconds_per_iter <= 0:
        return iters
    cap = max(min_iters, int(budget_s / est_seconds_per_iter))
    return max(1, min(iters, cap))
