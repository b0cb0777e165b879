"""Every rule of the PPO config that looks past one field, in one table.

A :class:`Rule` reads the validated config and the :class:`Facts` of the job (the ZeRO
stages it runs, and, once known, the device and the policy model) and returns what is
wrong, naming the keys as the user wrote them with their values, or None; its fix is
written beside it. :data:`RULES` holds them all.

The ``auto`` switches have their own table, :data:`verl_ppo.job.switches.SWITCHES`: for
each, what blocks it (the config, the device, the model). :func:`verl_ppo.job.fast_path.resolve` turns an ``auto``
off where something blocks it, and :func:`check` refuses an explicit ``true`` with the
same reason, so a rule is never written twice.

:func:`check` runs both tables. It runs three times on the same code: when a config is
built (:func:`verl_ppo.config.build_config`: stages resolved, device and model not judged
yet), in :func:`verl_ppo.job.preflight.preflight` and when the trainer resolves its job (device
and model known). Nothing here imports the trainer or builds a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_ppo.errors import ConfigError, divisors
from verl_ppo.job.facts import (  # noqa: F401 - re-exported: the rules' vocabulary
    PIPELINE_ZERO_STAGES,
    PP_KEY,
    Facts,
    pipeline_degree,
    several_updates,
    trained_roles,
)
from verl_ppo.job.switches import SWITCHES, Switch, switch_message  # noqa: F401 - re-exported


@dataclass(frozen=True)
class Rule:
    """One rule: ``problem(cfg, facts)`` says what is wrong (or None); ``fix`` how to fix it
    (a text, or a function of the config where the fix names values to set)."""

    keys: tuple[str, ...]
    problem: Callable[[Any, Facts], str | None]
    fix: str | Callable[[Any], str]

    def message(self, cfg: Any, facts: Facts) -> str | None:
        """``"<problem>: <fix>"``, or None when the rule holds."""
        p = self.problem(cfg, facts)
        if p is None:
            return None
        return f"{p}: {self.fix(cfg) if callable(self.fix) else self.fix}"


def _per_role(keys: str, problem: Callable[[Any, Facts, str], str | None], fix: str) -> list[Rule]:
    """One :class:`Rule` per role; ``{role}`` in ``keys`` and ``fix`` names it."""
    return [
        Rule(
            tuple(k.format(role=r) for k in keys.split()),
            lambda cfg, f, r=r: problem(cfg, f, r),
            fix.format(role=r),
        )
        for r in ("actor", "critic")
    ]


def _pp(cfg: Any, what: str, why: str) -> str | None:
    """``"<what> with <PP_KEY>=<pp>: <why>"`` for a pipeline run, else None."""
    pp = pipeline_degree(cfg)
    return None if pp == 1 else f"{what} with {PP_KEY}={pp}: {why}"


def _task(cfg: Any, f: Facts) -> str | None:
    from verl_ppo.data.tasks import TASKS

    v = cfg.data.task
    if v is None or v in TASKS:
        return None
    return f"data.task: unknown task {v!r} (tasks: {sorted(TASKS)})"


def _data_default(cfg: Any, key: str) -> Any:
    """The schema's default of ``data.<key>``, read from the config's own model class (the
    schema is not imported here: it runs these rules)."""
    return type(cfg.data).model_fields[key].get_default(call_default_factory=True)


def _files_only(key: str) -> Callable[[Any, Facts], str | None]:
    """``data.<key>`` off its default without ``data.train_files``."""

    def problem(cfg: Any, f: Facts) -> str | None:
        v = getattr(cfg.data, key)
        if cfg.data.train_files or v == _data_default(cfg, key):
            return None
        return f"data.{key}={v!r} applies to verl-format files, but data.train_files is not set"

    return problem


def _task_only(key: str) -> Callable[[Any, Facts], str | None]:
    """A built-in task's ``data.<key>`` (set, or off its default) with ``data.train_files``."""

    def problem(cfg: Any, f: Facts) -> str | None:
        d = cfg.data
        v = getattr(d, key)
        unset = v is None or (key != "task" and v == _data_default(cfg, key))
        if not d.train_files or unset:
            return None
        return f"data.{key}={v!r} and data.train_files={d.train_files} both name the prompts"

    return problem


def _no_source(cfg: Any, f: Facts) -> str | None:
    d = cfg.data
    return (
        "data.task=null and no data.train_files: no prompts"
        if not (d.task or d.train_files)
        else None
    )


