"""Hybrid engine: the context manager that puts the actor into its rollout layout.

Modelled on verl's ``sharding_manager/base.py``: entering reshards the training weights
into the TP rollout model (and frees what generation does not need: gradients), leaving
drops the rollout shards, KV caches and buffers. Memory is logged at each boundary.
Rollout -> training moves nothing: the training shards are read, never written, and
leaving checks that (tensor version counters unchanged), so ``reshard/back_bytes`` is 0.

::

    hybrid = HybridEngine.build(hf_config, cfg.actor.model_config.hybrid_engine,
                                strategy.layout, ctx)
    with hybrid.rollout(strategy.hf_named_parameters()) as rollout_model:
        seqs = rollout_model.generate(input_ids, attention_mask, max_new_tokens=64, ...)
    logger.log(hybrid.last_metrics)   # timing_s/reshard, reshard/bytes_per_rank, memory/...
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.telemetry import CommRecorder, rss_bytes
from verl_ppo.reshard.config import HybridEngineConfig
from verl_ppo.reshard.engine import ReshardEngine
from verl_ppo.reshard.layout import ParallelLayout
from verl_ppo.rollout.tp_generate import TPRolloutModel
from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup

logger = logging.getLogger(__name__)


def _memory_gb(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "allocated_GB": torch.cuda.memory_allocated(device) / 1e9,
            "reserved_GB": torch.cuda.memory_reserved(device) / 1e9,
        }
    return {"rss_GB": rss_bytes() / 1e9}


def named_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by HF name; a DeepSpeed engine's ``module.`` prefix is dropped."""
    out = {}
    for name, p in module.named_parameters():
        while name.startswith("module."):  # DeepSpeed engine / DDP wrappers
            name = name[len("module.") :]
        out[name] = p
    return out


