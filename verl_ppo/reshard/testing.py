"""Helpers shared by the resharding tests and benchmark (like ``torch.testing``).

- :func:`spawn_workers`: run ``func(rank, world_size, *args)`` from a file in N spawned
  gloo/NCCL processes with a TCP rendezvous on a free port, a result queue and a
  timeout; any worker error is re-raised in the parent with its traceback. The
  function is named by file path and name, so it works under pytest's importlib mode.
- :func:`tiny_config`: small Llama / Qwen2 / GPT-2 configs.
- :func:`random_full_state`: seeded full weights from specs (every rank gets the same).
- :func:`train_shards_from_full`: what a rank holds in a layout, sliced from full weights.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_ppo.reshard.planner import ReshardPlan
from verl_ppo.reshard.specs import ParamSpec, slice_shard


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(f"_reshard_worker_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _entry(rank, world, port, path, name, args, q, backend, timeout_s):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        out = _load(path, name)(rank, world, *args)
        q.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_workers(
    path: str,
    name: str,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``name`` from file ``path`` as ``f(rank, world_size, *args)`` on ``world_size``
    spawned processes; return the per-rank results (picklable), rank order.

    Raises:
        RuntimeError: a worker raised (its traceback is in the message), or did not report
            within ``timeout_s`` seconds (then all workers are terminated).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry, args=(r, world_size, port, path, name, args, q, backend, timeout_s)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = q.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(f"{name}: workers did not report within {timeout_s} s") from None
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
                break
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 2)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise RuntimeError(f"{name} failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def tiny_config(kind: str = "llama", **overrides: Any):
    """A small HF config: ``"llama"`` (8 heads / 4 KV heads, untied), ``"qwen2"``
    (8 / 2, tied, q/k/v biases), ``"gpt2"`` (4 heads, tied); overrides win."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    if kind == "gpt2":
        kw = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        kw.update(overrides)
        return GPT2Config(**kw, bos_token_id=0, eos_token_id=1)
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4 if kind == "llama" else 2,
        tie_word_embeddings=kind != "llama",
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    kw.update(overrides)
    return (LlamaConfig if kind == "llama" else Qwen2Config)(**kw)


def random_full_state(
    specs: tuple[ParamSpec, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Seeded random full weights, N(0, 0.02^2) (norm weights near 1), identical on every rank."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for s in specs:
        t = torch.randn(s.shape, generator=g) * 0.02
        if s.split == "replicated" and len(s.shape) == 1 and "norm" in s.name or ".ln_" in s.name:
            t = t + 1.0
        out[s.name] = t.to(device=device, dtype=dtype)
    return out


def train_shards_from_full(
    plan: ReshardPlan, rank: int, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What ``rank`` holds in ``plan.train``, sliced from full weights (copies)."""
    out = {}
    for p, spec in enumerate(plan.specs):
        sh = plan.train_shards[rank][p]
        if sh is not None:
            out[spec.name] = slice_shard(full[spec.name], sh)
    return out


def expected_rollout(
    plan: ReshardPlan, rank: int, full: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``rank``'s rollout shards sliced directly from full weights (the reference)."""
    out = {}
    for p, spec in enumerate(plan.specs):
        sh = plan.rollout_shards[rank][p]
        if sh is not None:
            out[spec.name] = slice_shard(full[spec.name], sh)
    return out