def _eval_rows(cfg: Any, f: Facts) -> str | None:
    d = cfg.data
    if not d.train_files or d.val_files or d.eval_size == 0:
        return None
    return f"data.eval_size={d.eval_size} with data.train_files but no data.val_files"


def _custom_only(key: str, default: Any) -> Callable[[Any, Facts], str | None]:
    """``reward.<key>`` set off its default without a custom reward function."""

    def problem(cfg: Any, f: Facts) -> str | None:
        r = cfg.reward
        node, leaf = (r.custom_reward_function, key.split(".")[-1]) if "." in key else (r, key)
        v = getattr(node, leaf)
        if r.custom_reward_function.path is not None or v == default:
            return None
        return f"reward.{key}={v!r} needs reward.custom_reward_function.path"

    return problem


def _custom_and_model(cfg: Any, f: Facts) -> str | None:
    r = cfg.reward
    if r.custom_reward_function.path is None or r.model == "rule":
        return None
    return (
        f"reward.custom_reward_function.path={r.custom_reward_function.path!r} and "
        f"reward.model={r.model!r} both score the responses"
    )


def _registered(key: str) -> Callable[[Any, Facts], str | None]:
    def problem(cfg: Any, f: Facts) -> str | None:
        from verl_ppo.algorithms import POLICY_LOSSES, REWARD_SHAPERS

        registry = {"policy_loss": POLICY_LOSSES, "reward_shaping": REWARD_SHAPERS}[key]
        v = getattr(cfg.algorithm, key)
        if v in registry:
            return None
        return f"algorithm.{key}: unknown {key} {v!r} (registered: {sorted(registry)})"

    return problem


def _loggers(cfg: Any, f: Facts) -> str | None:
    from verl_ppo.observe.tracking import missing_backends

    v = cfg.train.logger
    if len(set(v)) != len(v):
        return f"train.logger lists a backend twice: {v}"
    problems = missing_backends(v)
    return "; ".join(problems) if problems else None


def _profiler_steps(cfg: Any, f: Facts) -> str | None:
    pr, n = cfg.profiler, cfg.train.num_steps
    bad = [s for s in pr.steps if not 1 <= s <= n] if pr.enable else []
    if not bad:
        return None
    return (
        f"profiler.steps {bad} outside 1..train.num_steps={n} (steps are numbered as in the "
        "log, from 1)"
    )


def _profiler_dir(cfg: Any, f: Facts) -> str | None:
    from verl_comm.profiler.core import check_output_dir

    problem = check_output_dir(cfg.profiler.output_dir) if cfg.profiler.enable else None
    return None if problem is None else f"profiler.output_dir: {problem}"


def _offload_stage(cfg: Any, f: Facts, role: str) -> str | None:
    if not getattr(cfg, role).offload_optimizer or f.stage(role) != 0:
        return None
    return (
        f"{role}.offload_optimizer=true needs {role}.zero_stage 1, 2 or 3 (DeepSpeed offloads "
        "the ZeRO optimizer state), got 0"
    )


def _offload_compression(cfg: Any, f: Facts, role: str) -> str | None:
    method = cfg.compression.gradient_compression
    if not getattr(cfg, role).offload_optimizer or method == "none":
        return None
    return (
        f"{role}.offload_optimizer=true cannot be combined with gradient_compression={method}: "
        "with offload, DeepSpeed's ZeRO optimizer copies gradients to the CPU inside its own "
        "reduction, so no comm hook can compress them (verl_ppo/workers/grad_comm.py)"
    )


def _compression_stage(cfg: Any, f: Facts, role: str) -> str | None:
    from verl_ppo.workers.grad_comm import SUPPORTED_STAGES, UNSUPPORTED_STAGE_REASON

    method, stage = cfg.compression.gradient_compression, f.stage(role)
    if method == "none" or role not in trained_roles(cfg) or stage in SUPPORTED_STAGES:
        return None
    return (
        f"gradient_compression={method} needs {role}.zero_stage 0 or 1, got {stage}: "
        f"{UNSUPPORTED_STAGE_REASON}"
    )


def _pp_stage(cfg: Any, f: Facts, role: str) -> str | None:
    z = f.stage(role)
    if z in PIPELINE_ZERO_STAGES:
        return None
    return _pp(
        cfg,
        f"{role}.zero_stage={z}",
        "DeepSpeed's pipeline engine runs ZeRO stage 0 or 1 only (ZeRO-2/3 partition "
        "gradients/weights across the micro-batches it schedules)",
    )