class HybridEngine:
    """Reshards a training module into a TP rollout model and back.

    Build with :meth:`build` on every rank (collective: creates the TP groups).

    Attributes:
        engine: the :class:`ReshardEngine` (plan, placement, executor).
        tp: this rank's rollout TP group.
        last_metrics: metrics of the last ``rollout()`` (namespaced, units in the key).
    """

    def __init__(
        self, model_config: Any, cfg: HybridEngineConfig, engine: ReshardEngine, tp: TPGroup
    ) -> None:
        self.model_config, self.cfg, self.engine, self.tp = model_config, cfg, engine, tp
        self.last_metrics: dict[str, float] = {}

    @classmethod
    def build(
        cls,
        model_config: Any,
        hybrid_cfg: HybridEngineConfig,
        train_layout: ParallelLayout,
        ctx: Any = None,
        world_group: dist.ProcessGroup | None = None,
        recorder: CommRecorder | None = None,
        rollout: ParallelLayout | None = None,
    ) -> HybridEngine:
        """Validate the layouts against the world and the model, plan, create TP groups.

        Args:
            model_config: HF config of the actor (Llama family or GPT-2).
            hybrid_cfg: ``actor.model_config.hybrid_engine`` (its rollout layout).
            train_layout: the layout the actor's training engine really runs
                (``strategy.layout``: PP x DP and the ZeRO stage of its DeepSpeed config).
            ctx: the job's :class:`verl_comm.distributed.DistContext`; every sub-group
                (rollout TP groups, the naive baseline's gather groups) is created with
                ``ctx.new_group`` and so gets ``comm.timeout_s``. Needed whenever a
                sub-group is needed.
            world_group: group of all ranks (None = WORLD).
            recorder: optional comm telemetry for the executor.
            rollout: the rollout layout, when the caller derived it already (the trainer:
                :func:`verl_ppo.job.fast_path.layouts`); None = from ``hybrid_cfg``.

        Raises:
            ValueError: a layout that does not fit, or a sub-group needed without ``ctx``
                (raised before any communication).
        """
        world = dist.get_world_size(world_group) if dist.is_initialized() else 1
        if rollout is None:
            _, rollout = hybrid_cfg.layouts(world, train_layout.zero_stage)
        engine = ReshardEngine(
            model_config,
            train_layout,
            rollout,
            group=world_group,
            bucket_bytes=int(hybrid_cfg.bucket_mb * (1 << 20)),
            method=hybrid_cfg.method,
            transport=hybrid_cfg.transport,
            recorder=recorder,
            alias=True,  # the rollout model only reads: share what coincides (norms, TP 1)
            ctx=ctx,
        )
        lay, rank = engine.rollout_layout, engine.rank

        def glob(r: int) -> int:
            return r if world_group is None else dist.get_global_rank(world_group, r)

        if lay.tp == 1:
            tp = TPGroup(None, 1, 0, [glob(rank)])
        elif lay.tp == world:
            tp = TPGroup(
                world_group, lay.tp, lay.coords(rank)[2], [glob(r) for r in lay.tp_group(rank)]
            )
        else:
            if ctx is None:
                raise ValueError(
                    f"rollout {lay.describe()} needs TP sub-groups: pass ctx (the DistContext)"
                )
            tp = None
            for members in lay.all_tp_groups():  # collective: every rank creates every group
                pg = ctx.new_group(sorted(glob(r) for r in members))
                if rank in members:
                    tp = TPGroup(pg, lay.tp, members.index(rank), [glob(r) for r in members])
        return cls(model_config, hybrid_cfg, engine, tp)

    def train_shards(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What this rank really holds in the training layout, checked against the plan.

        Args:
            params: the training engine's parameters by HF name
                (``strategy.hf_named_parameters()``): full tensors under DP, the stage's
                tensors under PP, or ZeRO-3 parameters whose ``ds_tensor`` is the partition.

        Raises:
            KeyError: a parameter the plan puts on this rank is not held.
            ValueError: a held tensor whose shape (or ZeRO-3 partition size) is not what the
                layout says this rank holds: the layout does not describe the engine.
        """
        plan, rank = self.engine.plan, self.engine.rank
        out = {}
        for _, spec, sh in plan.held(rank):
            if spec.name not in params:
                raise KeyError(
                    f"parameter {spec.name!r}: {plan.train.describe()} puts it on rank {rank}, "
                    "but the training engine does not hold it"
                )
            prm = params[spec.name]
            if (
                hasattr(prm, "ds_tensor")
                and prm.ds_tensor is not None
                and prm.ds_numel != prm.numel()
            ):
                part = prm.ds_tensor.data.view(-1)
                if plan.train.zero_stage != 3 or part.numel() != sh.numel:
                    raise ValueError(
                        f"{spec.name}: ZeRO-3 partition of {part.numel()} elements, but "
                        f"{plan.train.describe()} expects {sh.numel}"
                    )
                out[spec.name] = part
            elif tuple(prm.shape) == tuple(sh.local_shape) and prm.numel() == sh.numel:
                out[spec.name] = prm.data
            else:
                raise ValueError(
                    f"{spec.name}: the training engine holds shape {tuple(prm.shape)}, "
                    f"{plan.train.describe()} expects {sh.local_shape} on rank {rank}"
                )
        return out

    @contextmanager
    def rollout(self, params: Mapping[str, torch.Tensor]) -> Iterator[TPRolloutModel]:
        """Enter: reshard the training weights into the TP rollout model. Leave: free it.

        Args:
            params: what the training engine holds, by HF name (see :meth:`train_shards`).

        Yields:
            a :class:`TPRolloutModel` (``generate(...)``) holding only this rank's TP shard.

        Raises:
            RuntimeError: on leaving, if training weights were modified inside the block
                (the rollout -> training direction would then need traffic).
        """
        m: dict[str, float] = {}
        held = self.train_shards(params)
        params = list(params.values())
        device = params[0].device
        for k, v in _memory_gb(device).items():
            m[f"memory/enter_before_{k}"] = v
        if self.cfg.free_grads:
            for prm in params:
                prm.grad = None
        versions = [prm._version for prm in params]
        t0 = time.perf_counter()
        shards = self.engine.reshard(held)
        s = self.engine.last_stats
        model = TPRolloutModel(TPCausalLM(self.model_config, shards, self.tp))
        m["timing_s/reshard"] = time.perf_counter() - t0
        m["timing_s/reshard_wire_and_copy"] = s.time_s
        m["reshard/enter_s"] = m["timing_s/reshard"]  # kept in the step metrics (no timing_)
        m.update(_reshard_metrics(s, shards, params, self.tp.size))
        for k, v in _memory_gb(device).items():
            m[f"memory/enter_after_{k}"] = v
        logger.info(
            "hybrid engine enter: %s -> %s in %.3f s, %d B received (lower bound %d B), memory %s",
            self.engine.plan.train.describe(),
            self.engine.rollout_layout.describe(),
            m["timing_s/reshard"],
            s.bytes_received,
            s.lower_bound_bytes,
            {k: round(v, 3) for k, v in m.items() if k.startswith("memory/")},
        )
        failed = False
        try:
            yield model
        except BaseException:
            failed = True
            raise
        finally:
            t1 = time.perf_counter()
            for k, v in _memory_gb(device).items():
                m[f"memory/exit_before_{k}"] = v
            model.release()
            del model, shards, held
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            m["timing_s/reshard_exit"] = time.perf_counter() - t1
            m["reshard/back_bytes"] = 0.0
            for k, v in _memory_gb(device).items():
                m[f"memory/exit_after_{k}"] = v
            self.last_metrics = m
            logger.info(
                "hybrid engine exit: rollout freed in %.3f s, memory %s",
                m["timing_s/reshard_exit"],
                {k: round(v, 3) for k, v in m.items() if k.startswith("memory/exit")},
            )
            changed = [i for i, prm in enumerate(params) if prm._version != versions[i]]
            if changed and not failed:
                raise RuntimeError(
                    f"{len(changed)} training parameters were modified inside hybrid.rollout(); "
                    "the rollout model does not write back, so update weights outside the block"
                )


def _reshard_metrics(
    s: Any, shards: Mapping[str, torch.Tensor], params: list[torch.Tensor], tp_size: int
) -> dict[str, float]:
    """``reshard/*`` statistics of one entry (``s``: the executor's ``ReshardStats``) and
    the bytes of rollout tensors that do not alias training storage."""
    train_ptrs = {prm.data_ptr() for prm in params}
    extra = sum(
        t.numel() * t.element_size() for t in shards.values() if t.data_ptr() not in train_ptrs
    )
    return {
        "reshard/wire_and_copy_s": s.time_s,
        "reshard/bytes_per_rank": float(s.bytes_received),
        "reshard/bytes_sent_per_rank": float(s.bytes_sent),
        # the engine counts at its transport calls (None: not counted)
        **(
            {}
            if s.counted_received is None
            else {"reshard/bytes_counted_per_rank": float(s.counted_received)}
        ),
        "reshard/lower_bound_bytes": float(s.lower_bound_bytes),
        "reshard/bytes_over_lower_bound": (
            s.bytes_received / s.lower_bound_bytes
            if s.lower_bound_bytes
            else float(s.bytes_received == 0)
        ),
        "reshard/rollout_shard_bytes": float(s.rollout_bytes),
        "memory/rollout_extra_param_bytes": float(extra),
        "reshard/peak_extra_bytes": float(s.peak_extra_bytes),
        "reshard/buckets": float(s.buckets),
        "reshard/tensor_parallel_size": float(tp_size),
    }
