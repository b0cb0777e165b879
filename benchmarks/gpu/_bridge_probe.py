"""The bridge's line rate, measured once per async launch of ``benchmarks/gpu/async_overlap.py``.

:func:`probing_join` wraps :func:`verl_ppo.asyncrl.world.join_world` (the name the trainer
and the rollout rank call) so that, right after the async world is joined and before any
weights or experiences cross it, training rank 0 and the rollout rank serving it
(:meth:`~verl_ppo.asyncrl.world.AsyncWorld.server_of`) time :func:`probe_link`: round trips
of one ``nbytes`` buffer sent with ``send``/``recv`` on the ``experience`` bridge group (the
same transport and the same point-to-point calls as the weight sync: NCCL between two GPUs,
or gloo in host memory), answered by a 1-byte acknowledgement. The buffer lives where the
sync's tensors cross (:attr:`~verl_ppo.asyncrl.world.AsyncWorld.wire_device`: the GPU with an
NCCL bridge, host memory with gloo, so the host staging of a shared GPU is not in it).
Bandwidth = ``nbytes`` / the fastest of ``reps`` timed round trips (after ``warmup`` untimed
ones, which also build NCCL's pair communicator), measured on the sender's clock; the
acknowledgement's latency counts against the link, so the rate is a slight underestimate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_link(world: Any, nbytes: int, reps: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Round trips of ``nbytes`` from training rank 0 to its rollout rank (module docstring).

    Collective over those two bridge ranks (the others return at once). Returns, on the
    sender, ``{"bytes", "reps", "best_s", "median_s", "bytes_per_s", "transport",
    "wire_device", "method"}``; on the receiver and other ranks ``{}``.
    """
    src, dst = 0, world.server_of(0)
    if world.rank not in (src, dst) or nbytes <= 0:
        return {}
    dev, g = world.wire_device, world.experience
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.uint8, device=dev)
    times = []
    for i in range(warmup + reps):
        _sync(dev)
        t0 = time.perf_counter()
        if world.rank == src:
            g.send([buf], dst, 0).wait()
            g.recv([ack], dst, 0).wait()
        else:
            g.recv([buf], src, 0).wait()
            g.send([ack], src, 0).wait()
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del buf, ack
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's memory-based auto settings see it free
    if world.rank != src:
        return {}
    best = min(times)
    return {
        "bytes": nbytes,
        "reps": reps,
        "best_s": best,
        "median_s": statistics.median(times),
        "bytes_per_s": nbytes / best,
        "transport": world.bridge,
        "wire_device": dev.type,
        "method": f"send/recv round trip, bridge rank {src} -> {dst}, 1-byte ack, fastest "
        f"of {reps}",
    }


@contextmanager
def probing_join(nbytes: int, reps: int = 5) -> Iterator[dict[str, Any]]:
    """Within the block, every ``join_world`` (trainer and rollout rank) runs
    :func:`probe_link` on the world it joined; the yielded dict gets the sender's result."""
    import verl_ppo.asyncrl.world as world_mod
    import verl_ppo.trainer as trainer_mod

    out: dict[str, Any] = {}
    orig = world_mod.join_world

    def join(cfg: Any, env: dict[str, str] | None = None) -> Any:
        world = orig(cfg, env)
        out.update(probe_link(world, nbytes, reps))
        return world

    world_mod.join_world = trainer_mod.join_world = join
    try:
        yield out
    finally:
        world_mod.join_world = trainer_mod.join_world = orig
