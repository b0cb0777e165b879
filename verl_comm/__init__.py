"""verl_comm: compressed gradient communication for torch.distributed.

Standalone: never imports verl_ppo, deepspeed or transformers. Parts:
``verl_comm.kernels`` (Triton int8 kernels + torch references),
``verl_comm.compression`` (pure algorithms), ``verl_comm.hooks`` (DDP comm hooks),
``verl_comm.reducer`` (the same hooks outside DDP), ``verl_comm.nccl``
(environment registry, linter, presets, topology), ``verl_comm.doctor``,
``verl_comm.profiler`` and ``verl_comm.bench``.
"""

__version__ = "0.1.0"
