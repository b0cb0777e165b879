"""DeepSpeed's pipeline engine behind one object: a stage of a PP x DP layout.

``PipelineStrategy`` builds a ``deepspeed.pipe.PipelineModule`` from the HF model's parts
(:mod:`verl_ppo.pipeline.layers`), wraps it with ``deepspeed.initialize`` (which returns a
``PipelineEngine``) and exposes what the trainer and the reshard engine need:
``train_batch`` / ``eval_batch`` over a list of micro-batches, the stage's parameters under
their HF names, the layout really run (:attr:`layout`), checkpoints, and the full state
dict gathered from the stages (:meth:`full_state_dict`, for export).

Each rank builds only its stage's layers. DeepSpeed's pipeline engine runs ZeRO stage 0
or 1 (``PipelineEngine.__init__`` asserts stage < 2, DeepSpeed 0.19.8), so weights and
gradients are the stage's; at ZeRO-1 the optimizer state is further partitioned over the
stage's data-parallel group.

Two things DeepSpeed does not let us pass in, handled here and said why:

* Process groups: ``PipelineModule`` / ``PipelineParallelGrid`` / ``p2p`` create their groups
  with ``deepspeed.comm.new_group(ranks)``, which calls ``torch.distributed.new_group``
  without a timeout (``deepspeed/comm/torch.py``), so torch gives them its default
  (30 min gloo, 10 min NCCL; ``torch/distributed/distributed_c10d.py:_get_default_timeout``).
  :func:`group_timeout` sets torch's defaults to ``comm.timeout_s`` while the engine is
  built and restores them after; every group DeepSpeed creates then has the job's timeout
  (checked in tests/verl_ppo/test_pipeline.py).
* Gradient clipping at ZeRO-0 in fp32: DeepSpeed's ``runtime/utils.py:clip_grad_norm_``
  counts a gradient only on model-parallel rank 0 (the pipeline's first stage) unless the
  parameter is marked ``model_parallel``, so the other stages' gradients would be left out
  of the global norm. Every parameter a stage owns is marked ``model_parallel = True``
  (the tied copy on the last stage, ``ds_pipe_replicated``, is not: it is counted once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_ppo.job.model_family import LLAMA_NAMES
from verl_ppo.reshard.layout import ParallelLayout

log = logging.getLogger(__name__)


@contextlib.contextmanager
def group_timeout(timeout_s: float) -> Iterator[None]:
    """Within the block, ``torch.distributed.new_group`` calls without a timeout get
    ``timeout_s`` seconds (see the module docstring for why)."""
    from torch.distributed import distributed_c10d as c10d

    old = (c10d.default_pg_timeout, getattr(c10d, "default_pg_nccl_timeout", None))
    t = timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = t
    if old[1] is not None:
        c10d.default_pg_nccl_timeout = t
    try:
        yield
    finally:
        c10d.default_pg_timeout = old[0]
        if old[1] is not None:
            c10d.default_pg_nccl_timeout = old[1]


class PipelineStrategy:
    """Owns one DeepSpeed ``PipelineEngine`` (one role: actor, critic or reference).

    Args:
        config: DeepSpeed config dict from :func:`verl_ppo.workers.strategy.ds_config` with
            ``world_size`` = the data-parallel size (world / PP).
        pp: pipeline stages.
        timeout_s: timeout of every group the engine creates (``comm.timeout_s``).
        lr, weight_decay, betas: AdamW hyper-parameters; ``lr=None`` builds a frozen engine
            (no optimizer: the reference policy).
        fused: torch's fused AdamW (None = on CUDA; the trainer passes the resolved
            ``optim.fused``).
    """

    def __init__(
        self,
        config: dict[str, Any],
        pp: int,
        timeout_s: float,
        lr: float | None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        fused: bool | None = None,
    ) -> None:
        self.config, self.pp, self.timeout_s = config, pp, timeout_s
        self.lr, self.weight_decay, self.betas = lr, weight_decay, betas
        self.fused = torch.cuda.is_available() if fused is None else fused
        self.engine: Any = None
        self.base = LLAMA_NAMES.base
        self.grad_comm = None  # DeepSpeed reduces (compression is refused with PP)

    def init(self, hf_config: Any, source: Any, role: str, loss_fn: Any) -> Any:
        """Build this rank's stage and its engine (collective over every rank).

        Args:
            hf_config: the policy's HF config.
            source: :class:`~verl_ppo.pipeline.weights.WeightSource`.
            role: ``"policy"`` or ``"value"`` (see :func:`~verl_ppo.pipeline.layers.layer_specs`).
            loss_fn: called by the last stage as ``loss_fn(outputs, labels)``.

        Raises:
            RuntimeError: DeepSpeed partitioned the layers differently from the layout the
                reshard planner assumes.
        """
        import deepspeed
        from deepspeed.pipe import PipelineModule

        from verl_ppo.pipeline.layers import layer_specs, stage_parts

        self.base = LLAMA_NAMES.base if role == "policy" else "backbone."
        specs = layer_specs(hf_config, source, role)
        with group_timeout(self.timeout_s):
            deepspeed.init_distributed()  # wraps the existing process group (deepspeed.comm)
            module = PipelineModule(
                layers=specs,
                num_stages=self.pp,
                loss_fn=loss_fn,
                partition_method="type:DecoderPipe",
                dynamic_shape=True,  # sequence lengths change every step
            )
            want = stage_parts(hf_config.num_hidden_layers, self.pp)
            if [int(x) for x in module.parts] != want:
                raise RuntimeError(
                    f"DeepSpeed partitioned the pipeline as {list(module.parts)}, the reshard "
                    f"layout expects {want}"
                )
            for p in module.parameters():  # see the module docstring (gradient clipping)
                if not getattr(p, "ds_pipe_replicated", False):
                    p.model_parallel = True
            opt = None
            if self.lr is not None:
                opt = torch.optim.AdamW(
                    [p for p in module.parameters() if p.requires_grad],
                    lr=self.lr,
                    weight_decay=self.weight_decay,
                    betas=self.betas,
                    fused=self.fused,
                )
            else:
                for p in module.parameters():
                    p.requires_grad_(False)
            engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=self.config)
        self.engine = engine
        return engine

    def describe(self) -> str:
        """One line: stage, layout and ZeRO stage."""
        return (
            f"DeepSpeed PipelineEngine, stage {self.stage} of {self.pp}, "
            f"{self.layout.describe()}, ZeRO-{self.engine.zero_optimization_stage()}"
        )

    # ---------------------------------------------------------------- topology
    @property
    def module(self) -> torch.nn.Module:
        """This rank's ``PipelineModule`` (its stage's layers only)."""
        return self.engine.module

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return int(self.engine.stage_id)

    @property
    def is_last_stage(self) -> bool:
        """True on the stage that computes the loss."""
        return bool(self.engine.is_last_stage())

    @property
    def pipe_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's pipeline (one per stage, same data-parallel index)."""
        return self.engine.grid.get_pipe_parallel_group()

    @property
    def pipe_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline, by stage."""
        return list(self.engine.grid.pp_group)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks holding the same stage (gradients are averaged over them)."""
        return self.engine.grid.get_data_parallel_group()

    @property
    def dp_size(self) -> int:
        """Data-parallel degree."""
        return int(self.engine.grid.data_parallel_size)

    @property
    def layout(self) -> ParallelLayout:
        """The training layout this engine really runs (PP x DP, ZeRO stage)."""
        return ParallelLayout(self.pp, self.dp_size, 1, int(self.engine.zero_optimization_stage()))

    # ------------------------------------------------------------------ weights
    def hf_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters by HF name (a tied embedding appears on the first and
        last stage under ``model.embed_tokens.weight``)."""
        from verl_ppo.pipeline.layers import hf_name

        layers = {int(k): v for k, v in self.module.named_children() if k.isdigit()}
        return {hf_name(n, layers, self.base): p for n, p in self.module.named_parameters()}

    def param_bytes(self) -> int:
        """Bytes of the parameters this rank holds (each tensor once)."""
        seen, total = set(), 0
        for p in self.module.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full model's state dict (HF names, CPU tensors) gathered from the stages onto
        the first rank of each pipeline; None on the other ranks (collective over the
        pipeline group). Use it for export; training never needs the full model."""
        mine = {n: p.detach().cpu() for n, p in self.hf_named_parameters().items()}
        ranks = self.pipe_ranks
        out: list[Any] = [None] * len(ranks)
        dst = ranks[0]
        dist.gather_object(
            mine, out if dist.get_rank() == dst else None, dst=dst, group=self.pipe_group
        )
        if dist.get_rank() != dst:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in out:
            full.update(part)
        return full

    # ------------------------------------------------------------------ batches
    def train_batch(self, micro_batches: list[tuple[Any, Any]]) -> None:
        """One optimizer step over ``micro_batches`` (``(inputs, labels)`` each, as many as
        the engine's gradient accumulation steps); DeepSpeed runs its 1F1B schedule, reduces
        the tied and data-parallel gradients and steps."""
        n = self.engine.gradient_accumulation_steps()
        if len(micro_batches) != n:
            raise ValueError(f"{len(micro_batches)} micro-batches, the engine expects {n}")
        self.engine.train_batch(data_iter=iter(micro_batches))

    @torch.no_grad()
    def eval_batch(self, micro_batches: list[tuple[Any, Any]]) -> list[torch.Tensor] | None:
        """Forward only; returns on the last stage the ``loss_fn`` output of every
        micro-batch (in order), None on the other stages."""
        # eval_batch adds each micro-batch's output into engine.total_loss, which only
        # train_batch resets (DeepSpeed 0.19.8 pipe/engine.py): a scalar left by the last
        # train_batch cannot take our (B, R) outputs, so start from None as train_batch does
        self.engine.total_loss = None
        out = self.engine.eval_batch(
            iter(micro_batches),
            compute_loss=True,
            reduce_output=None,
            bcast_loss=False,
            num_micro_batches=len(micro_batches),
        )
        return list(out) if self.is_last_stage else None

    def broadcast_from_last(self, t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        """``t`` from the last stage to every stage of this pipeline (float32 ``shape``)."""
        src = self.pipe_ranks[-1]
        buf = (
            t.float().contiguous()
            if self.is_last_stage
            else torch.empty(shape, dtype=torch.float32)
        )
        if self.pp > 1:
            dist.broadcast(buf, src=src, group=self.pipe_group)
        return buf

    # -------------------------------------------------------------- checkpoints
    def save(self, directory: str, tag: str, client_state: dict | None = None) -> None:
        """DeepSpeed pipeline checkpoint (per-layer weights, per-rank optimizer state)."""
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state or {})

    def load(self, directory: str, tag: str) -> dict:
        """Load what :meth:`save` wrote; returns the client state.

        Raises:
            RuntimeError: nothing could be loaded from ``directory/tag``.
        """
        path, client = self.engine.load_checkpoint(
            directory, tag=tag, load_optimizer_states=self.lr is not None
        )
        if path is None:
            raise RuntimeError(f"no DeepSpeed checkpoint found at {directory}/{tag}")
        return client or {}
