"""The PPO configuration: one pydantic tree, the single source of defaults.

Loaded from YAML with dotted ``key=value`` overrides (``load_config``). Unknown keys and
wrong types fail here; :func:`build_config` then runs the rules that look past one field
(:mod:`verl_ppo.job.rules`, through :func:`verl_ppo.job.fast_path.check_config`), all before any
process starts, with a message naming the field and the fix. The schema keeps ``auto`` as
written: :mod:`verl_ppo.job.fast_path` resolves it, once per run. Derived sizes (per-rank
batch, number of mini-batches) are computed once by :meth:`PPOConfig.derived` with an
exact-division helper.

Compression keys come from :class:`verl_comm.compression.config.CompressionConfig`, the
hybrid-engine keys from :class:`verl_ppo.reshard.config.HybridEngineConfig` and the rollout keys
from :class:`verl_ppo.rollout.config.RolloutConfig`; their defaults live there. Users may
write the compression keys at top level (``gradient_compression``, ``compression_rank``, ...)
as they do in other trainers; they are moved into ``compression``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from verl_comm.compression.config import CompressionConfig
from verl_ppo.errors import ConfigError, divisors
from verl_ppo.job.strict_model import StrictModel as _Strict
from verl_ppo.reshard.config import HybridEngineConfig
from verl_ppo.rollout.config import RolloutConfig

__all__ = ["ConfigError", "Derived", "PPOConfig", "build_config", "exact_div", "load_config"]


class ModelConfig(_Strict):
    """Which policy model to load."""

    path: str | None = Field(
        None,
        description="local HF folder; None = the packaged SmolLM2-135M-Instruct (converted once)",
    )
    tiny: dict[str, Any] | None = Field(
        None,
        description="build a randomly initialised model from these config fields instead "
        "(tests, benchmarks); `model_type` picks the family (llama default, qwen2, ...); "
        "the tokenizer still comes from `path` or SmolLM2",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="parameter/compute dtype: auto = bf16 on GPU, fp32 on CPU"
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")


class DataConfig(_Strict):
    """Prompt source: a built-in reasoning-gym task, or verl-format files
    (:mod:`verl_ppo.data.verl_format`; file keys named as verl names them)."""

    task: str | None = Field(
        "basic_arithmetic", description="basic_arithmetic|chain_sum|countdown|gsm_symbolic|null"
    )
    task_kwargs: dict[str, Any] | None = Field(
        default_factory=dict, description="reasoning-gym overrides (null clears a file's)"
    )
    train_size: int = Field(
        10_000, gt=0, description="train generator draws (held-out questions skipped; cycled)"
    )
    eval_size: int = Field(32, ge=0, description="held-out prompts (or val rows); 0 = no eval")
    train_files: list[str] | None = Field(None, description="verl-format parquet/JSON-lines")
    val_files: list[str] | None = Field(None, description="the eval rows' files")
    prompt_key: str = Field("prompt", description="the chat-messages column (files)")
    max_prompt_length: int = Field(160, gt=0, description="prompt tokens after the template")
    filter_overlong_prompts: bool = Field(False, description="skip overlong rows, else refuse")
    pad_prompt_to: int | None = Field(
        None, gt=0, description="left-pad every prompt batch to this many tokens (benchmarks)"
    )

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # one path without a list, as verl allows


class KLConfig(_Strict):
    """KL regularisation against the frozen reference policy."""

    use_kl_in_reward: bool = Field(True, description="subtract kl_coef * KL from token rewards")
    use_kl_loss: bool = Field(False, description="add kl_coef * KL as an actor loss term instead")
    kl_coef: float = Field(0.02, ge=0.0, description="initial KL coefficient (beta)")
    estimator: Literal["k1", "k2", "k3"] = Field("k1", description="per-token KL estimator")
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="KL controller")
    target_kl: float = Field(0.1, gt=0.0, description="adaptive controller target")
    horizon: int = Field(10_000, gt=0, description="adaptive controller horizon (samples)")


class AlgorithmConfig(_Strict):
    """PPO maths."""

    adv_estimator: Literal["gae", "grpo"] = Field("gae", description="advantage estimator")
    n_samples: int = Field(1, ge=1, description="responses per prompt (grpo needs >= 2)")
    norm_adv_by_std_in_grpo: bool = Field(True, description="GRPO std normalisation switch")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda")
    clip_ratio: float = Field(0.2, gt=0.0, description="PPO epsilon")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip constant")
    cliprange_value: float = Field(0.2, gt=0.0, description="value clipping range")
    vf_coef: float = Field(1.0, gt=0.0, description="critic loss weight")
    entropy_coeff: float = Field(0.0, ge=0.0, description="entropy bonus weight")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    policy_loss: str = Field("vanilla", description="a name in verl_ppo.algorithms.POLICY_LOSSES")
    reward_shaping: str = Field(
        "last_token", description="a name in verl_ppo.algorithms.REWARD_SHAPERS"
    )
    old_log_prob: Literal["auto", "forward", "bypass"] = Field(
        "auto",
        description="bypass = no old-log-prob forward (one epoch, one mini-batch: the update's "
        "own forward gives it; the KL reward uses the rollout's log-probs); auto = bypass "
        "where that holds",
    )
    kl: KLConfig = Field(default_factory=KLConfig)


class OptimConfig(_Strict):
    """Optimizer of one role."""

    lr: float = Field(1e-6, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, ge=0.0, description="gradient norm clip; 0 = off")
    betas: tuple[float, float] = (0.9, 0.95)
    fused: bool | Literal["auto"] = Field("auto", description="fused AdamW; auto = on CUDA")


class ActorModelConfig(_Strict):
    """``actor.model_config``: where users write the hybrid-engine layout."""

    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)


class _Engine(_Strict):
    """What the actor's and the critic's DeepSpeed engines share."""

    zero_stage: Literal["auto", 0, 1, 2, 3] = Field(
        "auto",
        description="DeepSpeed ZeRO stage; auto = 1 with CUDA, 0 on the CPU (verl_ppo.job.fast_path)",
    )


class ActorConfig(_Engine):
    """The policy's DeepSpeed engine."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-6))
    offload_optimizer: bool = Field(
        False,
        description="DeepSpeed ZeRO optimizer offload to CPU (zero_stage 1-3, no gradient "
        "compression)",
    )
    model_config_: ActorModelConfig = Field(default_factory=ActorModelConfig, alias="model_config")

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, protected_namespaces=()
    )


