"""Configuration of compressed gradient communication (the single source of defaults).

:class:`CompressionConfig` is embedded as-is by the PPO trainer config; every default of the
hooks, the bucketed reducer and the adaptive policy is declared here and nowhere else.

YAML keys users already write map one to one: ``gradient_compression``,
``compression_rank``, ``quant_block``, ``error_feedback``, ``start_iter``.
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LOW_RANK_WARN_BELOW = 64
"""Ranks below this trigger a warning (not an error), see :class:`CompressionConfig`."""


class CompressionConfig(BaseModel):
    """How gradients are communicated between data-parallel ranks.

    Selecting a method:

    * ``gradient_compression="none"``: plain fp32 (bucket dtype) all-reduce.
    * ``"fp16"`` / ``"bf16"``: cast, all-reduce, cast back (2x fewer bytes than fp32).
    * ``"int8"`` with ``compression_rank`` 0/None: int8 quantized all-reduce (two-step
      all-to-all + all-gather, ~0.52x the bytes of a bf16 all-reduce at ``quant_block=128``).
    * ``"int8"`` with ``compression_rank > 0``: int8 low-rank (PowerSGD, Vogels et al. 2019)
      with the factors sent through the int8 quantized all-reduce.

    Raises:
        pydantic.ValidationError: on an unknown key or an invalid value; the message names the
            field and the fix.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gradient_compression: Literal["none", "fp16", "bf16", "int8"] = Field(
        "none",
        description="Wire format of gradients: none (bucket dtype), fp16, bf16 or int8 "
        "(int8 quantized all-reduce, or int8 low-rank when compression_rank > 0).",
    )
    compression_rank: int | None = Field(
        None,
        description="Rank r of the low-rank (PowerSGD) approximation when "
        "gradient_compression='int8'; 0 or null selects the int8 quantized all-reduce. "
        "Ranks below 64 are allowed but warned about.",
    )
    quant_block: Literal[32, 64, 128, 256] = Field(
        128,
        description="Elements per int8 quantization block (one fp32 absmax scale per block); "
        "wire overhead is 4/quant_block bytes per element.",
    )
    error_feedback: bool = Field(
        True,
        description="Keep the compression error of each rank and add it to the next step's "
        "gradient (error feedback), so the error does not accumulate in the model.",
    )
    residual_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16",
        description="Storage dtype of the error-feedback residuals; bfloat16 keeps the state "
        "at most one 16-bit copy of the gradients (fp16 for the int8 all-reduce of fp16 "
        "gradients, e.g. model.half()), float32 is exact but twice that.",
    )
    start_iter: int = Field(
        1,
        description="First iteration (counted in gradient reductions, from 0) that "
        "compresses; earlier ones use a plain all-reduce. 1 is the earliest correct value: "
        "DDP and verl_comm's reducer rebuild their buckets once after iteration 0, and the "
        "hooks' per-bucket state (error feedback, low-rank Q) is keyed by the final "
        "buckets. So even a 2-step run with one reduction per step compresses its second "
        "step (torch's PowerSGD asks for >= 2 for the same reason, one step later).",
    )
    policy: Literal["fixed", "auto"] = Field(
        "fixed",
        description="fixed: compress every bucket; auto: measure the link (all-reduce time "
        "per byte), the compressor's compute cost per bucket and backward's timeline (one "
        "measurement step at start_iter, plain all-reduces held to the end of backward), "
        "then take per bucket the path predicted to end the step first among those no "
        "lossier than the configured one: plain, bf16, int8 and, with compression_rank > 0, "
        "low rank at that rank. The configured rank is the lossiest path auto may take; it "
        "never lowers it (a rank is an accuracy choice): to allow rank 8, configure 8. "
        "What it chose per bucket and why is logged (logger verl_comm.hooks, INFO).",
    )
    auto_trial_steps: int = Field(
        3,
        ge=0,
        description="policy auto on a CPU host (gloo, W > 1): after deciding, run this many "
        "steps of each candidate plan (the model's, then each path on every bucket that "
        "may take it), time them end to end, and keep the fastest (verl_comm.hooks.trial): "
        "the model does not see compute sharing the cores with backward. 0 keeps the "
        "model's plan. On CUDA the model's plan is kept; setting this there is refused.",
    )
    bucket_cap_mb: float = Field(
        25.0,
        description="Gradient bucket size in MiB (DDP's bucket_cap_mb; used by the bucketed "
        "reducer too).",
    )
    min_compression_rate: float = Field(
        2.0,
        description="Low rank: a matrix (n, m) is compressed only if n*m / (r*(n+m)) is at "
        "least this; other tensors go through the int8 all-reduce uncompressed by low rank.",
    )
    nonfinite: Literal["raise", "skip"] = Field(
        "raise",
        description="What to do when a bucket's reduced gradient holds NaN/Inf: raise an "
        "error naming the bucket, or skip (zero that bucket's update, flag it in the stats).",
    )
    cuda_graph: bool = Field(
        True,
        description="CUDA: after a bucket's first compressed step, replay its whole "
        "reduction chain as one CUDA graph (one launch instead of ~20-60 on the host; "
        "verl_comm.hooks.graphs). CPU buckets always run eagerly. False: always eager.",
    )
    stats_every: int = Field(
        0,
        ge=0,
        description="Compute each bucket's relative compression error and error-feedback "
        "residual norm (comm/rel_error, comm/residual_norm) every N-th reduction; 0 = never "
        "(the default). They cost two extra passes over every bucket (about 6 ms of a 19 ms "
        "step of 403 M bf16 gradients on an H200), and on CUDA such a step runs the buckets "
        "eagerly instead of as CUDA graphs, so sample (e.g. 100) rather than set 1 in "
        "training. Bytes, compression ratio, finiteness and time are tracked every step.",
    )
    hierarchical: Literal["auto", "off"] = Field(
        "off",
        description="int8 all-reduce over a CPU process group (gloo) that spans 2 or more "
        "hosts with the same number (2 or more) of ranks each. auto: int8 inside each host "
        "first, then int8 only between the ranks of the same local rank on every host, then "
        "an all-gather of the codes inside the host (ZeRO++'s hierarchical qgZ; "
        "verl_comm.compression.hier_int8): 0.35x the cross-host bytes of an fp16 ring at "
        "2 x 2 ranks, for more compute per element and a second residual of N/L elements "
        "per bucket. Hosts are told apart by torchrun's GROUP_RANK, else the host name; "
        "other layouts, CUDA and process groups other than WORLD stay flat. off (the "
        "default): the flat two-step int8 all-reduce, which ran 0.91x and 0.96x auto's "
        "step on the shaped 1 Gbit/s veth with 2 x 2 ranks sharing 2 cores "
        "(benchmarks/results/comm_hooks.md, runs 92feb6e15978 and 421f0825445b).",
    )
    warm_start: bool = Field(
        True,
        description="Low rank: reuse last step's Q as the starting point of the power "
        "iteration (Vogels et al. 2019); False draws a fresh random Q each step.",
    )

    @field_validator("compression_rank")
    @classmethod
    def _check_rank(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(
                f"compression_rank must be >= 0 or null, got {v}; use 0/null for the int8 "
                "quantized all-reduce or a positive rank (e.g. 64) for int8 low rank"
            )
        return v

    @field_validator("start_iter")
    @classmethod
    def _check_start(cls, v: int) -> int:
        if v < 1:
            raise ValueError(
                f"start_iter must be >= 1, got {v}; DDP rebuilds its buckets after the "
                "first iteration, so compression may start at iteration 1 at the earliest "
                "(the default)"
            )
        return v

    @field_validator("bucket_cap_mb")
    @classmethod
    def _check_cap(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {v}; DDP's default is 25")
        return v

    @field_validator("min_compression_rate")
    @classmethod
    def _check_rate(cls, v: float) -> float:
        if not v >= 1.0:
            raise ValueError(
                f"min_compression_rate must be >= 1 (a ratio of element counts), got {v}; "
                "the default 2.0 compresses a matrix only if it halves its elements"
            )
        return v

    @model_validator(mode="after")
    def _check_combination(self) -> CompressionConfig:
        rank = self.compression_rank or 0
        if rank > 0 and self.gradient_compression != "int8":
            raise ValueError(
                f"compression_rank={rank} needs gradient_compression='int8' (low rank sends "
                f"its factors as int8), got gradient_compression='{self.gradient_compression}'; "
                "set gradient_compression: int8 or compression_rank: 0"
            )
        if 0 < rank < LOW_RANK_WARN_BELOW:
            warnings.warn(
                f"compression_rank={rank} is below {LOW_RANK_WARN_BELOW}: a low rank sends "
                "little of each step's gradient and leans on error feedback for the rest. "
                "Measured (benchmarks/results/convergence.md, tiny MLP, 2 ranks, 300 steps): "
                "per-step relative error 0.99 at ranks 4 and 8, final loss +2.1% over "
                "uncompressed at rank 4, +0.6% at rank 8 (+8.4% at rank 4 without error "
                "feedback); LLM practice uses 32-128. Consider 64 or more",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def method(self) -> Literal["none", "fp16", "bf16", "int8", "lowrank_int8"]:
        """The hook this config selects: ``none``, ``fp16``, ``bf16``, ``int8`` or
        ``lowrank_int8``."""
        if self.gradient_compression == "int8" and (self.compression_rank or 0) > 0:
            return "lowrank_int8"
        return self.gradient_compression
