"""The PPO configuration: one pydantic tree, the single source of defaults.

Loaded from YAML with dotted ``key=value`` overrides (``load_config``). Unknown keys,
wrong types and impossible combinations fail here, before any process starts, with a
message naming the field and the fix. Derived sizes (per-rank batch, number of
mini-batches) are computed once by :meth:`PPOConfig.derived` with an exact-division helper.

Compression keys come from :class:`verl_comm.compression.config.CompressionConfig` and the
hybrid-engine keys from :class:`verl_ppo.reshard.config.HybridEngineConfig`; their defaults
live there. Users may write the compression keys at top level (``gradient_compression``,
``compression_rank``, ...) as they do in other trainers; they are moved into ``compression``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from verl_comm.compression.config import CompressionConfig
from verl_ppo.algorithms import POLICY_LOSSES, REWARD_SHAPERS
from verl_ppo.reshard.config import HybridEngineConfig
from verl_ppo.strict_model import StrictModel as _Strict


class ConfigError(ValueError):
    """An invalid configuration; the message names each bad field and the fix."""


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
    """Prompt source: a reasoning-gym task."""

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str) -> str:
        from verl_ppo.data.tasks import TASKS

        if v not in TASKS:
            raise ValueError(f"unknown task {v!r}; choose one of {sorted(TASKS)}")
        return v

    task: str = Field(
        "basic_arithmetic", description="basic_arithmetic|chain_sum|countdown|gsm_symbolic"
    )
    task_kwargs: dict[str, Any] = Field(default_factory=dict, description="reasoning-gym overrides")
    train_size: int = Field(10_000, gt=0, description="distinct training prompts (cycled)")
    eval_size: int = Field(32, ge=0, description="held-out prompts scored greedily; 0 = no eval")
    max_prompt_len: int = Field(160, gt=0, description="prompts longer than this (tokens) fail")
    pad_prompt_to: int | None = Field(
        None, gt=0, description="left-pad every prompt batch to this many tokens (benchmarks)"
    )


class RolloutConfig(_Strict):
    """Sampling of responses (KV cache always on)."""

    max_new_tokens: int = Field(32, gt=0, description="response length limit in tokens")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="0 = no top-k filter")
    eval_max_new_tokens: int = Field(24, gt=0, description="response limit for greedy eval")
    ignore_eos: bool = Field(
        False, description="always generate max_new_tokens (fixed-length benchmarks)"
    )
    use_cuda_graph: bool | Literal["auto"] = Field(
        "auto",
        description="static KV cache + decode steps as CUDA graphs; auto = on with CUDA for "
        "supported models (verl_ppo.fast_path)",
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="sequences per generation call; the reward of micro-batch i is scored "
        "asynchronously while micro-batch i+1 generates (None = the whole local batch)",
    )


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

    @field_validator("policy_loss", "reward_shaping")
    @classmethod
    def _registered(cls, value: str, info: Any) -> str:
        registry = {"policy_loss": POLICY_LOSSES, "reward_shaping": REWARD_SHAPERS}[info.field_name]
        if value not in registry:
            raise ValueError(
                f"unknown {info.field_name} {value!r}; choose one of {sorted(registry)}"
            )
        return value


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


ZERO_STAGE_HELP = (
    "DeepSpeed ZeRO stage; auto = 1 with CUDA (optimizer state partitioned over the data-"
    "parallel ranks; on one H200 ZeRO-1 ran the default PPO step 1.29x faster than ZeRO-0, "
    "benchmarks/results/ppo_throughput_zero_stage.md), 0 on the CPU"
)


def resolve_zero_stage(value: int | str) -> int:
    """``auto`` -> 1 when CUDA is available (where the trainer runs its engines), else 0."""
    if value != "auto":
        return int(value)
    import torch

    return 1 if torch.cuda.is_available() else 0


class _Engine(_Strict):
    """What the actor's and the critic's DeepSpeed engines share."""

    zero_stage: Literal["auto", 0, 1, 2, 3] = Field("auto", description=ZERO_STAGE_HELP)
    _zero_stage_auto: bool = PrivateAttr(False)

    @model_validator(mode="after")
    def _resolve_zero_stage(self) -> _Engine:
        # resolved here, so every later check and the engines see the stage that runs
        if self.zero_stage == "auto":
            object.__setattr__(self, "zero_stage", resolve_zero_stage("auto"))
            self._zero_stage_auto = True
        return self

    @field_serializer("zero_stage")
    def _dump_zero_stage(self, value: int) -> int | str:
        # a dumped config (run_dir/config.yaml, the ranks' copy) keeps what the user wrote
        return "auto" if self._zero_stage_auto else value

    def zero_stage_reason(self) -> str:
        """``"<stage> (auto: ...)"`` or ``"<stage> (set)"`` for the start-up report."""
        if self._zero_stage_auto:
            where = "CUDA" if self.zero_stage else "CPU"
            return f"{self.zero_stage} (auto: {where})"
        return f"{self.zero_stage} (set)"


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
        "metrics.jsonl and checkpoints/ aside (see verl_ppo/run_folder.py)",
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
        description="metric backends (verl_ppo/tracking.py): console lines, run_dir/metrics.jsonl, "
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

    @field_validator("logger")
    @classmethod
    def _loggers_installed(cls, v: list[str]) -> list[str]:
        from verl_ppo.tracking import missing_backends

        if len(set(v)) != len(v):
            raise ValueError(f"train.logger lists a backend twice: {v}")
        problems = missing_backends(v)
        if problems:
            raise ValueError("; ".join(problems))
        return v

    fused_log_probs: bool | Literal["auto"] = Field(
        "auto", description="chunked LM head + log-softmax + entropy (no fp32 vocab logits)"
    )
    torch_compile: bool | Literal["auto"] = Field(
        "auto",
        description="regional torch.compile of each decoder layer of the actor, reference "
        "and critic for the training and scoring forwards (verl_ppo/compiled.py); auto = on "
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


class RewardConfig(_Strict):
    """How responses are scored."""

    model: str = Field(
        "rule",
        description="rule (the task's reasoning-gym scorer), minilm, a HF folder, or the URL "
        "of a `verl-ppo reward-server`",
    )
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

    @model_validator(mode="after")
    def _check_combinations(self) -> PPOConfig:
        a, t = self.algorithm, self.train
        if a.adv_estimator == "grpo" and a.n_samples < 2:
            raise ValueError(
                "algorithm.adv_estimator=grpo needs algorithm.n_samples >= 2 "
                f"(got {a.n_samples}): set algorithm.n_samples=4, or use gae"
            )
        if a.kl.use_kl_in_reward and a.kl.use_kl_loss:
            raise ValueError(
                "algorithm.kl.use_kl_in_reward and algorithm.kl.use_kl_loss are both true: "
                "choose one place for the KL term"
            )
        if t.rollout_batch_size % a.n_samples:
            raise ValueError(
                f"train.rollout_batch_size={t.rollout_batch_size} is not a multiple of "
                f"algorithm.n_samples={a.n_samples}"
            )
        if t.rollout_batch_size % t.ppo_mini_batch_size:
            raise ValueError(
                f"train.rollout_batch_size={t.rollout_batch_size} is not a multiple of "
                f"train.ppo_mini_batch_size={t.ppo_mini_batch_size}"
            )
        for role in ("actor", "critic"):
            rc = getattr(self, role)
            if not rc.offload_optimizer:
                continue
            if rc.zero_stage == 0:
                raise ValueError(
                    f"{role}.offload_optimizer=true needs {role}.zero_stage 1, 2 or 3 (DeepSpeed "
                    f"offloads the ZeRO optimizer state), got 0: set {role}.zero_stage=1"
                )
            if self.compression.gradient_compression != "none":
                raise ValueError(
                    f"{role}.offload_optimizer=true cannot be combined with "
                    f"gradient_compression={self.compression.gradient_compression}: with "
                    "offload, DeepSpeed's ZeRO optimizer copies gradients to the CPU inside its "
                    "own reduction, so no comm hook can compress them (verl_ppo/grad_comm.py). "
                    f"Set gradient_compression=none, or {role}.offload_optimizer=false"
                )
        from verl_ppo.fast_path import resolve_old_log_prob

        resolve_old_log_prob(self)  # refuses bypass with several epochs / mini-batches
        if self.actor.zero_stage == 3 and not self.actor.model_config_.hybrid_engine.enable:
            if self.rollout.use_cuda_graph is True:
                raise ValueError(
                    "rollout.use_cuda_graph=true with actor.zero_stage=3 needs the hybrid engine "
                    "(ZeRO-3 partitions the weights the graph reads): enable "
                    "actor.model_config.hybrid_engine or set rollout.use_cuda_graph=auto"
                )
        if self.actor.zero_stage == 3 and self.train.fused_log_probs is True:
            raise ValueError(
                "train.fused_log_probs=true with actor.zero_stage=3: ZeRO-3 partitions the LM "
                "head weight; set train.fused_log_probs=auto"
            )
        from verl_ppo.pipeline.checks import check_pipeline_config

        check_pipeline_config(self)
        if t.export_critic and a.adv_estimator != "gae":
            raise ValueError(
                f"train.export_critic=true but algorithm.adv_estimator={a.adv_estimator} trains "
                "no critic: set train.export_critic=false"
            )
        pr = self.profiler
        if pr.enable:
            bad = [s for s in pr.steps if not 1 <= s <= t.num_steps]
            if bad:
                raise ValueError(
                    f"profiler.steps {bad} outside 1..train.num_steps={t.num_steps} (steps are "
                    "numbered as in the log, from 1): nothing would be profiled there"
                )
            from verl_comm.profiler.core import check_output_dir

            problem = check_output_dir(pr.output_dir)
            if problem:
                raise ValueError(f"profiler.output_dir: {problem}; pass a writable folder")
        return self

    def derived(self, world_size: int) -> Derived:
        """Per-rank sizes for ``world_size`` data-parallel ranks (exact division).

        Raises:
            ConfigError: a global batch does not divide across ranks or micro-batches.
        """
        t = self.train

        def per_rank(value: int, key: str) -> int:
            fix = (
                f"make {key} a multiple of {world_size}, or run a number of ranks in "
                f"{_divisors(value)} (comm.nproc, or torchrun --nproc_per_node)"
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
                f"{_divisors(local_mini)}, or train.ppo_mini_batch_size to a multiple of "
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


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p != "__root__")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see configs/default.yaml for valid keys)"
        lines.append(f"  {loc or '<root>'}: {msg}")
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


def build_config(data: dict[str, Any] | None = None, **overrides: Any) -> PPOConfig:
    """Validate a dict, then apply keyword overrides of config fields.

    Keyword names are top-level fields (``seed``), compression keys
    (``gradient_compression``, ``compression_rank``, which move into ``compression``) or
    dotted paths passed as ``**{"train.num_steps": 3}``; values are Python objects.

    Raises:
        ConfigError: with one line per bad field.
    """
    data = dict(data or {})
    for key, value in overrides.items():
        nested: dict[str, Any] = {}
        node = nested
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
        data = deep_merge(data, nested)
    try:
        return PPOConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


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
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return build_config(data)