class CriticConfig(_Engine):
    """The value model's DeepSpeed engine (same backbone + scalar head)."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    offload_optimizer: bool = Field(
        False,
        description="DeepSpeed ZeRO optimizer offload to CPU (zero_stage 1-3, no gradient "
        "compression)",
    )


class TrainConfig(_Strict):
    """Batch sizes are in prompts*n_samples (sequences), global over all ranks."""

    num_steps: int = Field(8, gt=0, description="PPO steps (one rollout batch each)")
    rollout_batch_size: int = Field(8, gt=0, description="sequences generated per step, global")
    ppo_mini_batch_size: int = Field(8, gt=0, description="sequences per optimizer step, global")
    micro_batch_size: int = Field(4, gt=0, description="sequences per forward/backward, per rank")
    ppo_epochs: int = Field(1, gt=0, description="passes over each rollout batch")
    log_interval: int = Field(1, gt=0, description="steps between metric lines")
    eval_interval: int = Field(0, ge=0, description="steps between evals; 0 = start and end only")
    save_interval: int = Field(0, ge=0, description="steps between checkpoints; 0 = end only")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto: continue from run_dir's latest complete checkpoint (a run_dir "
        "with metrics but no checkpoint is refused); never: start at step 0, moving an old "
        "metrics.jsonl and checkpoints/ aside (see verl_ppo/run/folder.py)",
    )
    keep_last_checkpoints: int = Field(
        2, ge=0, description="complete checkpoints kept in run_dir (older removed); 0 = all"
    )
    sequence_packing: bool | Literal["auto"] = Field(
        "auto",
        description="pack valid tokens of a micro-batch into one row (no compute on padding); "
        "auto = on with a varlen (flash) attention kernel",
    )
    max_tokens_per_micro_batch: int | Literal["auto"] | None = Field(
        "auto",
        description="dynamic micro-batches by token budget; None = micro_batch_size; auto = "
        "sized from free GPU memory on CUDA, None on the CPU",
    )
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl"],
        description="metric backends (verl_ppo/observe/tracking.py): console lines, run_dir/metrics.jsonl, "
        "TensorBoard events in run_dir/tensorboard, a wandb run in run_dir/wandb",
    )
    export_hf: bool = Field(
        True, description="end the run by writing the actor to run_dir/hf/actor (save_pretrained)"
    )
    export_critic: bool = Field(False, description="also write the critic to run_dir/hf/critic")
    project_name: str = Field("verl_ppo", description="wandb project")
    experiment_name: str | None = Field(None, description="wandb run name; None = run_dir's name")
    wandb_mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="None = $WANDB_MODE if set, else offline (no network by surprise)"
    )

    fused_log_probs: bool | Literal["auto"] = Field(
        "auto", description="chunked LM head + log-softmax + entropy (no fp32 vocab logits)"
    )
    torch_compile: bool | Literal["auto"] = Field(
        "auto",
        description="regional torch.compile of each decoder layer of the actor, reference "
        "and critic for the training and scoring forwards (verl_ppo/step/compiled.py); auto = on "
        "with CUDA",
    )

    @field_validator("max_tokens_per_micro_batch")
    @classmethod
    def _positive_budget(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
            raise ValueError(f"must be > 0, 'auto' or null, got {v}")
        return v


class CommConfig(_Strict):
    """Distributed setup."""

    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on GPU")
    nproc: int = Field(2, gt=0, description="processes started when not under torchrun")
    master_port: int | None = Field(None, ge=1, le=65535, description="None = a free port")
    timeout_s: float = Field(300.0, gt=0.0, description="collective/process-group timeout")
    nccl_preset: str | None = Field(None, description="verl_comm NCCL preset applied before init")


class ProfilerConfig(_Strict):
    """verl_comm profiler (torch.profiler based); report with ``verl-comm profile report DIR``."""

    enable: bool = Field(False, description="off = zero overhead")
    steps: list[int] = Field(
        default_factory=list,
        description="steps to profile, numbered as in the log (from 1); [] = every step",
    )
    output_dir: str = Field("profile_logs", description="per-rank profiles and Chrome traces")
    record_memory: bool = Field(True, description="allocated/reserved over time, peak per phase")
    record_communication: bool = Field(True, description="collectives of hooks/reducer/reshard")
    torch_profiler: bool = Field(True, description="also run torch.profiler (Chrome traces)")


class CustomRewardFunctionConfig(_Strict):
    """A file and a function ``compute_score(data_source, solution_str, ground_truth,
    extra_info)``, verl's signature (:mod:`verl_ppo.reward.custom`)."""

    path: str | None = Field(None, description="the Python file; None = no custom function")
    name: str = Field("compute_score", description="the function's name in that file")
    on_error: Literal["raise", "zero"] = Field("raise", description="stop, or score 0 counted")


