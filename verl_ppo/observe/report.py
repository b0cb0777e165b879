"""What a run tells its user: compression state per step, sample triples, one summary line.

- :func:`comm_part`: the step line's ``comm`` field, e.g. ``comm int8 actor 3.88x critic
  3.88x`` (ratio = bytes a plain fp32 all-reduce would send / bytes sent, this rank, the
  step's last gradient reduction), ``actor off`` before ``compression.start_iter``.
- :func:`format_samples`: a few held-out prompt / response / reward triples, printed at the
  start and the end as verl prints validation generations.
- :class:`RunSummary`: the last line (eval start -> end, wall time, tokens/s, compression)
  and the notice of a run in which compression was asked for but never turned on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("actor", "critic")


def _ratio(m: dict[str, Any], role: str) -> float | None:
    v = m.get(f"comm/{role}/compression_ratio")
    return None if v is None else float(v)


def comm_part(m: dict[str, Any], method: str) -> str:
    """The step line's compression field for the metrics ``m`` of one step.

    Args:
        m: step metrics with ``comm/<role>/compression_ratio`` when hooks are attached.
        method: ``gradient_compression`` (``none`` = DeepSpeed's own fp32 all-reduce).
    """
    if method == "none":
        return "comm none"
    parts = [f"comm {method}"]
    for role in ROLES:
        r = _ratio(m, role)
        if r is not None:
            parts.append(f"{role} {r:.2f}x" if r > 1.0 else f"{role} off")
    return " ".join(parts)


@dataclass
class Sample:
    """One scored held-out generation (plain text)."""

    prompt: str
    response: str
    reward: float


def format_samples(title: str, samples: list[Sample]) -> str:
    """``[prompt] ... [response] ... [reward] ...`` blocks under a ``title`` line."""
    lines = [title]
    for i, s in enumerate(samples, 1):
        lines += [
            f"  #{i} [prompt] {s.prompt.strip()}",
            f"     [response] {s.response.strip()!r}",
            f"     [reward] {s.reward:.3g}",
        ]
    return "\n".join(lines)


@dataclass
class RunSummary:
    """Accumulates what the summary line reports.

    Args:
        method: ``gradient_compression``.
        start_iter: ``compression.start_iter`` (for the never-turned-on notice).
        world_size: data-parallel ranks.
        resumed_at: the checkpoint step this run resumed from (None = a fresh start).
    """

    method: str
    start_iter: int
    world_size: int
    resumed_at: int | None = None
    eval_start: float | None = None
    eval_end: float | None = None
    steps: int = 0
    tokens: float = 0.0
    train_s: float = 0.0
    ratios: dict[str, float] = field(default_factory=dict)
    compressed: dict[str, bool] = field(default_factory=dict)

    def observe(self, m: dict[str, Any]) -> None:
        """Add one step's metrics (``perf/tokens``, ``timing_s/step``, comm ratios)."""
        self.steps += 1
        self.tokens += float(m.get("perf/tokens", 0.0))
        self.train_s += float(m.get("timing_s/step", 0.0))
        for role in ROLES:
            r = _ratio(m, role)
            if r is not None:
                self.ratios[role] = r
                self.compressed[role] = self.compressed.get(role, False) or r > 1.0

    def never_compressed(self) -> str | None:
        """A notice when compression was asked for and no reduction was compressed."""
        if self.method in ("none",) or not self.compressed or any(self.compressed.values()):
            return None
        if self.world_size == 1:
            why = "the world size is 1, so there was nothing to communicate"
        else:
            why = (
                f"it starts at gradient reduction compression.start_iter={self.start_iter} "
                "(one reduction per mini-batch and role) and the run ended before it"
            )
        return f"gradient_compression={self.method} was asked for but never turned on: {why}"

    def line(self, wall_s: float, stopped: int = 0) -> str:
        """The summary line, e.g. ``done | eval 0.469 -> 0.906 (+0.438) | 30 steps, wall
        312 s | 1450 tokens/s | comm int8 actor 3.88x critic 3.88x`` (after a resume,
        ``done | resumed at step 6 | eval ...``: ``steps`` counts this run's steps)."""
        head = f"stopped (signal {stopped})" if stopped else "done"
        parts = [head]
        if self.resumed_at:
            parts.append(f"resumed at step {self.resumed_at}")
        if self.eval_start is not None and self.eval_end is not None:
            d = self.eval_end - self.eval_start
            parts.append(f"eval {self.eval_start:.3f} -> {self.eval_end:.3f} ({d:+.3f})")
        elif self.eval_start is not None:
            parts.append(f"eval {self.eval_start:.3f} at start")
        parts.append(f"{self.steps} steps, wall {wall_s:.0f} s")
        tps = self.tokens / self.train_s if self.train_s > 0 else 0.0
        parts.append(f"{tps:.0f} tokens/s")
        if self.method == "none":
            parts.append("comm none")
        else:
            done = [f"{r} {self.ratios[r]:.2f}x" for r in ROLES if self.compressed.get(r)]
            parts.append(f"comm {self.method} " + (" ".join(done) if done else "never on"))
        return " | ".join(parts)
