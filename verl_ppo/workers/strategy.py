"""DeepSpeed behind one object, built from a pure ``ds_config(...) -> dict``.

Model: OpenRLHF's ``deepspeed_utils.py`` / ``deepspeed.py``. The optimizer is a torch AdamW
passed in as DeepSpeed's client optimizer (fused on CUDA); on CPU DeepSpeed's own
``"Adam"`` would JIT-compile a CPU FusedAdam first (~41 s), which we avoid.

Optimizer offload (ZeRO 1-3): DeepSpeed refuses a client optimizer other than its
``DeepSpeedCPUAdam`` with offload unless the config sets ``zero_force_ds_cpu_optimizer:
false`` (deepspeed 0.19 ``runtime/engine.py``, ``_configure_optimizer``). We set it and
keep torch's AdamW: ZeRO then steps it on the fp32 CPU partitions, with torch's fused CPU
kernel. ``DeepSpeedCPUAdam`` would need its C++ op JIT-compiled on every new host (~44 s
here, and a compiler toolchain on the GPU hosts).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.compression.config import CompressionConfig
from verl_comm.telemetry import CommRecorder
from verl_ppo.workers.grad_comm import GradCommHandle, attach_grad_comm

log = logging.getLogger(__name__)


def ds_config(
    *,
    zero_stage: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    world_size: int,
    bf16: bool,
    grad_clip: float,
    offload_optimizer: bool = False,
    communication_data_type: str | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict for one engine (pure function, no side effects).

    Args:
        zero_stage: 0-3.
        micro_batch_size: sequences per forward/backward on one rank.
        grad_accum_steps: micro-batches per optimizer step on one rank.
        world_size: data-parallel ranks (DeepSpeed checks
            ``train_batch_size == micro * accum * world``).
        bf16: bf16 mixed precision (GPU); False = fp32 (CPU: DeepSpeed refuses fp16 there).
        grad_clip: gradient norm clip; 0 disables it.
        offload_optimizer: ZeRO optimizer-state offload to CPU (needs zero_stage >= 1).

    Raises:
        ValueError: offload without ZeRO or an out-of-range stage.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0-3, got {zero_stage}")
    if offload_optimizer and zero_stage == 0:
        raise ValueError("offload_optimizer needs zero_stage >= 1 (DeepSpeed offloads ZeRO state)")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage >= 1:
        zero.update({"overlap_comm": False, "contiguous_gradients": True})
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)},
        "gradient_clipping": float(grad_clip),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if offload_optimizer:  # a torch AdamW with offload: see the module docstring
        cfg["zero_force_ds_cpu_optimizer"] = False
    if communication_data_type:
        cfg["communication_data_type"] = communication_data_type
    return cfg


def data_parallel_layout(engine: Any) -> Any:
    """The :class:`~verl_ppo.reshard.layout.ParallelLayout` a (non-pipeline) DeepSpeed engine
    runs: DP over its data-parallel world, TP 1, its ZeRO stage."""
    from verl_ppo.reshard.layout import ParallelLayout

    return ParallelLayout(1, int(engine.dp_world_size), 1, int(engine.zero_optimization_stage()))


class DeepSpeedStrategy:
    """Owns one DeepSpeed engine and its gradient communication: init, backward, step,
    save/load.

    Args:
        config: the dict from :func:`ds_config`.
        lr, weight_decay, betas: AdamW hyper-parameters.
        compression: gradient compression of this engine; ``gradient_compression: none``
            (or None) keeps DeepSpeed's own reduction.
        group: the data-parallel process group the gradients are averaged over.
        timeout_s: deadline in seconds of one gradient reduction (``comm.timeout_s``).
        recorder: optional telemetry sink of the hook and the reducer.
        fused: torch's fused AdamW (None = on CUDA; resolved ``optim.fused``).
    """

    def __init__(
        self,
        config: dict[str, Any],
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        *,
        compression: CompressionConfig | None = None,
        group: dist.ProcessGroup | None = None,
        timeout_s: float,
        recorder: CommRecorder | None = None,
        fused: bool | None = None,
    ) -> None:
        self.config = config
        self.fused = fused
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = betas
        self.compression = compression or CompressionConfig()
        self.group = group
        self.timeout_s = timeout_s
        self.recorder = recorder
        self.engine: Any = None
        self.grad_comm: GradCommHandle | None = None

    def init(self, model: torch.nn.Module) -> Any:
        """Wrap ``model`` in a DeepSpeed engine and attach the gradient communication
        (collective: every rank must call it).

        Raises:
            ValueError: compression with an unsupported engine setup (see
                :func:`verl_ppo.workers.grad_comm.attach_grad_comm`).
        """
        import deepspeed  # on first use: its import takes seconds and probes accelerators

        params = [p for p in model.parameters() if p.requires_grad]
        offload = bool(self.config.get("zero_optimization", {}).get("offload_optimizer"))
        opt = torch.optim.AdamW(
            params,
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=self.betas,
            # fused on CUDA (resolved ``optim.fused``), and on the CPU partitions ZeRO-Offload
            # steps (torch >= 2.4 fuses on CPU)
            fused=(torch.cuda.is_available() if self.fused is None else self.fused) or offload,
        )
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=self.config)
        self.engine = engine
        self.grad_comm = attach_grad_comm(
            engine, self.compression, self.group, self.recorder, timeout_s=self.timeout_s
        )
        return engine

    def describe(self) -> str:
        """One line for the start-up log, e.g. ``ZeRO stage 2, AdamW, optimizer state
        offloaded to CPU``, read back from the engine (what DeepSpeed really built)."""
        e = self.engine
        opt = type(getattr(e, "basic_optimizer", None) or e.optimizer).__name__
        where = "offloaded to CPU" if e.zero_cpu_offload() else "on the model's device"
        return f"ZeRO stage {e.zero_optimization_stage()}, {opt}, optimizer state {where}"

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model."""
        return self.engine.module

    @property
    def layout(self) -> Any:
        """The training layout this engine runs: :func:`data_parallel_layout`."""
        return data_parallel_layout(self.engine)

    def hf_named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by HF name (full tensors; ZeRO-3: ``ds_tensor`` partitions inside)."""
        from verl_ppo.reshard.hybrid import named_parameters

        return named_parameters(self.engine)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss already scaled for accumulation (no extra 1/GAS), then
        verl_comm's reduction of this micro-step when compression is on (it waits for the
        buckets, at most ``timeout_s``).

        Raises:
            TimeoutError: a bucket did not complete within ``timeout_s``.
        """
        self.engine.backward(loss, scale_wrt_gas=False)
        if self.grad_comm is not None:
            self.grad_comm.after_backward()

    def step(self) -> None:
        """Optimizer step at the accumulation boundary (DeepSpeed counts micro-steps)."""
        self.engine.step()

    def save(self, directory: str, tag: str, client_state: dict | None = None) -> None:
        """DeepSpeed checkpoint of model + optimizer under ``directory/tag`` (collective)."""
        self.engine.save_checkpoint(directory, tag=tag, client_state=client_state or {})

    def load(self, directory: str, tag: str) -> dict:
        """Load a checkpoint written by :meth:`save`; returns the client state.

        Raises:
            RuntimeError: nothing could be loaded from ``directory/tag``.
        """
        path, client = self.engine.load_checkpoint(directory, tag=tag)
        if path is None:
            raise RuntimeError(f"no DeepSpeed checkpoint found at {directory}/{tag}")
        return client or {}
