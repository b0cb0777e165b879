"""The sweep on each rank, and the launcher (torchrun, or N spawned processes).

Per collective, per method, per size: build the case, check it against the closed form
(``#wrong``), warm up, agree on the iteration count (per-size time budget), time each
iteration, take the max across ranks per iteration, and report mean/P50/P99 with algbw and
busbw from the P50 time (see :mod:`verl_comm.bench.timing` and :mod:`verl_comm.bench.sweep`).
Rank 0 prints the nccl-tests layout as it goes and returns the JSONL records.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import socket
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verl_comm.bench import env as benv
from verl_comm.bench import report
from verl_comm.bench.int8 import Int8AllReduce
from verl_comm.bench.ops import (
    METHODS,
    Unsupported,
    build_case,
    dtype_name,
    expected_output,
    parse_dtype,
    pattern,
)
from verl_comm.bench.sweep import (
    COLLECTIVES,
    bandwidths,
    element_count,
    iterations_for_budget,
    latency_stats,
    size_sweep,
)
from verl_comm.bench.timing import (
    agree_max,
    max_across_ranks,
    sum_across_ranks,
    sync_all,
    time_bare_all_reduce,
    time_iterations,
)
from verl_comm.distributed.launch import spawn


@dataclass
class BenchConfig:
    """Parameters of one benchmark invocation (the CLI's options).

    Attributes:
        backend: ``"nccl"`` (one GPU per rank) or ``"gloo"`` (CPU).
        nproc: processes to spawn when not under torchrun.
        minbytes, maxbytes, factor: the size sweep in bytes (``-b``, ``-e``, ``-f``).
        iters, warmup: timed and warm-up iterations per size (``-n``, ``-w``).
        check: 1 = closed-form check before timing (``#wrong``), 0 = skip (``N/A``).
        dtype: payload dtype name (``-d``).
        ops: collectives; methods: methods (all_reduce compares them).
        placements: any of ``"outplace"``, ``"inplace"``.
        transport: label written in records; None = derived from the environment.
        per_rank_env: variables set in each rank before init; ``{rank}`` is substituted
            (e.g. ``NCCL_HOSTID=host{rank}`` for fake multi-node).
        time_budget_s: per size and case, cap the timed iterations to fit this many seconds
            (at least ``min_iters``); None = always ``iters``.
        repeat: run the whole sweep this many times (stability; records carry ``repeat``).
        timeout_s: ``init_process_group`` timeout (every collective is bounded by it).
        launch_timeout_s: the spawning parent gives up (and kills the ranks) after this.
        command: the command line, for the preamble.
        jsonl: when set, rank 0 appends each record to this file as soon as it is
            measured (a run cut short keeps what it measured); the caller truncates it.
    """

    backend: str = "gloo"
    nproc: int = 2
    minbytes: int = 8
    maxbytes: int = 1 << 20
    factor: float = 2.0
    iters: int = 20
    warmup: int = 5
    check: int = 1
    dtype: str = "float32"
    ops: list[str] = field(default_factory=lambda: ["all_reduce"])
    methods: list[str] = field(default_factory=lambda: ["nccl_fp32"])
    placements: list[str] = field(default_factory=lambda: ["outplace", "inplace"])
    transport: str | None = None
    per_rank_env: dict[str, str] = field(default_factory=dict)
    time_budget_s: float | None = None
    min_iters: int = 5
    repeat: int = 1
    timeout_s: float = 300.0
    launch_timeout_s: float = 1800.0
    command: str = ""
    jsonl: str | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad field and the fix."""
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"--backend must be nccl or gloo, got {self.backend!r}")
        if self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        size_sweep(self.minbytes, self.maxbytes, self.factor)
        parse_dtype(self.dtype)
        for op in self.ops:
            if op not in COLLECTIVES:
                raise ValueError(f"--op: {op!r} is not one of {', '.join(COLLECTIVES)}")
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"--method: {m!r} is not one of {', '.join(METHODS)}")
        for p in self.placements:
            if p not in ("outplace", "inplace"):
                raise ValueError(f"placement must be outplace or inplace, got {p!r}")
        if not self.placements:
            raise ValueError("choose at least one of --inplace / --outplace")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(
                f"-n/--iters must be >= 1 and -w/--warmup >= 0 (got {self.iters}, {self.warmup})"
            )
        if self.check not in (0, 1):
            raise ValueError(f"-c/--check must be 0 or 1, got {self.check}")
        if self.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {self.repeat}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"--time-budget must be positive seconds, got {self.time_budget_s}")


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--backend nccl needs CUDA; use --backend gloo on a CPU machine")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"local rank {local_rank} has no GPU (only {torch.cuda.device_count()} visible); "
            "lower --nproc"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _preamble_info(cfg: BenchConfig, device: torch.device, world: int) -> tuple[dict, str]:
    per_rank = dist.get_rank()
    devs = [None] * world
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform_cpu()
    mine = f"Rank {per_rank:2d} Pid {os.getpid():7d} on {socket.gethostname():>12} device {device} [{name}]"
    dist.all_gather_object(devs, mine)
    if device.type == "cuda" and torch.cuda.device_count() >= 2 and world >= 2:
        topo = benv.gpu_link(0, 1)
    elif device.type == "cuda":
        topo = "single GPU"
    else:
        topo = "CPU processes, gloo over TCP loopback"
    transport = cfg.transport or benv.auto_transport(
        cfg.backend, os.environ, cfg.per_rank_env, topo
    )
    if device.type == "cuda":
        dev_str = f"{world} x {name}"
    else:
        dev_str = f"cpu x {world} processes"
    info = {
        "command": cfg.command,
        "versions": benv.versions(),
        "date": benv.now_iso(),
        "commit": benv.commit(),
        "dirty": benv.dirty(),
        "devices": devs,
        "device": dev_str,
        "topology": topo,
        "transport": transport,
        "backend": cfg.backend,
        "env": benv.effective_env(),
        "per_rank_env": cfg.per_rank_env,
        "params": {
            "nranks": world,
            "minBytes": cfg.minbytes,
            "maxBytes": cfg.maxbytes,
            "step": f"{cfg.factor:g}(factor)",
            "warmup": cfg.warmup,
            "iters": cfg.iters,
            "check": cfg.check,
            "dtype": cfg.dtype,
            "time_budget_s": cfg.time_budget_s,
            "repeat": cfg.repeat,
        },
    }
    return info, transport


