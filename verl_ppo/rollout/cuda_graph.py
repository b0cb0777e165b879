"""Static-KV-cache decoding, optionally with the decode step captured as a CUDA graph.

Eager decoding of a small model is launch-bound: one token of a 24-layer model is several
hundred kernel launches from Python. Capturing the decode step once as a CUDA graph and
replaying it removes that overhead; the graph needs fixed shapes and fixed addresses, so
the KV cache is preallocated (``(B, H_kv, S, D)`` per layer, ``S = P_max + R_max``) and the
step reads its inputs from static buffers. This is what vLLM and SGLang do for decode and
what HF's ``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` does; we capture
directly with ``torch.cuda.graph`` (no compile time, no recompiles).

The forward is the one functional model of the rollout, :class:`TPCausalLM`: built here on
the HF model's own parameters (TP degree 1, no copy) or handed in by the hybrid engine on
its resharded TP shards. With TP > 1 the graph holds the model's NCCL all-reduces and
all-gather (NCCL collectives are graph-capturable; every TP member captures and replays
together, since they decode in lockstep). Where the one-pass sampler draws (CUDA, no top-k /
top-p) and the caller does not sample itself, the draw and the loop's bookkeeping are
captured with the step (:mod:`verl_ppo.rollout.graph_loop`); otherwise sampling runs
outside the graph through the shared loop and sampler
(:func:`verl_ppo.rollout.generate.decode_loop`).

Validity: a captured graph reads the weights at the addresses they had at capture; the
decoder checks those addresses before every generation and recaptures if they moved (new
resharded shards each step, a reloaded model). In-place optimizer updates (ZeRO 0-2) keep
them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from verl_ppo.job.model_family import LLAMA_FAMILY
from verl_ppo.rollout.generate import (
    RolloutOutput,
    check_prompts,
    decode_loop,
    sampling_kwargs,
)
from verl_ppo.rollout.graph_loop import LoopBuffers, capture, graph_rollout
from verl_ppo.rollout.sampler import SamplingParams, fused_sampler_on
from verl_ppo.rollout.tp_model import KVCache, TPCausalLM, TPGroup

SUPPORTED_MODEL_TYPES = (*LLAMA_FAMILY, "gpt2")

FUSE_FREE_FRACTION = 0.125
"""The decoder gives the rollout model fused q/k/v and gate/up copies
(:meth:`TPCausalLM.fuse_projections`) on CUDA when their bytes are at most this fraction of
the device's free memory when the decoder is built (about two thirds of the weights' bytes:
0.47 GB for Qwen2.5-0.5B); otherwise it runs the unfused projections."""

log = logging.getLogger("verl_ppo")


def _maybe_fuse(model: TPCausalLM, reuse=None) -> None:
    """Apply the :data:`FUSE_FREE_FRACTION` rule to ``model`` (CUDA only), reusing
    ``reuse``'s buffers when given."""
    if model.device.type != "cuda" or not model.llama or model.fused is not None:
        return
    if reuse is not None:
        model.fuse_projections(reuse)
        return
    need = model.fused_nbytes()
    free, _ = torch.cuda.mem_get_info(model.device)
    if need <= FUSE_FREE_FRACTION * free:
        model.fuse_projections()
    else:
        log.info(
            "rollout: unfused q/k/v and gate/up projections (their fused copies would take "
            "%.2f GB, more than %.0f%% of the %.2f GB free)",
            need / 1e9,
            100 * FUSE_FREE_FRACTION,
            free / 1e9,
        )