def _pp_offload(cfg: Any, f: Facts, role: str) -> str | None:
    if not getattr(cfg, role).offload_optimizer:
        return None
    return _pp(cfg, f"{role}.offload_optimizer", "untested with the pipeline engine here")


def _pp_tiny(cfg: Any, f: Facts) -> str | None:
    from verl_ppo.job.model_family import LLAMA_FAMILY

    tiny = cfg.model.tiny
    if tiny is None or tiny.get("model_type", "llama") in LLAMA_FAMILY:
        return None
    return _pp(
        cfg,
        f"model.tiny.model_type={tiny.get('model_type')!r}",
        f"pipeline layers exist for {LLAMA_FAMILY}",
    )


def _pp_budget(cfg: Any, f: Facts) -> str | None:
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is None or budget == "auto":
        return None
    return _pp(
        cfg,
        f"train.max_tokens_per_micro_batch={budget}",
        "pipeline micro-batches have a fixed number of sequences (DeepSpeed's schedule)",
    )


def _pp_compression(cfg: Any, f: Facts) -> str | None:
    comp = cfg.compression.gradient_compression
    if comp == "none":
        return None
    return _pp(
        cfg,
        f"gradient_compression={comp!r}",
        "DeepSpeed's pipeline engine runs every backward, the tied-embedding all-reduce, its "
        "data-parallel all-reduce and the optimizer step inside one train_batch() call, with no "
        "point between the last micro-batch's backward and the step where verl_comm's reducer "
        "could write its averaged gradients back",
    )


ASYNC_KEYS = ("n_ranks", "tensor_model_parallel_size", "max_staleness", "sync_wire", "dtype")


def _async(cfg: Any) -> bool:
    return cfg.rollout.mode == "async"


def _async_in_colocated(cfg: Any, f: Facts) -> str | None:
    r = cfg.rollout
    fields = type(r).model_fields
    set_ = [
        f"rollout.{k}={getattr(r, k)!r}" for k in ASYNC_KEYS if getattr(r, k) != fields[k].default
    ]
    if _async(cfg) or not set_:
        return None
    return f"{', '.join(set_)} cannot apply with rollout.mode=colocated (async keys)"


def _async_split(cfg: Any, f: Facts) -> str | None:
    """The world split of the async mode (:mod:`verl_ppo.asyncrl.world`)."""
    r, n = cfg.rollout, cfg.comm.nproc
    if not _async(cfg):
        return None
    if r.n_ranks < 1:
        return "rollout.mode=async with rollout.n_ranks=0: the rollout group is empty"
    if r.n_ranks % r.tensor_model_parallel_size:
        return (
            f"rollout.n_ranks={r.n_ranks} is not a multiple of rollout.tensor_model_parallel_size"
            f"={r.tensor_model_parallel_size}"
        )
    if n % r.n_ranks:
        return (
            f"comm.nproc={n} training ranks do not split evenly over rollout.n_ranks={r.n_ranks} "
            "rollout ranks (each rollout rank makes the batches of comm.nproc / n_ranks "
            "training ranks)"
        )
    return None


def _async_blocked(cfg: Any, f: Facts) -> str | None:
    """What the cross-group sync plan (:mod:`verl_ppo.reshard.group_plan`) or the async
    wiring cannot serve."""
    if not _async(cfg):
        return None
    he = cfg.actor.model_config_.hybrid_engine
    if pipeline_degree(cfg) > 1:
        return f"rollout.mode=async with {PP_KEY}={pipeline_degree(cfg)}: not wired (experiences go to each data-parallel training rank)"
    if he.enable:
        return "rollout.mode=async with actor.model_config.hybrid_engine.enable=true: the rollout ranks hold their own weights, there is nothing to reshard in place"
    if f.actor_stage == 3:
        return "rollout.mode=async with actor.zero_stage=3: the sync reads full weights on every training rank"
    return None


def _async_wire(cfg: Any, f: Facts) -> str | None:
    r = cfg.rollout
    if not _async(cfg) or r.sync_wire != "delta" or r.dtype == "bfloat16":
        return None
    return f"rollout.sync_wire=delta with rollout.dtype={r.dtype}: the delta codec compares 16-bit words"


