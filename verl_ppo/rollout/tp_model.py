"""Tensor-parallel causal LM for rollout, built directly on resharded weights.

Our own Megatron-style layers (Shoeybi et al. 2019) rather than torch's DTensor
``parallelize_module``: that API starts from a full ``nn.Module`` on every rank (the
full model materialised, which the hybrid engine must avoid) and needs a DeviceMesh
whose DTensor ops are slow and partly unsupported on gloo. Here each rank holds only
its rollout shards (the dict returned by :class:`~verl_ppo.reshard.engine.ReshardEngine`,
used in place, no copy):

- vocabulary-parallel embedding: local rows ``[t V/tp, (t+1) V/tp)``, others zero, all-reduce;
- column-parallel q/k/v (GQA: local KV heads, replicated when TP > KV heads) and
  gate/up (GPT-2: c_attn per q/k/v component, c_fc), no communication;
- row-parallel o/down (GPT-2 c_proj), one all-reduce each, replicated bias added after;
- vocabulary-parallel lm_head (tied: the embedding shard); logits all-gathered over TP
  for the positions sampled.

Numerics follow the HF implementations (RMSNorm in fp32, RoPE default type computed in
fp32, HF activations), so greedy decoding matches the unsharded HF model token for token
in fp32 (tests/verl_ppo/test_tp_model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from verl_ppo.job.model_dims import model_dims
from verl_ppo.job.model_family import LLAMA_FAMILY, names_of
from verl_ppo.step.compiled import CompiledOrEager


@dataclass
class TPGroup:
    """A TP group as the rollout model needs it.

    Attributes:
        group: process group of the TP members (None = WORLD, or no communication when
            ``size == 1``).
        size: TP degree.
        index: this rank's TP index (which shard it holds).
        members: global ranks ordered by TP index (``members[0]`` samples and broadcasts).
    """

    group: dist.ProcessGroup | None
    size: int
    index: int
    members: list[int]

    @classmethod
    def single(cls) -> TPGroup:
        """TP degree 1: no communication."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(None, 1, 0, [rank])

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group in place (no-op at TP 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every member's ``x`` along the last dim in TP-index order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        # all_gather fills in group-rank order (sorted global ranks); reorder by TP index
        by_global = dict(zip(sorted(self.members), parts))
        return torch.cat([by_global[g] for g in self.members], dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` with TP index 0's tensor (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=self.members[0], group=self.group)
        return x


def _rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rope_ref(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _silu_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def _add_rms_norm_ref(
    x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + r
    return s, _rms_norm_ref(s, w, eps)


# A decode step of a small model is a few hundred small kernels; RMSNorm (8 elementwise
# kernels in eager), the residual add before it, RoPE (10) and SiLU-and-multiply (2) become
# one Triton kernel each, which more than halves the kernels of the captured CUDA graph.
# Same arithmetic as the eager references above (fp32 norm, HF's rotate-half RoPE).
_rms_norm = CompiledOrEager(_rms_norm_ref)
# inductor keeps a fused kernel's intermediates in fp32; the norm must see the residual sum
# rounded to the weights' dtype, as the eager HF layer does (same tokens as HF's generate)
_add_rms_norm = CompiledOrEager(_add_rms_norm_ref, options={"emulate_precision_casts": True})
_rope = CompiledOrEager(_rope_ref)
_silu_mul = CompiledOrEager(_silu_mul_ref)


def _activation(name: str):
    try:
        from transformers.activations import ACT2FN

        return ACT2FN[name]
    except ImportError:  # pragma: no cover - GPU machine without transformers
        table = {
            "silu": F.silu,
            "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
            "gelu": F.gelu,
        }
        if name not in table:
            raise ValueError(f"activation {name!r} unsupported without transformers") from None
        return table[name]


def _rope_theta(config: Any) -> float:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype != "default":
        raise ValueError(
            f"rope_type {rtype!r} is not supported by the TP rollout model (default only)"
        )
    return float(rp.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


@dataclass
class FusedProjections:
    """One layer's q/k/v and gate/up weights concatenated along the output dim (copies).

    At a decode batch of ~100 rows each projection is a small, launch-bound GEMM; one GEMM
    over ``[q; k; v]`` and one over ``[gate; up]`` replace five (as vLLM's ``QKVParallelLinear``
    and ``MergedColumnParallelLinear`` do). The weights stay where their owner keeps them, so
    these are copies, refreshed by :meth:`TPCausalLM.refresh_fused` before every rollout.
    """

    qkv_w: torch.Tensor  # (q_out + 2 kv_out, hidden)
    qkv_b: torch.Tensor | None
    gate_up_w: torch.Tensor  # (2 intermediate, hidden)
    gate_up_b: torch.Tensor | None


def _fused_bias(weights: list, biases: list) -> torch.Tensor | None:
    """A zero bias for a fused group, None when no member has one (a missing bias of a
    partly biased group stays 0: ``F.linear`` adds exactly nothing there)."""
    if all(b is None for b in biases):
        return None
    return weights[0].new_zeros(sum(t.shape[0] for t in weights))


class KVCache:
    """A static KV cache: per layer ``(batch, local_kv_heads, max_len, head_dim)``.

    Slots are written in place (``index_copy_`` at a slot tensor) and attention reads all
    ``max_len`` slots under a boolean key mask, so shapes and addresses never change: the
    decode step can be captured as a CUDA graph (:mod:`verl_ppo.rollout.cuda_graph`).
    """

    def __init__(
        self, layers: int, batch: int, heads: int, max_len: int, head_dim: int, dtype, device
    ):
        shape = (batch, heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class TPCausalLM:
    """Tensor-parallel forward for the Llama family (Llama, SmolLM2, Qwen2, Mistral) and GPT-2.

    Args:
        config: HF config of the model.
        shards: this rank's rollout shards (name -> local tensor), as the reshard engine
            returns them for TP index ``tp.index`` of ``tp.size``; used without copying.
        tp: the TP group.

    Raises:
        KeyError: a shard is missing. ValueError: unsupported model type or rope type.
    """

    def __init__(self, config: Any, shards: dict[str, torch.Tensor], tp: TPGroup) -> None:
        self.config, self.w, self.tp = config, shards, tp
        d = self.dims = model_dims(config)
        self.llama = d.model_type in LLAMA_FAMILY
        self.names = names_of(d.model_type)
        self.nq = d.heads // tp.size
        self.nkv = d.kv_heads // tp.size if d.kv_heads % tp.size == 0 else 1
        self.vocab_local = d.vocab // tp.size
        self.embed = shards[self.names.embed_weight()]
        self.head = shards.get(self.names.head_weight(), self.embed) if not d.tied else self.embed
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.fused: list[FusedProjections] | None = None  # see fuse_projections
        act = getattr(config, "hidden_act", None) or getattr(
            config, "activation_function", "gelu_new"
        )
        self.act = _activation(act)
        self.silu = act == "silu"
        hd = d.head_dim
        # single-token steps attend with the split-K decode kernel (kernels/decode_attention.py)
        # on CUDA in half precision; fp32 and CPU keep sdpa (the exact reference path)
        self.decode_kernel = (
            self.device.type == "cuda"
            and self.dtype in (torch.bfloat16, torch.float16)
            and hd >= 16
            and hd & (hd - 1) == 0
        )
        if self.llama:
            theta = _rope_theta(config)
            hd = d.head_dim
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)).to(
                self.device
            )
            self.eps = config.rms_norm_eps
        else:
            self.eps = config.layer_norm_epsilon

    @property
    def nbytes(self) -> int:
        """Bytes of weights this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.w.values())

    def _fused_sources(self, i: int) -> tuple[list, list, list, list]:
        """Layer ``i``'s q/k/v and gate/up weights and biases (biases None where absent)."""
        w, n = self.w, self.names
        qkv = [w[n.param(i, p)] for p in ("q", "k", "v")]
        qkv_b = [w.get(n.param(i, p, "bias")) for p in ("q", "k", "v")]
        gu = [w[n.param(i, p)] for p in ("gate", "up")]
        gu_b = [w.get(n.param(i, p, "bias")) for p in ("gate", "up")]
        return qkv, qkv_b, gu, gu_b

    def fused_nbytes(self) -> int:
        """Bytes :meth:`fuse_projections` allocates (0 for GPT-2: its c_attn is fused)."""
        if not self.llama:
            return 0
        total = 0
        for i in range(self.dims.num_layers):
            for group in self._fused_sources(i):
                total += sum(t.numel() * t.element_size() for t in group if t is not None)
        return total

    def fuse_projections(self, reuse: list[FusedProjections] | None = None) -> None:
        """Give every Llama-family layer its :class:`FusedProjections` and fill them.

        Args:
            reuse: another model's fused copies of the same shapes (the hybrid engine's
                shards of the previous step): their buffers are refilled instead of new ones
                allocated, so a captured CUDA graph keeps reading valid addresses.
        """
        if not self.llama:
            return
        if reuse is None:
            reuse = []
            for i in range(self.dims.num_layers):
                qkv, qkv_b, gu, gu_b = self._fused_sources(i)
                reuse.append(
                    FusedProjections(
                        torch.cat(qkv),
                        _fused_bias(qkv, qkv_b),
                        torch.cat(gu),
                        _fused_bias(gu, gu_b),
                    )
                )
        self.fused = reuse
        self.refresh_fused()

    @torch.no_grad()
    def refresh_fused(self) -> None:
        """Copy the current weights into the fused copies (call whenever they may have
        changed: the decoder does before every rollout). No-op without fused copies."""
        for i, f in enumerate(self.fused or ()):
            qkv, qkv_b, gu, gu_b = self._fused_sources(i)
            torch.cat(qkv, out=f.qkv_w)
            torch.cat(gu, out=f.gate_up_w)
            for dst, ws, bs in ((f.qkv_b, qkv, qkv_b), (f.gate_up_b, gu, gu_b)):
                offset = 0
                for wt, b in zip(ws, bs):
                    if b is not None and dst is not None:
                        dst[offset : offset + wt.shape[0]].copy_(b)
                    offset += wt.shape[0]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
        return KVCache(
            self.dims.num_layers,
            batch,
            self.nkv,
            max_len,
            self.dims.head_dim,
            self.dtype,
            self.device,
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.embed)
        lo = self.tp.index * self.vocab_local
        local = ids - lo
        outside = (local < 0) | (local >= self.vocab_local)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        x = x.masked_fill(outside[..., None], 0.0)
        return self.tp.all_reduce(x)

    def _attend(self, q, k, v, layer: int, cache: KVCache, mask, slots, length) -> torch.Tensor:
        """Write ``k, v (B, nkv, T, D)`` at cache ``slots (T,)``, attend over the first
        ``mask.shape[-1]`` slots (all ``S``, or a prefill's ``P``).

        Grouped-query heads without copying the cache: the ``G`` query heads of a KV head
        become ``G * T`` query rows of that head (the mask is repeated to match). With
        ``length`` (a ``(1,)`` tensor, single-token steps only) the decode kernel reads the
        first ``length`` slots under ``mask (B, 1, 1, S)``.
        """
        cache.k[layer].index_copy_(2, slots, k)
        cache.v[layer].index_copy_(2, slots, v)
        b, _, t, hd = q.shape
        if length is not None:
            return self._decode_attend(q[:, :, 0], layer, cache, mask, length)
        g = self.nq // self.nkv
        qg = q.reshape(b, self.nkv, g * t, hd)
        if g > 1 and t > 1:
            mask = mask[:, :, None].expand(b, 1, g, t, mask.shape[-1]).reshape(b, 1, g * t, -1)
        n = mask.shape[-1]  # the slots the mask covers (a prefill's: its own P)
        out = F.scaled_dot_product_attention(
            qg,
            cache.k[layer][:, :, :n],
            cache.v[layer][:, :, :n],
            attn_mask=mask,
            scale=1.0 / math.sqrt(hd),
        )
        # sdpa may return a non-contiguous layout (backend-dependent): reshape, not view
        return out.reshape(b, self.nq, t, hd).transpose(1, 2).reshape(b, t, self.nq * hd)

    def _qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``(b, t, heads * head_dim)`` of layer ``i`` (one GEMM when fused)."""
        w, n, hd = self.w, self.names, self.dims.head_dim
        if self.fused is not None:
            f = self.fused[i]
            qkv = F.linear(h, f.qkv_w, f.qkv_b)
            return qkv.split((self.nq * hd, self.nkv * hd, self.nkv * hd), dim=-1)
        return tuple(  # type: ignore[return-value]
            F.linear(h, w[n.param(i, p)], w.get(n.param(i, p, "bias"))) for p in ("q", "k", "v")
        )

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """The gated MLP's activation ``act(gate) * up`` (one GEMM when fused)."""
        w, n = self.w, self.names
        if self.fused is not None:
            f = self.fused[i]
            g, u = F.linear(h, f.gate_up_w, f.gate_up_b).chunk(2, dim=-1)
        else:
            g = F.linear(h, w[n.param(i, "gate")], w.get(n.param(i, "gate", "bias")))
            u = F.linear(h, w[n.param(i, "up")], w.get(n.param(i, "up", "bias")))
        return _silu_mul(g, u) if self.silu else self.act(g) * u

    def _decode_attend(
        self, q, layer: int, cache: KVCache, mask, length, rope=None
    ) -> torch.Tensor:
        """Split-K decode attention (kernels/decode_attention.py) of ``q (B, nq, D)`` over
        the cache's first ``length`` slots under ``mask (B, 1, 1, S)``; ``(B, 1, nq * D)``.
        With ``rope`` (a ``RopeNew``: Llama family) ``q`` is not yet rotated, and the kernel
        also rotates the new key and writes it and the value at slot ``length - 1``."""
        from verl_comm.kernels.decode_attention import decode_attention

        b, hd = q.shape[0], self.dims.head_dim
        out = decode_attention(
            q,
            cache.k[layer],
            cache.v[layer],
            mask[:, 0, 0],
            length,
            1.0 / math.sqrt(hd),
            rope=rope,
        )
        return out.reshape(b, 1, self.nq * hd)

    def _llama_layer(self, i: int, x, r, cos, sin, cache, mask, slots, length):
        """Layer ``i`` on the residual stream ``x + r`` (``r``: the previous layer's MLP
        output, added here together with the norm; None for the first layer). Returns the
        new ``(x, r)``."""
        w, n, hd = self.w, self.names, self.dims.head_dim
        b, t, _ = x.shape
        if r is None:
            h = _rms_norm(x, w[n.param(i, "attn_norm")], self.eps)
        else:
            x, h = _add_rms_norm(x, r, w[n.param(i, "attn_norm")], self.eps)
        q, k, v = self._qkv(i, h)
        if length is not None:  # one new token: RoPE, the cache write and attention
            from verl_comm.kernels.decode_attention import RopeNew

            new = RopeNew(
                k.view(b, self.nkv, hd), v.view(b, self.nkv, hd), cos.view(b, hd), sin.view(b, hd)
            )
            a = self._decode_attend(q.view(b, self.nq, hd), i, cache, mask, length, new)
        else:
            q = q.view(b, t, self.nq, hd).transpose(1, 2)
            k = k.view(b, t, self.nkv, hd).transpose(1, 2)
            v = v.view(b, t, self.nkv, hd).transpose(1, 2)
            q, k = _rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
            a = self._attend(q, k, v, i, cache, mask, slots, None)
        o = self.tp.all_reduce(F.linear(a, w[n.param(i, "o")]))
        if n.param(i, "o", "bias") in w:
            o = o + w[n.param(i, "o", "bias")]
        x, h = _add_rms_norm(x, o, w[n.param(i, "mlp_norm")], self.eps)
        m = self.tp.all_reduce(F.linear(self._mlp(i, h), w[n.param(i, "down")]))
        if n.param(i, "down", "bias") in w:
            m = m + w[n.param(i, "down", "bias")]
        return x, m

    def _gpt2_layer(self, i: int, x, cache, mask, slots, length):
        w, n, hd = self.w, self.names, self.dims.head_dim
        b, t, hidden = x.shape
        ln_1 = (w[n.param(i, "attn_norm")], w[n.param(i, "attn_norm", "bias")])
        h = F.layer_norm(x, (hidden,), *ln_1, self.eps)
        qkv = torch.addmm(w[n.param(i, "qkv", "bias")], h.view(-1, hidden), w[n.param(i, "qkv")])
        q, k, v = qkv.view(b, t, 3 * self.nq * hd).split(self.nq * hd, dim=2)
        q, k, v = (z.view(b, t, self.nq, hd).transpose(1, 2) for z in (q, k, v))
        a = self._attend(q, k, v, i, cache, mask, slots, length)
        o = (
            self.tp.all_reduce(a.view(-1, a.shape[-1]) @ w[n.param(i, "o")])
            + w[n.param(i, "o", "bias")]
        )
        x = x + o.view(b, t, hidden)
        ln_2 = (w[n.param(i, "mlp_norm")], w[n.param(i, "mlp_norm", "bias")])
        h = F.layer_norm(x, (hidden,), *ln_2, self.eps)
        f = self.act(
            torch.addmm(w[n.param(i, "fc", "bias")], h.view(-1, hidden), w[n.param(i, "fc")])
        )
        m = self.tp.all_reduce(f @ w[n.param(i, "proj")]) + w[n.param(i, "proj", "bias")]
        return x + m.view(b, t, hidden)

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Run ``ids`` through the model, writing their keys/values at cache ``slots``;
        return the full-vocabulary logits of the last position.

        Args:
            ids: ``(batch, T)`` int64 token ids.
            positions: ``(batch, T)`` int64 position ids.
            cache: the :class:`KVCache` (``S = cache.max_len`` slots).
            mask: ``(batch, 1, T, N)`` bool (or ``(batch, 1, 1, N)`` for ``T = 1``), True =
                may attend, over the first ``N <= S`` slots (a prefill from slot 0 passes
                ``N = T``: the empty slots after it cost no attention); every query must see
                at least one slot.
            slots: ``(T,)`` int64 cache slots of the ``T`` new positions.

        Returns:
            ``(batch, vocab)`` logits in the weights' dtype, identical on every TP member.
        """
        x = self._embed(ids)
        length = None
        one_token = ids.shape[1] == 1 and mask.shape[2] == 1
        if one_token and self.decode_kernel and mask.shape[-1] == cache.max_len:
            length = slots[-1:] + 1  # the slots a single-token step can see
        if self.llama:
            freqs = positions[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            r = None
            for i in range(self.dims.num_layers):
                x, r = self._llama_layer(i, x, r, cos, sin, cache, mask, slots, length)
            norm_w = self.w[f"{self.names.norm()}weight"]
            x = _add_rms_norm(x[:, -1], r[:, -1], norm_w, self.eps)[1]
        else:
            x = x + F.embedding(positions, self.w[f"{self.names.base}wpe.weight"])
            for i in range(self.dims.num_layers):
                x = self._gpt2_layer(i, x, cache, mask, slots, length)
            hdim = x.shape[-1]
            x = F.layer_norm(
                x[:, -1],
                (hdim,),
                self.w[f"{self.names.norm()}weight"],
                self.w[f"{self.names.norm()}bias"],
                self.eps,
            )
        return self.tp.gather_last_dim(F.linear(x, self.head))

    def param_ptrs(self) -> tuple[int, ...]:
        """Addresses of every weight and fused copy (a captured CUDA graph is valid while
        they hold)."""
        fused = [t for f in self.fused or () for t in vars(f).values() if t is not None]
        return tuple(t.data_ptr() for t in [*self.w.values(), *fused])
