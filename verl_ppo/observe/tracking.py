"""Where the metrics of a run go: ``train.logger: [console, jsonl, tensorboard, wandb]``.

Model: verl's ``verl/utils/tracking.py`` (``trainer.logger: ['console', 'wandb']``). Each
backend is a small adapter with the same two methods, ``log(metrics, step)`` and
``close()``, written on the library itself:

- ``console``: one human line per logged step (:func:`verl_ppo.observe.metrics.format_line`).
- ``jsonl``: ``run_dir/metrics.jsonl``, one object per logged step
  (:class:`verl_ppo.observe.metrics.MetricsWriter`).
- ``tensorboard``: event files under ``run_dir/tensorboard`` through
  ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package); one scalar
  per metric, tagged with the same name as the JSONL key (``timing_s/gen``,
  ``perf/throughput_tokens_per_s_per_gpu``), at ``global_step`` = the log's step.
- ``wandb``: a wandb run under ``run_dir/wandb``, **offline** unless the user chose
  otherwise (``train.wandb_mode`` or ``WANDB_MODE``); in offline mode nothing leaves the
  machine (``wandb sync run_dir/wandb/offline-run-*`` uploads it later).

Only rank 0 logs; the metrics it receives are already averaged over ranks.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from verl_ppo.observe.metrics import MetricsWriter, format_line

#: logger name -> (import name, pip package) of the library it is written on (None: stdlib)
BACKENDS: dict[str, tuple[str, str] | None] = {
    "console": None,
    "jsonl": None,
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}


class MetricLogger(Protocol):
    """One backend: receives a flat ``{name: float}`` dict per logged step."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` (names with units, e.g. ``timing_s/gen``) at ``step``."""

    def close(self) -> None:
        """Flush and release the backend."""


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of ``metrics`` (``step`` excluded), as floats."""
    out = {}
    for k, v in metrics.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(v):
            out[k] = float(v)
    return out


class ConsoleLogger:
    """One line per logged step through ``write`` (default: ``tqdm.write``, bar-safe)."""

    def __init__(
        self, write: Callable[[str], None] | None = None, comm_method: str | None = None
    ) -> None:
        if write is None:
            from tqdm import tqdm

            write = tqdm.write
        self.write = write
        self.comm_method = comm_method

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Print :func:`~verl_ppo.observe.metrics.format_line` of the step (with the compression
        field when ``comm_method``, the run's ``gradient_compression``, is set)."""
        self.write(format_line(step, metrics, comm_method=self.comm_method))

    def close(self) -> None:
        """Nothing to release."""


class JsonlLogger:
    """``run_dir/metrics.jsonl``: the record with its ``step``, keys sorted, NaN as null.

    ``resume_step`` > 0 drops the records of later steps first (they run again).
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0) -> None:
        self.writer = MetricsWriter(run_dir)
        if resume_step > 0:
            self.writer.truncate_after(resume_step)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Append ``{"step": step, **metrics}``."""
        self.writer.write({**metrics, "step": step})

    def close(self) -> None:
        """Nothing to release (each record is written and closed)."""


class TensorBoardLogger:
    """TensorBoard event files in ``run_dir/tensorboard`` (``add_scalar`` per metric).

    On resume (``resume_step`` > 0) the writer gets ``purge_step=resume_step + 1``, so
    TensorBoard hides the events of steps that run again, as the JSONL drops them.
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir), purge_step=resume_step + 1 if resume_step > 0 else None
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One scalar per finite numeric metric, tag = its name, ``global_step=step``."""
        for k, v in _scalars(metrics).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def wandb_mode(configured: str | None) -> str:
    """The wandb mode a run uses: ``train.wandb_mode`` if set, else ``$WANDB_MODE`` if set,
    else ``offline`` (never online by surprise)."""
    return configured or os.environ.get("WANDB_MODE") or "offline"