def _async_loss(cfg: Any, f: Facts) -> str | None:
    r, loss = cfg.rollout, cfg.algorithm.policy_loss
    if not _async(cfg) or r.max_staleness == 0 or loss == "decoupled":
        return None
    return (
        f"rollout.max_staleness={r.max_staleness} with algorithm.policy_loss={loss}: batches "
        "come from weights up to that many steps old and need the off-policy correction"
    )


RULES: tuple[Rule, ...] = (
    Rule(("data.task",), _task, "set data.task to one of those"),
    Rule(("data.task", "data.train_files"), _no_source,
         "set data.train_files (verl-format files) or data.task"),
    Rule(("data.task", "data.train_files"), _task_only("task"),
         "set data.task=null to train on the files, or drop data.train_files"),
    Rule(("data.task_kwargs", "data.train_files"), _task_only("task_kwargs"),
         "set data.task_kwargs=null (they configure a built-in task)"),
    Rule(("data.train_size", "data.train_files"), _task_only("train_size"),
         "drop data.train_size (the files' rows are the train prompts, cycled)"),
    *(Rule((f"data.{k}", "data.train_files"), _files_only(k),
           f"set data.train_files, or drop data.{k}")
      for k in ("val_files", "prompt_key", "filter_overlong_prompts")),
    Rule(("data.eval_size", "data.val_files"), _eval_rows,
         "set data.val_files (the eval rows), or data.eval_size=0"),
    Rule(("reward.custom_reward_function.path", "reward.model"), _custom_and_model,
         "keep one: reward.model=rule (the default) with the custom function"),
    Rule(("reward.num_workers",), _custom_only("num_workers", 1),
         "set reward.custom_reward_function.path, or reward.num_workers=1"),
    Rule(("reward.custom_reward_function.on_error",),
         _custom_only("custom_reward_function.on_error", "raise"),
         "set reward.custom_reward_function.path, or drop on_error"),
    Rule(("algorithm.policy_loss",), _registered("policy_loss"), "choose one of those"),
    Rule(("algorithm.reward_shaping",), _registered("reward_shaping"), "choose one of those"),
    Rule(("train.logger",), _loggers, "list each backend once, installed"),
    Rule(
        ("algorithm.adv_estimator", "algorithm.n_samples"),
        lambda c, f: None if c.algorithm.adv_estimator != "grpo" or c.algorithm.n_samples >= 2
        else "algorithm.adv_estimator=grpo needs algorithm.n_samples >= 2 "
        f"(got {c.algorithm.n_samples})",
        "set algorithm.n_samples=4, or use gae",
    ),
    Rule(
        ("algorithm.kl.use_kl_in_reward", "algorithm.kl.use_kl_loss"),
        lambda c, f: "algorithm.kl.use_kl_in_reward and algorithm.kl.use_kl_loss are both true"
        if c.algorithm.kl.use_kl_in_reward and c.algorithm.kl.use_kl_loss else None,
        "choose one place for the KL term",
    ),
    Rule(
        ("train.rollout_batch_size", "algorithm.n_samples"),
        lambda c, f: None if c.train.rollout_batch_size % c.algorithm.n_samples == 0
        else f"train.rollout_batch_size={c.train.rollout_batch_size} is not a multiple of "
        f"algorithm.n_samples={c.algorithm.n_samples}",
        lambda c: f"set train.rollout_batch_size="
        f"{-(-c.train.rollout_batch_size // c.algorithm.n_samples) * c.algorithm.n_samples}, "
        f"or algorithm.n_samples to one of {divisors(c.train.rollout_batch_size)}",
    ),
    Rule(
        ("train.rollout_batch_size", "train.ppo_mini_batch_size"),
        lambda c, f: None if c.train.rollout_batch_size % c.train.ppo_mini_batch_size == 0
        else f"train.rollout_batch_size={c.train.rollout_batch_size} is not a multiple of "
        f"train.ppo_mini_batch_size={c.train.ppo_mini_batch_size}",
        lambda c: "set train.ppo_mini_batch_size to one of "
        f"{divisors(c.train.rollout_batch_size)}",
    ),
    Rule(
        ("algorithm.old_log_prob", "train.ppo_epochs", "train.ppo_mini_batch_size"),
        lambda c, f: None if c.algorithm.old_log_prob != "bypass" or not several_updates(c)
        else "algorithm.old_log_prob=bypass needs one PPO epoch and one mini-batch "
        f"({several_updates(c)})",
        "set algorithm.old_log_prob=forward or auto",
    ),
    *_per_role("{role}.offload_optimizer {role}.zero_stage", _offload_stage,
               "set {role}.zero_stage=1"),
    *_per_role("{role}.offload_optimizer gradient_compression", _offload_compression,
               "set gradient_compression=none, or {role}.offload_optimizer=false"),
    *_per_role("gradient_compression {role}.zero_stage", _compression_stage,
               "set {role}.zero_stage=1, or gradient_compression=none"),
    Rule(
        ("train.export_critic", "algorithm.adv_estimator"),
        lambda c, f: None if not c.train.export_critic or c.algorithm.adv_estimator == "gae"
        else f"train.export_critic=true but algorithm.adv_estimator="
        f"{c.algorithm.adv_estimator} trains no critic",
        "set train.export_critic=false",
    ),
    Rule(("profiler.steps", "train.num_steps"), _profiler_steps,
         "nothing would be profiled there; list steps in that range"),
    Rule(("profiler.output_dir",), _profiler_dir, "pass a writable folder"),
    Rule(
        (PP_KEY, "actor.model_config.hybrid_engine.enable"),
        lambda c, f: None if c.actor.model_config_.hybrid_engine.enable
        else _pp(c, "actor.model_config.hybrid_engine.enable: false", "no rank holds the "
                 "whole policy, so responses are generated by the TP rollout model the hybrid "
                 "engine builds from the stages"),
        "set actor.model_config.hybrid_engine.enable: true",
    ),
    *_per_role(f"{PP_KEY} {{role}}.zero_stage", _pp_stage, "set {role}.zero_stage: 1"),
    *_per_role(f"{PP_KEY} {{role}}.offload_optimizer", _pp_offload,
               "set {role}.offload_optimizer: false"),
    Rule((PP_KEY, "gradient_compression"), _pp_compression,
         "set gradient_compression: none, or pipeline_parallel_size: 1"),
    Rule((PP_KEY, "train.max_tokens_per_micro_batch"), _pp_budget,
         "set max_tokens_per_micro_batch: auto or null"),
    Rule(
        (PP_KEY, "model.gradient_checkpointing"),
        lambda c, f: None if not c.model.gradient_checkpointing
        else _pp(c, "model.gradient_checkpointing", "not wired to the pipeline engine's "
                 "activation checkpointing"),
        "set gradient_checkpointing: false",
    ),
    Rule((PP_KEY, "model.tiny.model_type"), _pp_tiny, "use a Llama-family model_type"),
    Rule(tuple(f"rollout.{k}" for k in ("mode", *ASYNC_KEYS)), _async_in_colocated,
         "set rollout.mode: async, or remove those keys"),
    Rule(("rollout.n_ranks", "rollout.tensor_model_parallel_size", "comm.nproc"), _async_split,
         "set rollout.n_ranks to a divisor of comm.nproc (>= 1) and a multiple of "
         "rollout.tensor_model_parallel_size"),
    Rule(("rollout.mode", PP_KEY, "actor.model_config.hybrid_engine.enable", "actor.zero_stage"),
         _async_blocked, "use rollout.mode: colocated for that layout, or train with "
         "pipeline_parallel_size 1, hybrid_engine.enable false and actor.zero_stage <= 2"),
    Rule(("rollout.sync_wire", "rollout.dtype"), _async_wire,
         "set rollout.sync_wire: full, or rollout.dtype: bfloat16"),
    Rule(("rollout.max_staleness", "algorithm.policy_loss"), _async_loss,
         "set algorithm.policy_loss: decoupled, or rollout.max_staleness: 0"),
)  # fmt: skip


def problems(cfg: Any, facts: Facts) -> list[str]:
    """Every broken rule of :data:`RULES` and every explicit ``true`` of :data:`SWITCHES`
    that cannot apply, as messages naming the keys and the fix."""
    out = [m for rule in RULES if (m := rule.message(cfg, facts)) is not None]
    for s in SWITCHES:
        if s.value(cfg) is True and (why := s.blocked(cfg, facts, False)) is not None:
            out.append(switch_message(s, why))
    return out


def check(cfg: Any, facts: Facts) -> None:
    """Run both tables.

    Raises:
        ConfigError: every problem found, ``"; "``-separated.
    """
    found = problems(cfg, facts)
    if found:
        raise ConfigError("; ".join(found))
