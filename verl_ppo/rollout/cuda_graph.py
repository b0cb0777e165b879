"""Decode steps captured as CUDA graphs over a static KV cache (``rollout.use_cuda_graph``).

Eager decoding of a small model is launch-bound: one token of a 24-layer model is several
hundred kernel launches from Python. Capturing the decode step once as a CUDA graph and
replaying it removes that overhead; the graph needs fixed shapes and fixed addresses, so
the KV cache is preallocated (``(B, H_kv, S, D)`` per layer, ``S = P_max + R_max``) and the
step reads its inputs from static buffers. This is what vLLM and SGLang do for decode and
what HF's ``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` does; we capture
directly with ``torch.cuda.graph`` (no compile time, no recompiles).

The step is a functional forward of a Llama-family decoder (Llama, Qwen2, Qwen3) that uses
the HF model's own modules (projections, RMSNorms, MLP, rotary embedding, LM head): weights
are shared, never copied. HF's attention-mask construction is bypassed because it syncs
with the host (``mask.all()`` checks), which graph capture forbids. Attention runs over all
``S`` cache slots under a boolean key mask (left padding and not-yet-written slots off);
grouped-query heads are handled without copying the cache by viewing the ``G`` query heads
of a KV head as ``G`` query rows.

Same contract as :func:`verl_ppo.rollout.generate.generate`: left-padded prompts in,
``(B, P + R)`` out, identical tokens up to float rounding (tested on CPU with the graph
off). Sampling runs outside the graph with the same :func:`sample_next` and generator.

Validity: a captured graph reads the parameters at the addresses they had at capture; the
runner checks those addresses before every call and recaptures if they moved (ZeRO-3
gathers, a reloaded model). In-place optimizer updates (ZeRO 0-2) keep them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verl_ppo.rollout.generate import sample_next

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@dataclass
class _Buffers:
    """Static tensors of one batch size (addresses stay fixed for the graph)."""

    k: list[torch.Tensor]  # per layer (B, H_kv, S, D)
    v: list[torch.Tensor]
    kv_valid: torch.Tensor  # (B, S) bool
    tok: torch.Tensor  # (B, 1) int64
    pos: torch.Tensor  # (B, 1) int64
    slot: torch.Tensor  # (1,) int64
    logits: torch.Tensor | None = None  # (B, V), written by the step
    graph: torch.cuda.CUDAGraph | None = None
    param_ptrs: tuple[int, ...] = ()


class StaticCacheDecoder:
    """Prefill and single-token decode of a Llama-family HF causal LM over a static KV cache.

    Args:
        model: a HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` (or a
            DeepSpeed engine around one: its ``.module`` is used).
        max_seq_len: ``S``, the cache length; a call needs ``P + max_new_tokens <= S``.
        use_cuda_graph: capture the decode step as a CUDA graph (needs CUDA).

    Raises:
        ValueError: unsupported model type or sliding-window attention.
        RuntimeError: ``use_cuda_graph`` without CUDA or with the model on the CPU.
    """

    def __init__(self, model: torch.nn.Module, max_seq_len: int, use_cuda_graph: bool = True):
        model = getattr(model, "module", model)
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={cfg.model_type!r} is not supported by the static-cache decoder "
                f"(supported: {SUPPORTED_MODEL_TYPES}); set rollout.use_cuda_graph=false"
            )
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
            raise ValueError(
                "sliding-window attention is not supported by the static-cache decoder; "
                "set rollout.use_cuda_graph=false"
            )
        self.device = next(model.parameters()).device
        if use_cuda_graph and (not torch.cuda.is_available() or self.device.type != "cuda"):
            raise RuntimeError(
                "rollout.use_cuda_graph needs CUDA and the model on a CUDA device "
                f"(model is on {self.device}); set rollout.use_cuda_graph=false on CPU"
            )
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.max_seq_len = int(max_seq_len)
        self.use_cuda_graph = use_cuda_graph
        self.n_kv = cfg.num_key_value_heads
        self.n_heads = cfg.num_attention_heads
        attn0 = self.base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.dtype = next(model.parameters()).dtype
        self._bufs: dict[int, _Buffers] = {}

    # ------------------------------------------------------------------ the functional model
    def _layers(self, h, cos, sin, bufs: _Buffers, slots: torch.Tensor, mask, prefill: bool):
        B, q, _ = h.shape
        G = self.n_heads // self.n_kv
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            qs = attn.q_proj(x).view(B, q, self.n_heads, self.head_dim)
            ks = attn.k_proj(x).view(B, q, self.n_kv, self.head_dim)
            vs = attn.v_proj(x).view(B, q, self.n_kv, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):  # Qwen3
                qs, ks = attn.q_norm(qs), attn.k_norm(ks)
            qs, ks = qs.transpose(1, 2), ks.transpose(1, 2)
            qs = qs * cos + _rotate_half(qs) * sin
            ks = ks * cos + _rotate_half(ks) * sin
            bufs.k[i].index_copy_(2, slots, ks)
            bufs.v[i].index_copy_(2, slots, vs)
            if prefill:  # attend within the prompt: (B, H, P, D)
                kk = ks.repeat_interleave(G, dim=1)
                vv = vs.repeat_interleave(G, dim=1)
                o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=self.scaling)
                o = o.transpose(1, 2).reshape(B, q, -1)
            else:  # one query: the G heads of a KV head become G query rows, no cache copy
                qg = qs.reshape(B, self.n_kv, G, self.head_dim)
                o = F.scaled_dot_product_attention(
                    qg, bufs.k[i], bufs.v[i], attn_mask=mask, scale=self.scaling
                )
                o = o.reshape(B, 1, -1)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.base.norm(h[:, -1])

    def _buffers(self, B: int) -> _Buffers:
        if B not in self._bufs:
            S, dev = self.max_seq_len, self.device
            shape = (B, self.n_kv, S, self.head_dim)
            n = len(self.base.layers)
            self._bufs[B] = _Buffers(
                k=[torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(n)],
                v=[torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(n)],
                kv_valid=torch.zeros(B, S, dtype=torch.bool, device=dev),
                tok=torch.zeros(B, 1, dtype=torch.long, device=dev),
                pos=torch.zeros(B, 1, dtype=torch.long, device=dev),
                slot=torch.zeros(1, dtype=torch.long, device=dev),
            )
        return self._bufs[B]

    def _step(self, bufs: _Buffers) -> torch.Tensor:
        """One decode step from the static buffers; returns logits ``(B, V)``."""
        bufs.kv_valid.index_fill_(1, bufs.slot, True)
        h = self.base.embed_tokens(bufs.tok)
        cos, sin = self.base.rotary_emb(h, bufs.pos)
        mask = bufs.kv_valid[:, None, None, :]
        return self.lm_head(self._layers(h, cos, sin, bufs, bufs.slot, mask, prefill=False))

    def _param_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _capture(self, bufs: _Buffers) -> None:
        """Warm up on a side stream, then capture :meth:`_step` (buffers are reset after)."""
        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step(bufs)
        torch.cuda.current_stream(self.device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bufs.logits = self._step(bufs)
        bufs.graph = graph
        bufs.param_ptrs = self._param_ptrs()
        bufs.kv_valid.zero_()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompts, fill cache slots ``0 .. P-1``; returns last logits ``(B, V)``.

        Args:
            input_ids: ``(B, P)`` int64, left-padded. attention_mask: ``(B, P)``, 0 on padding.

        Raises:
            ValueError: ``P`` exceeds the cache length.
        """
        B, P = input_ids.shape
        if P > self.max_seq_len:
            raise ValueError(f"prompt length {P} exceeds max_seq_len={self.max_seq_len}")
        bufs = self._buffers(B)
        if self.use_cuda_graph and (bufs.graph is None or bufs.param_ptrs != self._param_ptrs()):
            self._capture(bufs)
        valid = attention_mask.bool()
        bufs.kv_valid.zero_()
        bufs.kv_valid[:, :P] = valid
        pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        causal = torch.ones(P, P, dtype=torch.bool, device=self.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=self.device)
        mask = (causal & valid[:, None, None, :]) | eye  # padding queries see themselves only
        h = self.base.embed_tokens(input_ids)
        cos, sin = self.base.rotary_emb(h, pos)
        slots = torch.arange(P, device=self.device)
        return self.lm_head(self._layers(h, cos, sin, bufs, slots, mask, prefill=True))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """Feed ``tokens (B,)`` at ``positions (B,)`` into cache slot ``slot``; logits ``(B, V)``.

        With the graph on, the returned tensor is a static buffer overwritten by the next call.

        Raises:
            ValueError: ``slot`` outside the cache.
        """
        if not 0 <= slot < self.max_seq_len:
            raise ValueError(f"slot {slot} outside the cache (max_seq_len={self.max_seq_len})")
        bufs = self._buffers(tokens.shape[0])
        bufs.tok.copy_(tokens[:, None])
        bufs.pos.copy_(positions[:, None])
        bufs.slot.fill_(slot)
        if self.use_cuda_graph:
            bufs.graph.replay()
            return bufs.logits
        return self._step(bufs)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int,
        pad_token_id: int,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        sync_every: int = 8,
    ) -> torch.Tensor:
        """Same arguments, result and stopping rule as :func:`verl_ppo.rollout.generate.generate`.

        ``sync_every``: steps between host checks of "all sequences done" (each check is a
        device sync); the result is trimmed to the step where all were done, so it does not
        change the output.

        Returns:
            ``(B, P + R)`` int64, ``R <= max_new_tokens``.

        Raises:
            ValueError: shapes differ, or ``P + max_new_tokens`` exceeds ``max_seq_len``.
        """
        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must both be (batch, prompt_len)"
            )
        B, P = input_ids.shape
        if P + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt {P} + max_new_tokens {max_new_tokens} exceeds the static cache "
                f"max_seq_len={self.max_seq_len}; build the decoder with a larger max_seq_len"
            )
        logits = self.prefill(input_ids, attention_mask)
        next_pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -1] + 1
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        tokens = []
        for step in range(max_new_tokens):
            nxt = sample_next(logits, do_sample, temperature, top_k, top_p, generator)
            nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
            tokens.append(nxt)
            done = done | (nxt == eos_token_id)
            if step == max_new_tokens - 1:
                break
            if (step + 1) % max(sync_every, 1) == 0 and bool(done.all()):
                break
            logits = self.decode(nxt, next_pos, P + step)
            next_pos = next_pos + 1
        out = torch.stack(tokens, dim=1)
        # Trim to the first step at which every sequence was done (generate.py's stop).
        is_eos = out == eos_token_id
        if bool(is_eos.any(-1).all()):
            first = is_eos.long().argmax(-1)
            out = out[:, : int(first.max()) + 1]
        return torch.cat([input_ids, out], dim=1)


def decoder_for(
    current: StaticCacheDecoder | None,
    model: torch.nn.Module,
    prompt_len: int,
    max_new_tokens: int,
    use_cuda_graph: bool,
    round_to: int = 64,
) -> StaticCacheDecoder:
    """``current`` if it serves ``model`` and has room for ``prompt_len + max_new_tokens``,
    else a new decoder with that length rounded up to ``round_to`` (fewer re-captures when
    prompt lengths vary). The trainer keeps the returned object between steps.

    Raises:
        ValueError / RuntimeError: as :class:`StaticCacheDecoder`.
    """
    need = prompt_len + max_new_tokens
    inner = getattr(model, "module", model)
    if (
        current is not None
        and current.model is inner
        and current.max_seq_len >= need
        and current.use_cuda_graph == use_cuda_graph
    ):
        return current
    cap = -(-need // round_to) * round_to
    return StaticCacheDecoder(model, max_seq_len=cap, use_cuda_graph=use_cuda_graph)