class WandbLogger:
    """A wandb run under ``run_dir/wandb`` (offline by default, see :func:`wandb_mode`).

    The run id is kept in ``run_dir/wandb/run_id`` so a resumed run logs into the same
    wandb run (``resume="allow"``). ``wandb.setup`` receives the mode before ``wandb.init``:
    wandb 0.31 otherwise sends its own usage telemetry over HTTPS from an offline run.

    Args:
        run_dir: the run folder.
        project, name: wandb project and run name.
        mode: ``offline``, ``online`` or ``disabled`` (from :func:`wandb_mode`).
        config: the run's configuration, stored with the run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        project: str,
        name: str,
        mode: str,
        config: dict[str, Any] | None = None,
    ) -> None:
        import wandb

        root = Path(run_dir) / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        settings = wandb.Settings(mode=mode, silent=True, console="off", save_code=False)
        wandb.setup(settings=settings)
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(Path(run_dir)),
            config=config or {},
            settings=settings,
        )
        self.mode = mode

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """``run.log`` of the finite numeric metrics at ``step``."""
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        """``run.finish()`` (in offline mode: closes the local run file)."""
        self.run.finish()


class Tracking:
    """Fans one metrics dict out to every configured backend (rank 0 only).

    Args:
        loggers: the backends, in the order of ``train.logger``.
    """

    def __init__(self, loggers: Iterable[MetricLogger] = ()) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Send ``metrics`` of ``step`` to each backend."""
        for lg in self.loggers:
            lg.log(metrics, step)

    def close(self) -> None:
        """Close each backend once."""
        for lg in self.loggers:
            lg.close()
        self.loggers = []


def missing_backends(names: Iterable[str]) -> list[str]:
    """``pip install`` hints for the libraries of ``names`` that are not installed."""
    import importlib.util

    out = []
    for n in names:
        lib = BACKENDS.get(n)
        if lib is not None and importlib.util.find_spec(lib[0]) is None:
            out.append(
                f"train.logger has {n!r} but the {lib[1]!r} package is not installed: "
                f"pip install {lib[1]} (or drop {n!r} from train.logger)"
            )
    return out


def build_tracking(
    train_cfg: Any,
    run_dir: str | Path,
    rank: int,
    resume_step: int = 0,
    config_dict: dict[str, Any] | None = None,
    console_write: Callable[[str], None] | None = None,
    comm_method: str | None = None,
) -> Tracking:
    """The backends of ``train.logger`` on rank 0, none elsewhere.

    Args:
        train_cfg: ``PPOConfig.train`` (``logger``, ``project_name``, ``experiment_name``,
            ``wandb_mode``).
        run_dir: the run folder.
        rank: this process's global rank.
        resume_step: the step the run resumes from (0 = fresh).
        config_dict: the whole configuration, stored with the wandb run.
        console_write: where console lines go (default ``tqdm.write``).
        comm_method: ``gradient_compression`` of the run, shown on the console line.

    Raises:
        ImportError: a backend's library is missing (config validation reports it first).
    """
    if rank != 0:
        return Tracking()
    problems = missing_backends(train_cfg.logger)
    if problems:
        raise ImportError("; ".join(problems))
    name = train_cfg.experiment_name or Path(run_dir).resolve().name
    loggers: list[MetricLogger] = []
    for n in train_cfg.logger:
        if n == "console":
            loggers.append(ConsoleLogger(console_write, comm_method))
        elif n == "jsonl":
            loggers.append(JsonlLogger(run_dir, resume_step))
        elif n == "tensorboard":
            loggers.append(TensorBoardLogger(run_dir, resume_step))
        elif n == "wandb":
            mode = wandb_mode(train_cfg.wandb_mode)
            loggers.append(WandbLogger(run_dir, train_cfg.project_name, name, mode, config_dict))
        else:  # the config's Literal forbids this; kept for configs built by hand
            raise ValueError(f"train.logger: unknown backend {n!r}; choose from {list(BACKENDS)}")
    return Tracking(loggers)