class RewardConfig(_Strict):
    """How responses are scored."""

    model: str = Field(
        "rule",
        description="rule (the task's reasoning-gym scorer), minilm, a HF folder, or the URL "
        "of a `verl-ppo reward-server`",
    )
    custom_reward_function: CustomRewardFunctionConfig = Field(
        default_factory=CustomRewardFunctionConfig
    )
    num_workers: int = Field(1, ge=1, description="processes calling the custom function")
    cache_entries: int = Field(
        0, ge=0, description="LRU cache keyed by the exact prompt+response tokens; 0 = off"
    )
    async_scoring: bool = Field(True, description="score micro-batch i while i+1 generates")


class MonitorConfig(_Strict):
    """Prometheus endpoint."""

    prometheus_port: int | None = Field(None, ge=0, le=65535, description="None = off")
    prometheus_host: str = Field("127.0.0.1", description="bind address (localhost by default)")


class PPOConfig(_Strict):
    """Root of the configuration tree (see module docstring)."""

    seed: int = Field(0, description="global seed (data order, sampling, init)")
    run_dir: str = Field("runs/default", description="metrics.jsonl, checkpoints")
    amp_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="one compute dtype for every module: auto = bf16 on GPU, fp32 on CPU"
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

    @model_validator(mode="before")
    @classmethod
    def _lift_compression_keys(cls, data: Any) -> Any:
        """Accept ``gradient_compression: int8`` etc. at top level (users' YAML)."""
        if not isinstance(data, dict):
            return data
        keys = set(CompressionConfig.model_fields)
        top = {k: data[k] for k in list(data) if k in keys}
        if top:
            data = {k: v for k, v in data.items() if k not in keys}
            comp = dict(data.get("compression") or {})
            for k, v in top.items():
                comp[k] = v
            data["compression"] = comp
        return data

    def derived(self, world_size: int) -> Derived:
        """Per-rank sizes for ``world_size`` data-parallel ranks (exact division).

        Raises:
            ConfigError: a global batch does not divide across ranks or micro-batches.
        """
        t = self.train

        def per_rank(value: int, key: str) -> int:
            fix = (
                f"make {key} a multiple of {world_size}, or run a number of ranks in "
                f"{divisors(value)} (comm.nproc, or torchrun --nproc_per_node)"
            )
            return exact_div(value, world_size, key, "ranks", fix)

        local_rollout = per_rank(t.rollout_batch_size, "train.rollout_batch_size")
        local_mini = per_rank(t.ppo_mini_batch_size, "train.ppo_mini_batch_size")
        micro = min(t.micro_batch_size, local_mini)
        if local_mini % micro:
            raise ConfigError(
                f"train.micro_batch_size={t.micro_batch_size} does not divide the per-rank "
                f"mini-batch (train.ppo_mini_batch_size={t.ppo_mini_batch_size} / {world_size} "
                f"ranks = {local_mini}): set train.micro_batch_size to one of "
                f"{divisors(local_mini)}, or train.ppo_mini_batch_size to a multiple of "
                f"{micro * world_size}"
            )
        grad_accum = local_mini // micro
        return Derived(
            world_size=world_size,
            local_rollout_batch_size=local_rollout,
            local_prompts=exact_div(
                local_rollout,
                self.algorithm.n_samples,
                "per-rank rollout batch (train.rollout_batch_size / ranks)",
                "algorithm.n_samples",
                f"make train.rollout_batch_size a multiple of {self.algorithm.n_samples} x "
                f"{world_size} ranks = {self.algorithm.n_samples * world_size}",
            ),
            local_mini_batch_size=local_mini,
            local_micro_batch_size=micro,
            grad_accum_steps=grad_accum,
            num_mini_batches=t.rollout_batch_size // t.ppo_mini_batch_size,
        )


