"""What the hardware does per phase: model FLOPs utilisation (MFU) and the decode floor.

FLOPs follow verl's ``FlopsCounter`` (``verl/utils/flops_counter.py``, ``_estimate_qwen2_flops``):
``2 x`` the matmul parameters per token for a forward, ``3 x`` that for forward + backward,
and attention per forward ``4 x head_dim x heads x layers`` per (query, key) pair a causal
mask lets through: ``sum(L (L + 1) / 2)`` pairs over sequences of ``L`` tokens (``Q K^T``
and ``P V`` each ``2 x head_dim`` per pair and head). verl counts every pair
(``4 x sum(L^2) x ...``, nearly twice the causal count); the masked half is not work a
causal kernel does. Unlike verl the embedding lookup is not counted as a matmul, and
the LM head is counted only on the positions whose logits are computed (the response
positions with :mod:`verl_ppo.roles.fused_head`; every position on the plain path). MFU =
achieved FLOP/s over the device's dense bf16 peak (``perf/mfu/<phase>``, verl's
``perf/mfu/actor``).

The decode floor: each decode step reads every weight once and the KV cache of the
tokens so far; at the device's memory bandwidth that bounds tokens/s from above
(``perf/decode_floor_tokens_per_s``), prefill counted at peak FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_ppo.job.model_dims import ModelDims, model_dims

# Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (B/s) from NVIDIA's data sheets.
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
}


def device_peaks(device: torch.device) -> tuple[float, float] | None:
    """``(peak bf16 FLOP/s, HBM B/s)`` of a CUDA device known to :data:`DEVICE_PEAKS`."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, val in DEVICE_PEAKS.items():
        if key in name:
            return val
    return None


@dataclass(frozen=True)
class ModelFlops:
    """Per-token matmul parameters of a decoder, split as the phases need them."""

    dims: ModelDims
    body: int  # matmul parameters of the layers (q, k, v, o, MLP)
    head: int  # LM head parameters (vocab x hidden)

    @classmethod
    def of(cls, config: Any) -> ModelFlops:
        """From a HF config (Llama family or GPT-2)."""
        d = model_dims(config)
        attn = d.hidden * (d.heads * d.head_dim * 2 + 2 * d.kv_heads * d.head_dim)
        mlp = d.hidden * d.intermediate * (3 if d.model_type != "gpt2" else 2)
        return cls(d, d.num_layers * (attn + mlp), d.vocab * d.hidden)

    def forward(self, seq_lens: torch.Tensor, head_tokens: int) -> float:
        """FLOPs of one forward over sequences of ``seq_lens`` tokens (causal attention),
        with the LM head on ``head_tokens`` positions (0 for the value model)."""
        d = self.dims
        n = float(seq_lens.sum())
        L = seq_lens.double()
        pairs = float((L * (L + 1) / 2).sum())  # causal: query i attends to keys 0..i
        attn = 4.0 * pairs * d.head_dim * d.heads * d.num_layers
        return 2.0 * self.body * n + 2.0 * self.head * head_tokens + attn

    def weight_bytes(self, dtype_bytes: int = 2) -> float:
        """Bytes of the weights one decode step reads."""
        return float(self.body + self.head) * dtype_bytes

    def decode_floor_s(
        self, batch: int, prompt_len: int, new_tokens: int, peak: tuple[float, float]
    ) -> float:
        """Seconds the device needs at least to prefill ``batch`` prompts and decode
        ``new_tokens`` steps: prefill at peak FLOP/s, each step weights + KV at bandwidth."""
        d = self.dims
        flops, bw = peak
        prefill = self.forward(torch.full((batch,), prompt_len), batch) / flops
        kv_per_token = 2 * d.num_layers * d.kv_heads * d.head_dim * 2  # k and v, bf16
        ctx = prompt_len * new_tokens + new_tokens * (new_tokens - 1) / 2  # summed over steps
        decode = (new_tokens * self.weight_bytes() + batch * kv_per_token * ctx) / bw
        return prefill + decode


def phase_perf(
    mf: ModelFlops,
    times: dict[str, float],
    seq_lens: torch.Tensor,
    response_tokens: int,
    fused_head: bool,
    ppo_epochs: int,
    peak: tuple[float, float] | None,
    world: int = 1,
) -> dict[str, float]:
    """``perf/tflops/<phase>`` (per GPU) and ``perf/mfu/<phase>`` for the model phases of a step.

    Args:
        mf: the model's :class:`ModelFlops`.
        times: phase seconds (``timing_s/<phase>`` without the prefix).
        seq_lens: ``(B,)`` valid tokens of this rank's sequences.
        response_tokens: valid response tokens of this rank.
        fused_head: the LM head ran on response positions only.
        ppo_epochs: passes of the updates.
        peak: :func:`device_peaks` (None: TFLOP/s only, no MFU).
        world: ranks (FLOPs here are per rank).
    """
    head_tokens = response_tokens if fused_head else int(seq_lens.sum())
    fwd_actor = mf.forward(seq_lens, head_tokens)
    fwd_critic = mf.forward(seq_lens, 0)
    work = {
        "update_actor": 3 * fwd_actor * ppo_epochs,
        "update_critic": 3 * fwd_critic * ppo_epochs,
        "old_log_prob": fwd_actor,
        "ref": fwd_actor,
        "values": fwd_critic,
    }
    names = {"update_actor": "actor", "update_critic": "critic"}
    out: dict[str, float] = {}
    for phase, flops in work.items():
        t = times.get(phase)
        if not t:
            continue
        key = names.get(phase, phase)
        out[f"perf/tflops/{key}"] = flops / t / 1e12
        if peak is not None:
            out[f"perf/mfu/{key}"] = flops / t / peak[0]
    return out
