"""Prometheus endpoint for a running PPO job (``monitor.prometheus_port``).

Rank 0 serves ``/metrics`` over HTTP (bound to 127.0.0.1 unless configured otherwise: the
page is unauthenticated); other ranks create nothing. Gauges live in a private
``CollectorRegistry``, so several monitors (tests, two trainers in one process) never clash
and the process-global default registry stays untouched.

The trainer calls :meth:`PrometheusMonitor.update` with its step metrics (the namespaced
keys of :mod:`verl_ppo.observe.metrics`); the mapping is:

==========================================  ==================================================
trainer key                                  Prometheus series
==========================================  ==================================================
``timing_s/step``                            ``verl_ppo_step_time_seconds``
``timing_s/<phase>``                         ``verl_ppo_phase_time_seconds{phase="<phase>"}``
``perf/throughput_tokens_per_s``             ``verl_ppo_throughput_tokens_per_second``
``perf/throughput_tokens_per_s_per_gpu``     ``verl_ppo_throughput_tokens_per_second_per_gpu``
``reward/mean``                              ``verl_ppo_reward_mean``
``comm/<role>/[comm/]wire_bytes|bytes``      ``verl_ppo_allreduce_bytes{role}``
``comm/<role>/[comm/]hook_time_s|time_s``    ``verl_ppo_allreduce_time_seconds{role}``
``comm/<role>/[comm/]compression_ratio``     ``verl_ppo_compression_ratio{role}``
any other finite number                      ``verl_ppo_metric{name="<key>"}`` (``export_all``)
==========================================  ==================================================

``comm/...`` keys without a role get ``role="all"``. Memory is sampled at each update:
``verl_ppo_memory_allocated_bytes`` / ``verl_ppo_memory_reserved_bytes`` (CUDA caching
allocator, ``device`` label) when CUDA is used, and ``verl_ppo_memory_rss_bytes`` (resident
set of this process, from ``/proc/self/statm``) always. ``verl_ppo_step`` is the step number.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from verl_comm.telemetry import rss_bytes

_COMM = {
    "wire_bytes": "bytes",
    "bytes": "bytes",
    "allreduce_bytes": "bytes",
    "hook_time_s": "time",
    "time_s": "time",
    "allreduce_time_s": "time",
    "compression_ratio": "ratio",
}


class PrometheusMonitor:
    """Gauges of a PPO run served on ``http://host:port/metrics`` by rank 0.

    Args:
        port: TCP port; 0 = an ephemeral port chosen by the OS (read :attr:`port`).
        host: bind address; the default keeps the page on the local machine.
        rank: this process's global rank; only rank 0 serves and records.
        device: the CUDA device to sample memory of (``torch.device``, string or index);
            None or a CPU device = no CUDA memory gauges (RSS only).
        export_all: also export every other finite metric as ``verl_ppo_metric{name}``.

    Attributes:
        port: the bound port on rank 0, None elsewhere.
        url: ``http://host:port/metrics`` on rank 0, None elsewhere.

    Raises:
        ValueError: ``port`` outside ``[0, 65535]``.
        OSError: the address cannot be bound (names ``monitor.prometheus_port`` and the fix).
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        rank: int = 0,
        device: Any = None,
        export_all: bool = True,
    ) -> None:
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"monitor.prometheus_port={port} must be in [0, 65535] (0 = any)")
        self.enabled = rank == 0
        self.port: int | None = None
        self.url: str | None = None
        self.device = None
        if device is not None:
            import torch

            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
            self.device = dev if dev.type == "cuda" else None
        self.export_all = export_all
        self._server = self._thread = None
        if not self.enabled:
            return
        self.registry = CollectorRegistry()
        g = self._gauge
        self.step = g("step", "PPO step number of the latest update")
        self.step_time = g("step_time_seconds", "wall time of the latest step (s)")
        self.phase_time = g("phase_time_seconds", "wall time per phase (s)", ["phase"])
        self.tokens_per_s = g("throughput_tokens_per_second", "tokens/s, all ranks")
        self.tokens_per_s_gpu = g("throughput_tokens_per_second_per_gpu", "tokens/s per GPU")
        self.reward_mean = g("reward_mean", "mean rule/model reward of the rollout batch")
        self.ar_bytes = g("allreduce_bytes", "gradient all-reduce bytes sent per step", ["role"])
        self.ar_time = g("allreduce_time_seconds", "gradient all-reduce time per step", ["role"])
        self.ratio = g("compression_ratio", "uncompressed / wire bytes", ["role"])
        self.mem_alloc = g("memory_allocated_bytes", "CUDA memory allocated", ["device"])
        self.mem_reserved = g("memory_reserved_bytes", "CUDA memory reserved", ["device"])
        self.rss = g("memory_rss_bytes", "resident set size of the process")
        self.other = g("metric", "any other trainer metric", ["name"])
        try:
            self._server, self._thread = start_http_server(
                int(port), addr=host, registry=self.registry
            )
        except OSError as e:
            raise OSError(
                f"cannot serve Prometheus metrics on {host}:{port} ({e}); set "
                "monitor.prometheus_port to a free port, or 0 for any"
            ) from e
        self.port = int(self._server.server_port)
        self.url = f"http://{host}:{self.port}/metrics"

    def _gauge(self, name: str, doc: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(f"verl_ppo_{name}", doc, labels or [], registry=self.registry)

    def _comm(self, key: str, value: float) -> bool:
        parts = key.split("/")
        name = parts[-1]
        if name not in _COMM:
            return False
        # comm/<role>/<name>, comm/<role>/comm/<name> (hook metrics nested), comm/<name>
        role = parts[1] if len(parts) >= 3 and parts[1] != "comm" else "all"
        gauge = {"bytes": self.ar_bytes, "time": self.ar_time, "ratio": self.ratio}[_COMM[name]]
        gauge.labels(role=role).set(value)
        return True

    def sample_memory(self) -> None:
        """Set the memory gauges now (CUDA allocator when a device was given; RSS always)."""
        if not self.enabled:
            return
        self.rss.set(rss_bytes())
        if self.device is not None:
            import torch

            if torch.cuda.is_available():
                label = str(self.device)
                self.mem_alloc.labels(device=label).set(torch.cuda.memory_allocated(self.device))
                self.mem_reserved.labels(device=label).set(torch.cuda.memory_reserved(self.device))

    def update(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Map one step's metrics onto the gauges (see module table) and sample memory.

        Non-numeric and non-finite values are skipped. A no-op on ranks other than 0.
        """
        if not self.enabled:
            return
        if step is not None:
            self.step.set(step)
        for key, raw in metrics.items():
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                continue
            v = float(raw)
            if not math.isfinite(v):
                continue
            if key == "timing_s/step":
                self.step_time.set(v)
            elif key.startswith("timing_s/"):
                self.phase_time.labels(phase=key.split("/", 1)[1]).set(v)
            elif key == "perf/throughput_tokens_per_s":
                self.tokens_per_s.set(v)
            elif key == "perf/throughput_tokens_per_s_per_gpu":
                self.tokens_per_s_gpu.set(v)
            elif key == "reward/mean":
                self.reward_mean.set(v)
            elif key.startswith("comm/") and self._comm(key, v):
                pass
            elif self.export_all:
                self.other.labels(name=key).set(v)
        self.sample_memory()

    def close(self) -> None:
        """Stop the HTTP server and free its port (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> PrometheusMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