def platform_cpu() -> str:
    """CPU model name (``platform.processor()`` or ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _measure(
    run, reset, cfg: BenchConfig, device: torch.device, bare_tensor: torch.Tensor | None = None
) -> tuple[dict, int]:
    """Warm up, agree on an iteration count, time; returns (stats in us, iterations)."""
    sync_all(device)
    if bare_tensor is not None:
        warm = time_bare_all_reduce(bare_tensor, max(cfg.warmup, 1), 0)
    else:
        warm = time_iterations(run, max(cfg.warmup, 1), device, reset)
    est = agree_max(statistics.median(warm), device)
    n = iterations_for_budget(cfg.iters, est, cfg.time_budget_s, cfg.min_iters)
    sync_all(device)
    if bare_tensor is not None:
        times = time_bare_all_reduce(bare_tensor, n, 0)
    else:
        times = time_iterations(run, n, device, reset)
    times = max_across_ranks(times, device)
    return latency_stats(times), n


def run_rank(cfg: BenchConfig) -> list[dict]:
    """Run the whole sweep on this rank (process group already initialised).

    Returns the JSONL records on rank 0 (an empty list on other ranks).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if cfg.backend == "nccl" else torch.device("cpu")
    dtype = parse_dtype(cfg.dtype)
    int8 = Int8AllReduce() if "int8" in cfg.methods else None
    info, transport = _preamble_info(cfg, device, world)
    lead = rank == 0

    def say(text: str) -> None:
        if lead:
            print(text, flush=True)

    say(report.preamble(info))
    common = {
        "benchmark": report.BENCHMARK,
        "device": info["device"],
        "versions": info["versions"],
        "date": info["date"],
        "commit": info["commit"],
        "dirty": info["dirty"],
        "transport": transport,
        "backend": cfg.backend,
        "world_size": world,
    }
    records: list[dict] = []
    failures: list[str] = []
    sizes = size_sweep(cfg.minbytes, cfg.maxbytes, cfg.factor)
    esize = torch.empty((), dtype=dtype).element_size()
    for rep in range(cfg.repeat):
        for op in cfg.ops:
            for method in cfg.methods:
                if method in ("int8", "bare") and op != "all_reduce":
                    say(f"# skip: method {method} applies to all_reduce only (not {op})")
                    continue
                if method == "int8" and (int8 is None or not int8.available):
                    say(f"# skip: method int8: {int8.reason if int8 else 'not requested'}")
                    continue
                if cfg.repeat > 1:
                    say(f"# repeat {rep + 1}/{cfg.repeat}")
                say(report.table_header(op, method, transport))
                table_recs: list[dict] = []
                try:
                    _sweep_method(
                        cfg,
                        op,
                        method,
                        sizes,
                        esize,
                        dtype,
                        device,
                        int8,
                        common,
                        rep,
                        table_recs,
                        say,
                    )
                except MethodFailed as exc:
                    say(f"# FAILED: {op} {method}: {exc}; skipping the rest of this method")
                    failures.append(f"{op} {method}: {exc}")
                say(report.table_footer(table_recs))
                records.extend(table_recs)
                if lead and cfg.jsonl:
                    report.write_jsonl(table_recs, cfg.jsonl, append=True)
    summary = report.stability_summary(records)
    if summary:
        say(report.stability_text(summary))
        if lead and cfg.jsonl:
            report.write_jsonl(summary, cfg.jsonl, append=True)
    if failures:
        raise RuntimeError(
            "methods failed (records measured before are kept): " + "; ".join(failures)
        )
    return records + summary if lead else []