@dataclass(frozen=True)
class Derived:
    """Per-rank sizes derived once from the config and the world size (``local_`` = per rank)."""

    world_size: int
    local_rollout_batch_size: int
    local_prompts: int
    local_mini_batch_size: int
    local_micro_batch_size: int
    grad_accum_steps: int
    num_mini_batches: int


def exact_div(a: int, b: int, what: str, by: str, fix: str | None = None) -> int:
    """``a // b``, raising :class:`ConfigError` naming ``what``, ``by`` and the fix when
    ``b`` does not divide ``a`` (``fix`` defaults to "choose a multiple of b")."""
    if b <= 0 or a % b:
        raise ConfigError(
            f"{what}={a} does not divide evenly by {by} ({b}): {fix or f'choose a multiple of {b}'}"
        )
    return a // b


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys a user may write in the section ``loc`` names (aliases as written; at the
    top level the compression keys too)."""
    model: Any = PPOConfig
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    keys = [f.alias or n for n, f in model.model_fields.items()]
    return keys + (list(CompressionConfig.model_fields) if model is PPOConfig else [])


def _format_validation_error(exc: ValidationError, lifted: frozenset[str] = frozenset()) -> str:
    """One line per error: the key as the user typed it (``lifted``: compression keys
    written at top level), pydantic's ``Value error,`` and ``<root>`` dropped, a "did you
    mean" for a misspelled key (``difflib``)."""
    import difflib

    lines = []
    for err in exc.errors():
        parts = [p for p in err["loc"] if p != "__root__"]
        if len(parts) >= 2 and parts[0] == "compression" and parts[1] in lifted:
            parts = parts[1:]  # written at top level: name it so
        loc = ".".join(str(p) for p in parts)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(parts[-1]), _keys_at(tuple(parts[:-1])), n=1)
            hint = f"did you mean {'.'.join([*map(str, parts[:-1]), close[0]])}?" if close else ""
            msg = f"unknown key; {hint or 'check the spelling'} (see configs/default.yaml)"
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "invalid configuration:\n" + "\n".join(lines)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=[1, 2]"]`` into a nested dict; values are parsed as YAML scalars.

    Raises:
        ConfigError: an override without ``=``.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {p!r}")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Return ``base`` updated recursively by ``over`` (new dicts, inputs untouched)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _lift(layer: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """One source of config (a file, its overrides) with its top-level compression keys
    moved into ``compression``; returns it and the keys written at top level.

    Raises:
        ConfigError: one key written both ways in the same source with different values.
    """
    keys = CompressionConfig.model_fields
    top = {k: v for k, v in layer.items() if k in keys}
    if not top or not isinstance(layer.get("compression", {}), (dict, type(None))):
        return layer, set(top)
    out = {k: v for k, v in layer.items() if k not in keys}
    comp = dict(out.get("compression") or {})
    for k, v in top.items():
        if k in comp and comp[k] != v:
            raise ConfigError(
                f"{k} is given twice: {k}={v!r} and compression.{k}={comp[k]!r}; keep one"
            )
        comp[k] = v
    out["compression"] = comp
    return out, set(top)


def _validate(layers: list[dict[str, Any]]) -> PPOConfig:
    """Merge config sources in order (a later one wins, whichever way it spells a
    compression key) and validate; errors name each key as the winning source wrote it."""
    data: dict[str, Any] = {}
    typed_top: set[str] = set()
    for layer in layers:
        lifted, top = _lift(layer)
        comp = lifted.get("compression")
        typed_top -= set(comp) - top if isinstance(comp, dict) else set()
        typed_top |= top
        data = deep_merge(data, lifted)
    try:
        return PPOConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, frozenset(typed_top))) from None


def build_config(data: dict[str, Any] | None = None, **overrides: Any) -> PPOConfig:
    """Validate a dict, then apply keyword overrides of config fields.

    Keyword names are top-level fields (``seed``), compression keys
    (``gradient_compression``, ``compression_rank``, which move into ``compression``) or
    dotted paths passed as ``**{"train.num_steps": 3}``; values are Python objects.

    Raises:
        ConfigError: with one line per bad field, or the rules of :mod:`verl_ppo.job.rules`
            that the config breaks.
    """
    layers = [dict(data or {})]
    for key, value in overrides.items():
        nested: dict[str, Any] = {}
        node = nested
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
        layers.append(nested)
    return _checked(_validate(layers))


def _checked(cfg: PPOConfig) -> PPOConfig:
    """``cfg`` once the rules of :mod:`verl_ppo.job.rules` hold (ConfigError otherwise)."""
    from verl_ppo.job.fast_path import check_config  # the rules read the features' limits

    check_config(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> PPOConfig:
    """Load a YAML file (None = all defaults), apply dotted overrides, validate.

    Raises:
        ConfigError: missing file, not YAML, not a mapping, or invalid fields.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (--config PATH)")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r} must hold a YAML mapping at top level, got "
                f"{type(loaded).__name__}"
            )
        data = loaded
    return _checked(_validate([data, parse_overrides(overrides)] if overrides else [data]))
