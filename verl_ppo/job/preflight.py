"""Checks that a config file can fail, run once before any rank starts.

``verl-ppo train`` and the Python API call :func:`preflight` in the launching process; under
torchrun every rank calls it before it initialises the process group. Everything that only
needs the config, the world size and the model's own ``config.json`` is checked here, so a
mistake costs seconds, not a model load on every rank:

- batch shapes against the world size (:meth:`PPOConfig.derived`: rollout and mini-batch
  per rank, micro-batches, samples per prompt);
- the task name and ``data.task_kwargs`` (reasoning-gym builds the dataset config), or the
  verl-format ``data.train_files`` / ``data.val_files``: every row's columns and types, and
  the lengths of the prompts the job will draw against ``data.max_prompt_length``
  (:func:`check_data`); ``reward.custom_reward_function`` loads and takes verl's arguments;
- the model folder (the packaged SmolLM2 is converted into its cache here, once) and, with
  the hybrid engine on, its heads, KV heads, intermediate size, vocabulary and layers
  against the training and rollout layouts (the same
  :func:`verl_ppo.reshard.engine.build_plan` checks the engine runs later);
- the rule tables of :mod:`verl_ppo.job.rules` (the same that every built config passed), now
  with this machine and the model known: the fast-path switches (``rollout.use_cuda_graph``,
  ``train.sequence_packing``, ...) set explicitly where they cannot apply (no CUDA device,
  an unsupported model), through :func:`verl_ppo.job.fast_path.resolve`, the trainer's resolver;
- the communication setup: ``comm.backend`` against this machine, ``reward.model``'s spec,
  and that ``comm.master_port`` and ``monitor.prometheus_port`` are free;
- on the CPU, no stale build lock of DeepSpeed's shared-memory op (:func:`check_build_lock`:
  a compile killed half-way leaves one, and every later start would wait on it for ever).

Every failure is a :class:`PreflightError` whose message names the field and the fix.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ppo.config import PPOConfig
from verl_ppo.errors import ConfigError
from verl_ppo.job.fast_path import ModelFacts, layouts, model_config_of, resolve, resolve_stages


class PreflightError(ValueError):
    """A configuration that cannot run; the message names the field and the fix."""


def check_hybrid_engine(cfg: PPOConfig, world_size: int, model_config: Any) -> None:
    """Training and rollout layouts of ``actor.model_config.hybrid_engine`` against the
    world size and the model's dimensions (no-op when the hybrid engine is off): the
    layouts of :func:`verl_ppo.job.fast_path.layouts`, checked by the same
    :func:`verl_ppo.reshard.engine.build_plan` the engine runs later.

    Raises:
        PreflightError: naming ``actor.model_config.hybrid_engine.<...>`` and the degrees
            the model allows.
    """
    from verl_ppo.reshard.engine import build_plan

    stage, _, _ = resolve_stages(cfg, torch.cuda.is_available())
    prefix = "actor.model_config.hybrid_engine."
    try:
        found = layouts(cfg, world_size, stage)
        if found is not None:
            build_plan(model_config, *found, world_size, choose_placement=False)
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None
    except ValueError as exc:
        raise PreflightError(f"{prefix}{exc}") from None


def check_async_sync(cfg: PPOConfig, model_config: Any) -> None:
    """``rollout.mode: async``: the cross-group weight sync plan the ranks will build
    (:func:`verl_ppo.asyncrl.weights.sync_plan`) against the model (no-op when colocated).

    Raises:
        PreflightError: a model or layout the plan cannot serve (e.g. a rollout TP degree
            that does not divide the heads).
    """
    if cfg.rollout.mode != "async":
        return
    from verl_ppo.asyncrl.weights import sync_plan

    stage, _, _ = resolve_stages(cfg, torch.cuda.is_available())
    try:
        sync_plan(cfg, model_config, stage)
    except ValueError as exc:
        raise PreflightError(f"rollout.mode=async: {exc}") from None


def check_fast_path(cfg: PPOConfig, model_config: Any) -> None:
    """The rules and every ``auto`` (:func:`verl_ppo.job.fast_path.resolve`) against this
    machine and the model, on a weightless (meta-device) copy of the policy.

    Raises:
        PreflightError: a broken rule or an explicit setting that cannot apply (e.g.
            ``rollout.use_cuda_graph: true`` without CUDA), naming the field and the fix.
    """
    try:
        resolve(cfg, torch.cuda.is_available(), ModelFacts.of_config(model_config))
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None


def check_comm(cfg: PPOConfig) -> None:
    """Backend against this machine and the reward spec (no process group needed).

    Raises:
        PreflightError: naming the field and the fix.
    """
    from pathlib import Path

    from verl_ppo.reward.factory import SPECS
    from verl_ppo.workers.distributed import resolve_backend

    try:
        resolve_backend(cfg.comm.backend)
    except RuntimeError as exc:
        raise PreflightError(str(exc)) from None
    spec = cfg.reward.model
    if not (
        spec in ("rule", "minilm")
        or spec.startswith(("http://", "https://"))
        or Path(spec).is_dir()
    ):
        raise PreflightError(f"reward.model={spec!r} is not a reward model: use {SPECS}")


def check_data(cfg: PPOConfig) -> None:
    """The prompt source: the built-in task's arguments and eval size, or the verl-format
    files (:func:`verl_ppo.data.file_source.build_prompt_source`, the trainer's own builder,
    with the policy's tokenizer); with the rule reward, each file's ``data_source`` values
    must be reasoning-gym datasets.

    Raises:
        PreflightError: naming the file, row and column, or the task key, and the fix.
    """
    from verl_ppo.data.file_source import build_prompt_source
    from verl_ppo.data.tasks import Task, TaskError
    from verl_ppo.data.verl_format import DataFormatError

    d = cfg.data
    if not d.train_files:
        try:  # reasoning-gym validates the task arguments; Task checks the held-out size
            Task(d.task, train_size=1, eval_size=d.eval_size, seed=cfg.seed,
                 overrides=d.task_kwargs)  # fmt: skip
        except TaskError as exc:
            raise PreflightError(str(exc)) from None
        return
    from verl_ppo.workers.models import load_tokenizer

    try:
        source = build_prompt_source(cfg, load_tokenizer(cfg.model))
    except DataFormatError as exc:
        raise PreflightError(f"data: {exc}") from None
    if cfg.reward.custom_reward_function.path is None and cfg.reward.model == "rule":
        _check_rule_sources(source.train_files + source.val_files)


def _check_rule_sources(files: list) -> None:
    """Every ``data_source`` of ``files`` names a reasoning-gym dataset (the rule reward)."""
    import reasoning_gym

    for f in files:
        for name in sorted(set(f.column("data_source"))):
            try:
                reasoning_gym.get_score_answer_fn(name)
            except ValueError:
                raise PreflightError(
                    f"data: {f.path!r} has data_source={name!r}, which the rule reward cannot "
                    "score (not a reasoning-gym dataset): set reward.custom_reward_function.path "
                    "to your compute_score, or reward.model"
                ) from None


def check_reward(cfg: PPOConfig) -> None:
    """``reward.custom_reward_function``: the file imports and the function takes verl's
    arguments (:func:`verl_ppo.reward.custom.load_function`).

    Raises:
        PreflightError: naming the key and what is wrong.
    """
    fn = cfg.reward.custom_reward_function
    if fn.path is None:
        return
    from verl_ppo.reward.custom import CustomRewardError, load_function

    try:
        load_function(fn.path, fn.name)
    except CustomRewardError as exc:
        raise PreflightError(str(exc)) from None


# DeepSpeed's CPU accelerator JIT-builds this op at its first init_distributed (README, Quick
# start: minutes on a 2-core machine); nothing in its folder changes for this long while a
# build is alive.
DS_CPU_OP = "deepspeed_shm_comm"
STALE_BUILD_S = 900.0


def check_build_lock(now: float | None = None, op: str = DS_CPU_OP) -> None:
    """Refuse to start on a build lock that no build is using.

    torch builds extensions under a ``lock`` file in the op's build folder
    (``torch/utils/file_baton.py``: a later build waits, without a deadline, until the file is
    gone). A build killed half-way (Ctrl-C or a timeout during the first launch) leaves it
    behind, and every later start of the job on this machine waits for ever in
    ``deepspeed.init_distributed``. A lock is taken as stale when neither it nor any file
    of the folder changed for :data:`STALE_BUILD_S` seconds (a live build writes its object
    files within that).

    Raises:
        PreflightError: naming the lock file and the fix (delete it when no other job on this
            machine is building the op, or set ``TORCH_EXTENSIONS_DIR`` to another folder).
    """
    import time
    from pathlib import Path

    from verl_ppo.job.compat import extension_build_dir

    folder = extension_build_dir(op)
    lock = None if folder is None else Path(folder) / "lock"
    if lock is None or not lock.exists():
        return
    newest = max(f.stat().st_mtime for f in lock.parent.iterdir() if f.exists())
    idle = (time.time() if now is None else now) - newest
    if idle > STALE_BUILD_S:
        raise PreflightError(
            f"{lock} is a build lock of DeepSpeed's CPU op {op} that nothing has touched for "
            f"{idle / 60:.0f} min (a build killed half-way leaves it; DeepSpeed would wait on "
            f"it for ever): delete it if no other job on this machine is building the op "
            f"(rm {lock}), or set TORCH_EXTENSIONS_DIR to another folder"
        )


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

    try:
        cfg.derived(world_size)
    except ConfigError as exc:
        raise PreflightError(str(exc)) from None
    check_reward(cfg)
    check_data(cfg)
    try:
        model_config = model_config_of(cfg)
    except (ModelStoreError, ValueError, OSError) as exc:
        raise PreflightError(f"model: {exc}") from None
    check_hybrid_engine(cfg, world_size, model_config)
    check_fast_path(cfg, model_config)
    check_async_sync(cfg, model_config)
    check_comm(cfg)
    if not torch.cuda.is_available():
        check_build_lock()
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