def _sweep_method(
    cfg: BenchConfig,
    op: str,
    method: str,
    sizes: list[int],
    esize: int,
    dtype: torch.dtype,
    device: torch.device,
    int8: Int8AllReduce | None,
    common: dict,
    rep: int,
    table_recs: list[dict],
    say,
) -> None:
    """All sizes of one (collective, method): rows printed as measured, records appended
    to ``table_recs``. Raises :class:`MethodFailed` (on every rank) when a case fails."""
    world = dist.get_world_size()
    for nbytes in sizes:
        count = element_count(op, nbytes, esize, world)
        if count == 0:
            continue
        per_place: dict[str, dict | None] = {}
        for place in ("outplace", "inplace"):
            per_place[place] = None
            if place not in cfg.placements:
                continue
            rec = _one(cfg, op, method, place == "inplace", count, dtype, device, int8)
            if rec is None:
                continue
            rec = {**common, **rec, "repeat": rep, "requested_bytes": nbytes}
            per_place[place] = rec
            table_recs.append(rec)
        redop = "sum" if op in ("all_reduce", "reduce_scatter") else "none"
        root = 0 if op == "broadcast" else -1
        say(
            report.table_row(
                count * esize,
                count,
                dtype_name(dtype),
                redop,
                root,
                per_place["outplace"],
                per_place["inplace"],
            )
        )


class MethodFailed(RuntimeError):
    """A case raised on some rank; every rank raises this so the sweep moves on together."""


def _one(
    cfg: BenchConfig,
    op: str,
    method: str,
    inplace: bool,
    count: int,
    dtype: torch.dtype,
    device: torch.device,
    int8: Int8AllReduce | None,
) -> dict | None:
    """Check and time one case; None when the combination does not exist."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    bare_tensor = None
    reset = None
    if method == "bare":
        if not inplace:
            return None
        bare_tensor = torch.empty(count, dtype=dtype, device=device)
        wrong = None
        if cfg.check:
            bare_tensor.copy_(pattern(rank, 0, count, dtype, device))
            dist.all_reduce(bare_tensor)
            exp = expected_output("all_reduce", rank, world, count, dtype, device)
            wrong = sum_across_ranks(int((bare_tensor != exp).sum().item()), device)
        run = None
    else:
        try:
            case = build_case(op, method, inplace, count, dtype, device, None, int8)
        except Unsupported:
            return None
        err = None
        try:  # a failure in the first call (e.g. a kernel that does not compile) is
            case.fill()  # contained: all ranks agree and skip the rest of the method
            case.run()
            wrong_here = case.count_wrong() if cfg.check else 0
        except Exception as exc:  # noqa: BLE001 - reported below, on every rank
            err = f"{type(exc).__name__}: {exc}"
        if agree_max(1.0 if err else 0.0, device) > 0:
            raise MethodFailed(err or "failed on another rank")
        wrong = sum_across_ranks(wrong_here, device) if cfg.check else None
        run, reset = case.run, case.reset
    stats, n = _measure(run, reset, cfg, device, bare_tensor)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    algbw, busbw = bandwidths(op, nbytes, stats["time_us_p50"] * 1e-6, world)
    del bare_tensor
    return {
        "metric": "busbw",
        "value": busbw,
        "unit": "GB/s",
        "collective": op,
        "method": method,
        "inplace": inplace,
        "bytes": nbytes,
        "count": count,
        "dtype": dtype_name(dtype),
        **stats,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": wrong,
        "iters": n,
        "warmup": cfg.warmup,
    }


# ----------------------------------------------------------------------------- launching


def under_torchrun() -> bool:
    """True when the process was started by torchrun (RANK and WORLD_SIZE set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _apply_per_rank_env(cfg: BenchConfig, rank: int) -> None:
    for k, v in cfg.per_rank_env.items():
        os.environ[k] = v.replace("{rank}", str(rank))


def _init_and_run(
    cfg: BenchConfig, rank: int, world: int, local_rank: int, init_method: str
) -> list[dict]:
    _apply_per_rank_env(cfg, rank)
    device = _device(cfg.backend, local_rank)
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(
        cfg.backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=_dt.timedelta(seconds=cfg.timeout_s),
        **kwargs,
    )
    try:
        return run_rank(cfg)
    finally:
        gc.collect()
        dist.destroy_process_group()


def _spawn_rank(rank: int, world: int, cfg: BenchConfig) -> list[dict]:
    """One spawned rank (:func:`verl_comm.distributed.launch.spawn` sets the rank variables)."""
    return _init_and_run(cfg, rank, world, rank, "env://")


def launch(cfg: BenchConfig) -> list[dict]:
    """Run the benchmark: in this process under torchrun, else in ``cfg.nproc`` ranks started
    by :func:`verl_comm.distributed.launch.spawn`.

    Returns the records of rank 0 (an empty list on other torchrun ranks).

    Raises:
        RuntimeError: when a rank fails (with its traceback) or the launch times out.
    """
    cfg.validate()
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return _init_and_run(cfg, rank, world, local_rank, "env://")
    per_rank = spawn(
        _spawn_rank,
        cfg.nproc,
        (cfg,),
        backend=None,
        deadline_s=cfg.launch_timeout_s,
        name="benchmark",
    )
    return list(per_rank[0])
