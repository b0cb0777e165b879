"""verl_comm: compressed gradient communication for torch.distributed.

Standalone: never imports verl_ppo, deepspeed or transformers.

Runtime (what a training job imports; never imports a tool):
``verl_comm.kernels`` (Triton int8 kernels + torch references),
``verl_comm.compression`` (pure algorithms), ``verl_comm.hooks`` (DDP comm hooks),
``verl_comm.reducer`` (the same hooks outside DDP), ``verl_comm.distributed`` (context with
deadlines, errors, checks, and the rank launcher), ``verl_comm.nccl`` (environment registry,
linter, presets, topology), ``verl_comm.telemetry`` and ``verl_comm.extras``.

Tools (import the runtime, never the other way round): ``verl_comm.bench`` (collective
benchmarks, NCCL preset autotune), ``verl_comm.profiler``, ``verl_comm.doctor`` and
``verl_comm.cli`` (the ``verl-comm`` command). ``tests/verl_comm/test_layering.py`` checks
the rule.
"""

__version__ = "0.1.0"
