"""Checks that a config file can fail, run once before any rank starts.

``verl-ppo train`` and the Python API call :func:`preflight` in the launching process; under
torchrun every rank calls it before it initialises the process group. Everything that only
needs the config, the world size and the model's own ``config.json`` is checked here, so a
mistake costs seconds, not a model load on every rank:

- batch shapes against the world size (:meth:`PPOConfig.derived`: rollout and mini-batch
  per rank, micro-batches, samples per prompt);
- the task name and ``data.task_kwargs`` (reasoning-gym builds the dataset config);
- the model folder (the packaged SmolLM2 is converted into its cache here, once) and, with
  the hybrid engine on, its heads, KV heads, intermediate size, vocabulary and layers
  against the training and rollout layouts (the same
  :func:`verl_ppo.reshard.engine.build_plan` checks the engine runs later);
- the fast-path switches (``rollout.use_cuda_graph``, ``train.sequence_packing``, ...) set
  explicitly where they cannot apply (no CUDA device, an unsupported model);
- the communication setup: ``comm.backend`` against this machine, gradient compression
  against each trained role's ZeRO stage (the hooks need stage 0 or 1,
  :mod:`verl_ppo.grad_comm`), ``reward.model``'s spec, and that ``comm.master_port`` and
  ``monitor.prometheus_port`` are free.

Every failure is a :class:`PreflightError` whose message names the field and the fix.
"""

from __future__ import annotations

from typing import Any

from verl_ppo.config import ConfigError, PPOConfig


class PreflightError(ValueError):
    """A configuration that cannot run; the message names the field and the fix."""


def model_config_of(cfg: PPOConfig) -> Any:
    """The HF config the run will build its policy from, without loading weights.

    ``model.tiny``: the config built from those fields (vocabulary from the tokenizer, as
    :func:`verl_ppo.models.build_policy` does); otherwise the folder's ``config.json``.

    Raises:
        verl_ppo.data.model_store.ModelStoreError: no usable model folder.
        ValueError: bad ``model.tiny`` fields.
    """
    from transformers import AutoConfig

    from verl_ppo.data.model_store import resolve_model_path

    if cfg.model.tiny is not None:
        from verl_ppo.models import _tiny_config, load_tokenizer

        return _tiny_config(cfg.model, load_tokenizer(cfg.model))
    return AutoConfig.from_pretrained(resolve_model_path(cfg.model.path))


def check_hybrid_engine(cfg: PPOConfig, world_size: int, model_config: Any) -> None:
    """Training and rollout layouts of ``actor.model_config.hybrid_engine`` against the
    world size and the model's dimensions (no-op when the hybrid engine is off).

    Raises:
        PreflightError: naming ``actor.model_config.hybrid_engine.<...>`` and the degrees
            the model allows.
    """
    he = cfg.actor.model_config_.hybrid_engine
    if not he.enable:
        return
    from verl_ppo.reshard.engine import build_plan

    ts = he.training_sharding.model_copy(update={"zero_stage": cfg.actor.zero_stage})
    he = he.model_copy(update={"training_sharding": ts})
    prefix = "actor.model_config.hybrid_engine."
    try:
        train, rollout = he.layouts(world_size)
        build_plan(model_config, train, rollout, world_size, choose_placement=False)
    except ValueError as exc:
        raise PreflightError(f"{prefix}{exc}") from None


def check_fast_path(cfg: PPOConfig, model_config: Any) -> None:
    """The ``auto``/explicit fast-path settings (:func:`verl_ppo.fast_path.resolve`) against
    this machine and the model, on a weightless (meta-device) copy of the policy.

    Raises:
        PreflightError: an explicit setting that cannot apply (e.g. ``rollout.use_cuda_graph:
            true`` without CUDA), naming the field and the fix.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from verl_ppo.fast_path import resolve

    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(model_config)
    try:
        resolve(cfg, torch.cuda.is_available(), policy)
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None


def check_comm(cfg: PPOConfig) -> None:
    """Backend, compression vs ZeRO stage, reward spec (no process group needed).

    Raises:
        PreflightError: naming the field and the fix.
    """
    from pathlib import Path

    from verl_ppo.distributed import resolve_backend
    from verl_ppo.grad_comm import SUPPORTED_STAGES
    from verl_ppo.reward.factory import SPECS

    try:
        resolve_backend(cfg.comm.backend)
    except RuntimeError as exc:
        raise PreflightError(str(exc)) from None
    method = cfg.compression.gradient_compression
    roles = ["actor"] + (["critic"] if cfg.algorithm.adv_estimator == "gae" else [])
    for role in roles:
        stage = getattr(cfg, role).zero_stage
        if method != "none" and stage not in SUPPORTED_STAGES:
            raise PreflightError(
                f"gradient_compression={method} needs {role}.zero_stage 0 or 1, got {stage}: "
                "ZeRO-2/3 reduce-scatter each gradient inside their own backward hooks, "
                f"leaving no full gradient to compress; set {role}.zero_stage=1, or "
                "gradient_compression=none"
            )
    spec = cfg.reward.model
    if not (
        spec in ("rule", "minilm")
        or spec.startswith(("http://", "https://"))
        or Path(spec).is_dir()
    ):
        raise PreflightError(f"reward.model={spec!r} is not a reward model: use {SPECS}")


def preflight(cfg: PPOConfig, world_size: int, check_port: bool = True) -> None:
    """Every check a config file can fail, for a run of ``world_size`` ranks.

    Args:
        cfg: the validated config.
        world_size: ranks of the run (``comm.nproc``, or torchrun's ``WORLD_SIZE``).
        check_port: also check that ``comm.master_port`` (when set) is free (the launcher
            only: under torchrun the rendezvous already owns it).

    Raises:
        PreflightError: with one message naming the field and the fix.
    """
    from verl_comm.distributed.launch import check_port_free
    from verl_ppo.data.model_store import ModelStoreError
    from verl_ppo.data.tasks import Task, TaskError

    try:
        cfg.derived(world_size)
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None
    try:  # reasoning-gym validates the task arguments; Task checks the held-out size
        Task(
            cfg.data.task,
            train_size=1,
            eval_size=cfg.data.eval_size,
            seed=cfg.seed,
            overrides=cfg.data.task_kwargs,
        )
    except TaskError as exc:
        raise PreflightError(str(exc)) from None
    try:
        model_config = model_config_of(cfg)
    except (ModelStoreError, ValueError, OSError) as exc:
        raise PreflightError(f"model: {exc}") from None
    check_hybrid_engine(cfg, world_size, model_config)
    check_fast_path(cfg, model_config)
    check_comm(cfg)
    ports = [
        ("comm.master_port", cfg.comm.master_port if check_port else None, "127.0.0.1"),
        ("monitor.prometheus_port", cfg.monitor.prometheus_port, cfg.monitor.prometheus_host),
    ]
    for key, port, host in ports:
        if port:
            try:
                check_port_free(port, host)
            except OSError as exc:
                raise PreflightError(str(exc).replace("comm.master_port", key)) from None