def static_decoding_unsupported(model: Any) -> str | None:
    """Why a HF model cannot use the static-cache decoder, or None when it can."""
    cfg = getattr(getattr(model, "module", model), "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return f"model_type={mt!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default":
        return f"rope_type={rp.get('rope_type', rp.get('type'))!r} (default only)"
    return None


def tp_model_of(model: Any) -> TPCausalLM:
    """The functional rollout model over a HF model's own parameters (TP 1, no copy).

    Raises:
        ValueError: the model is not supported (see :func:`static_decoding_unsupported`).
    """
    if isinstance(model, TPCausalLM):
        return model
    inner = getattr(model, "module", model)
    why = static_decoding_unsupported(inner)
    if why:
        raise ValueError(
            f"the static-cache decoder does not support {why}; set rollout.use_cuda_graph=false"
        )
    shards = dict(inner.named_parameters())
    return TPCausalLM(inner.config, shards, TPGroup.single())


@dataclass
class _Buffers:
    """Static tensors of one batch size (addresses stay fixed for the graph)."""

    cache: KVCache
    kv_valid: torch.Tensor  # (B, S) bool
    tok: torch.Tensor  # (B, 1) int64
    pos: torch.Tensor  # (B, 1) int64
    slot: torch.Tensor  # (1,) int64
    logits: torch.Tensor | None = None  # (B, V), written by the step
    graph: torch.cuda.CUDAGraph | None = None
    param_ptrs: tuple[int, ...] = ()


class StaticCacheDecoder:
    """Prefill and single-token decode over a static KV cache, eager or as a CUDA graph.

    Args:
        model: a HF causal LM of :data:`SUPPORTED_MODEL_TYPES` (or a DeepSpeed engine
            around one; its parameters are used in place), or a :class:`TPCausalLM`.
        max_seq_len: ``S``, the cache length; a call needs ``P + max_new_tokens <= S``.
        use_cuda_graph: capture the decode step as a CUDA graph (needs CUDA).

    Raises:
        ValueError: unsupported model.
        RuntimeError: ``use_cuda_graph`` without CUDA or with the model on the CPU.
    """

    def __init__(self, model: Any, max_seq_len: int, use_cuda_graph: bool = True) -> None:
        self.source = getattr(model, "module", model)
        self.tp_model = tp_model_of(model)
        self.device = self.tp_model.device
        if use_cuda_graph and (not torch.cuda.is_available() or self.device.type != "cuda"):
            raise RuntimeError(
                "rollout.use_cuda_graph needs CUDA and the model on a CUDA device "
                f"(model is on {self.device}); set rollout.use_cuda_graph=false on CPU"
            )
        self.max_seq_len = int(max_seq_len)
        self.use_cuda_graph = use_cuda_graph
        self.captures = 0
        _maybe_fuse(self.tp_model)
        self._bufs: dict[int, _Buffers] = {}
        self._loops: dict[int, LoopBuffers] = {}

    def retarget(self, model: TPCausalLM) -> None:
        """Decode with ``model`` from now on (the hybrid engine's shards of this step); the
        graph is recaptured at the next call if its weights moved."""
        old = self.tp_model.fused
        same = old is not None and model.fused_nbytes() == self.tp_model.fused_nbytes()
        self.tp_model = self.source = model
        _maybe_fuse(model, old if same else None)

    def _buffers(self, B: int) -> _Buffers:
        if B not in self._bufs:
            S, dev = self.max_seq_len, self.device
            self._bufs[B] = _Buffers(
                cache=self.tp_model.new_cache(B, S),
                kv_valid=torch.zeros(B, S, dtype=torch.bool, device=dev),
                tok=torch.zeros(B, 1, dtype=torch.long, device=dev),
                pos=torch.zeros(B, 1, dtype=torch.long, device=dev),
                slot=torch.zeros(1, dtype=torch.long, device=dev),
            )
        return self._bufs[B]

    def _step(self, bufs: _Buffers) -> torch.Tensor:
        """One decode step from the static buffers; returns logits ``(B, V)``."""
        bufs.kv_valid.index_fill_(1, bufs.slot, True)
        mask = bufs.kv_valid[:, None, None, :]
        return self.tp_model.forward(bufs.tok, bufs.pos, bufs.cache, mask, bufs.slot)

    def _capture(self, bufs: _Buffers) -> None:
        """Warm up on a side stream, then capture :meth:`_step`. Called by :meth:`decode`
        with the step's inputs in place: the warm-ups compute that same step (the same cache
        slot written with the same keys and values), so they leave the state the step
        leaves."""
        bufs.graph = None  # free the previous graph's pool first
        bufs.graph, bufs.logits = capture(lambda: self._step(bufs), self.device)
        bufs.param_ptrs = self.tp_model.param_ptrs()
        self.captures += 1

    def _count_capture(self) -> None:
        self.captures += 1

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompts, fill cache slots ``0 .. P-1``; returns last logits ``(B, V)``.

        Args:
            input_ids: ``(B, P)`` int64, left-padded. attention_mask: ``(B, P)``, 0 on padding.

        Raises:
            ValueError: ``P`` exceeds the cache length.
        """
        check_prompts(input_ids, attention_mask)
        B, P = input_ids.shape
        if P > self.max_seq_len:
            raise ValueError(f"prompt length {P} exceeds max_seq_len={self.max_seq_len}")
        self.tp_model.refresh_fused()  # the weights may have changed since the last rollout
        return self._prefill(self._buffers(B), input_ids, attention_mask)

    def _prefill(
        self, bufs: _Buffers, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        B, P = input_ids.shape
        if bufs.graph is not None and bufs.param_ptrs != self.tp_model.param_ptrs():
            bufs.graph = None  # the weights moved: recaptured at the next decode
        valid = attention_mask.bool()
        bufs.kv_valid.zero_()
        bufs.kv_valid[:, :P] = valid
        pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        dev = self.device
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        eye = torch.eye(P, P, dtype=torch.bool, device=dev)
        # over slots 0 .. P-1 only (the rest is empty); padding sees itself only
        mask = (causal & valid[:, None, None, :]) | eye
        slots = torch.arange(P, device=dev)
        return self.tp_model.forward(input_ids, pos, bufs.cache, mask, slots)

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
            if bufs.graph is None:
                self._capture(bufs)
            bufs.graph.replay()
            return bufs.logits
        return self._step(bufs)

    @torch.no_grad()
    def rollout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None,
        pad_token_id: int | None,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        pick=None,
        sync_every: int = 8,
    ) -> RolloutOutput:
        """See :func:`verl_ppo.rollout.generate.decode_loop` (``pick``: the TP path's
        sample-and-broadcast). With the graph on, where the one-pass sampler draws and
        without ``pick``, each decode step is one replay of a graph that also draws and
        keeps the books (:func:`verl_ppo.rollout.graph_loop.graph_rollout`, same tokens).

        Raises:
            ValueError: bad shapes, or ``P + max_new_tokens`` exceeds ``max_seq_len``.
        """
        check_prompts(input_ids, attention_mask)
        P = input_ids.shape[1]
        if P + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt {P} + max_new_tokens {max_new_tokens} exceeds the static cache "
                f"max_seq_len={self.max_seq_len}; build the decoder with a larger max_seq_len"
            )
        loop_kw = dict(
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            params=params,
            generator=generator,
            sync_every=sync_every,
        )
        if (
            pick is None
            and self.use_cuda_graph
            and fused_sampler_on(self.device, params, generator)
        ):
            B = input_ids.shape[0]
            bufs = self._buffers(B)
            if B not in self._loops:
                self._loops[B] = LoopBuffers.new(B, self.max_seq_len, self.device)
            self.tp_model.refresh_fused()
            return graph_rollout(
                lambda: self._step(bufs),
                lambda: self._prefill(bufs, input_ids, attention_mask),
                (bufs.tok, bufs.pos, bufs.slot),
                self._loops[B],
                input_ids,
                attention_mask,
                param_ptrs=self.tp_model.param_ptrs(),
                on_capture=self._count_capture,
                **loop_kw,
            )
        return decode_loop(
            lambda: self.prefill(input_ids, attention_mask),
            lambda tok, pos, t: self.decode(tok, pos, P + t),
            input_ids,
            attention_mask,
            pick=pick,
            **loop_kw,
        )

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw) -> torch.Tensor:
        """:meth:`rollout`'s sequences; keywords as :func:`verl_ppo.rollout.generate.generate`
        (``do_sample, temperature, top_p, top_k``) plus ``sync_every``."""
        return self.rollout(input_ids, attention_mask, **sampling_kwargs(kw)).sequences


def decoder_for(
    current: StaticCacheDecoder | None,
    model: Any,
    prompt_len: int,
    max_new_tokens: int,
    use_cuda_graph: bool,
    round_to: int = 64,
) -> StaticCacheDecoder:
    """``current`` if it serves ``model`` and has room for ``prompt_len + max_new_tokens``,
    else a new decoder with that length rounded up to ``round_to`` (fewer re-captures when
    prompt lengths vary). The trainer keeps the returned object between steps; a
    :class:`TPCausalLM` of the same shape (the hybrid engine's new shards) is swapped in
    (:meth:`StaticCacheDecoder.retarget`), keeping the cache.

    Raises:
        ValueError / RuntimeError: as :class:`StaticCacheDecoder`.
    """
    need = prompt_len + max_new_tokens
    inner = getattr(model, "module", model)
    if (
        current is not None
        and current.max_seq_len >= need
        and current.use_cuda_graph == use_cuda_graph
    ):
        if current.source is inner:
            return current
        if isinstance(inner, TPCausalLM) and isinstance(current.source, TPCausalLM):
            same = inner.config is current.source.config and inner.tp is current.source.tp
            if same and inner.dtype == current.source.dtype:
                current.retarget(inner)
                return current
    cap = -(-need // round_to) * round_to
    return StaticCacheDecoder(model, max_seq_len=cap, use_cuda_graph=use_cuda_graph)
