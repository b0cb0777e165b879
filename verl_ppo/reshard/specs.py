"""Shard specs: which box of every parameter each rank holds in a layout.

Covers the Llama family (Llama, SmolLM2, Qwen2, Mistral: separate q/k/v/o and
gate/up/down, GQA, optional q/k/v biases, tied or untied embeddings) and GPT-2
(fused ``c_attn`` Conv1D weight of shape ``(hidden, 3 * hidden)``, split per q/k/v
component). Megatron-LM's splits (Shoeybi et al. 2019): column-parallel q/k/v/gate/up
on the output dim, row-parallel o/down on the input dim, vocabulary-parallel
embedding and lm_head, norms and row-parallel biases replicated. Pipeline stages own
contiguous layer ranges (embeddings on the first stage, final norm and lm_head on the
last, a tied embedding on both). ZeRO-3 partitions the flat storage of each (TP-local)
parameter into ``ceil(numel / dp)`` chunks, as DeepSpeed's ``ds_tensor`` does.

A holding is a :class:`Shard`: the local storage (``numel`` elements; a ZeRO-3
partition is 1-D and padded) and :class:`Piece` s, each mapping a box of the global
tensor to a strided view of that storage. Everything here is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from verl_ppo.job.model_dims import ModelDims, model_dims  # noqa: F401 (re-exported)
from verl_ppo.job.model_family import GPT2_NAMES, LLAMA_NAMES
from verl_ppo.reshard.layout import ParallelLayout, stage_layer_range

Box = tuple[tuple[int, int], ...]
"""Half-open index ranges, one ``(start, stop)`` per dim of the global tensor."""


@dataclass(frozen=True)
class Component:
    """A contiguous block of the split dim made of ``n_units`` units of ``unit`` elements
    (attention heads of ``head_dim``, or single rows/columns), starting at ``offset``."""

    offset: int
    n_units: int
    unit: int


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is split.

    Attributes:
        name: HF parameter name (``model.layers.3.self_attn.q_proj.weight``).
        shape: global shape.
        split: ``"replicated"``, ``"column"``, ``"row"`` or ``"vocab"``.
        dim: the split dim (None when replicated).
        components: blocks of the split dim split independently (three for GPT-2 c_attn).
        owner: ``"layer"``, ``"embed"`` (first stage; also last when tied), ``"first"``
            (first stage only) or ``"last"`` (last stage).
        layer: decoder layer index when ``owner == "layer"``.
    """

    name: str
    shape: tuple[int, ...]
    split: str
    dim: int | None
    components: tuple[Component, ...]
    owner: str
    layer: int | None = None

    @property
    def numel(self) -> int:
        """Element count of the global tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Global box ``gbox`` stored in a rank's local storage at ``offset`` with ``strides``
    (elements), i.e. ``storage.as_strided(box_shape(gbox), strides, offset)``."""

    gbox: Box
    offset: int
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one parameter.

    Attributes:
        local_shape: shape of the local tensor (``(numel,)`` for a ZeRO-3 partition).
        numel: element count of the local storage (ZeRO-3: padded partition size).
        pieces: disjoint global boxes and where they sit in the storage.
    """

    local_shape: tuple[int, ...]
    numel: int
    pieces: tuple[Piece, ...]


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of ``box`` per dim."""
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    """Element count of ``box``."""
    return math.prod(box_shape(box))


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or None when empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides (elements) of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def _spec(name, shape, split, dim, comps, owner, layer=None) -> ParamSpec:
    return ParamSpec(name, tuple(shape), split, dim, tuple(comps), owner, layer)


def _llama_specs(config: Any, d: ModelDims) -> list[ParamSpec]:
    qkv_bias = d.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    o_bias = d.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    h, hd, nq, nkv, inter = d.hidden, d.head_dim, d.heads, d.kv_heads, d.intermediate
    qc, kvc, ic = Component(0, nq, hd), Component(0, nkv, hd), Component(0, inter, 1)
    n, rep = LLAMA_NAMES, "replicated"
    vocab = [Component(0, d.vocab, 1)]
    specs = [_spec(n.embed_weight(), (d.vocab, h), "vocab", 0, vocab, "embed")]
    for i in range(d.num_layers):
        L = []
        for proj, comp, rows in (("q", qc, nq * hd), ("k", kvc, nkv * hd), ("v", kvc, nkv * hd)):
            L.append(_spec(n.param(i, proj), (rows, h), "column", 0, [comp], "layer", i))
            if qkv_bias:
                L.append(_spec(n.param(i, proj, "bias"), (rows,), "column", 0, [comp], "layer", i))
        L.append(_spec(n.param(i, "o"), (h, nq * hd), "row", 1, [qc], "layer", i))
        if o_bias:
            L.append(_spec(n.param(i, "o", "bias"), (h,), rep, None, [], "layer", i))
        for proj in ("gate", "up"):
            L.append(_spec(n.param(i, proj), (inter, h), "column", 0, [ic], "layer", i))
            if mlp_bias:
                L.append(_spec(n.param(i, proj, "bias"), (inter,), "column", 0, [ic], "layer", i))
        L.append(_spec(n.param(i, "down"), (h, inter), "row", 1, [ic], "layer", i))
        if mlp_bias:
            L.append(_spec(n.param(i, "down", "bias"), (h,), rep, None, [], "layer", i))
        for norm in ("attn_norm", "mlp_norm"):
            L.append(_spec(n.param(i, norm), (h,), rep, None, [], "layer", i))
        specs += L
    specs.append(_spec(f"{n.norm()}weight", (h,), rep, None, [], "last"))
    if not d.tied:
        specs.append(_spec(n.head_weight(), (d.vocab, h), "vocab", 0, vocab, "last"))
    return specs


def _gpt2_specs(config: Any, d: ModelDims) -> list[ParamSpec]:
    h, hd, nh, inner = d.hidden, d.head_dim, d.heads, d.intermediate
    qkv = [Component(0, nh, hd), Component(h, nh, hd), Component(2 * h, nh, hd)]
    ic = Component(0, inner, 1)
    n_pos = getattr(config, "n_positions", 1024)
    n, rep = GPT2_NAMES, "replicated"
    vocab = [Component(0, d.vocab, 1)]
    specs = [
        _spec(n.embed_weight(), (d.vocab, h), "vocab", 0, vocab, "embed"),
        _spec(f"{n.base}wpe.weight", (n_pos, h), rep, None, [], "first"),
    ]
    for i in range(d.num_layers):
        specs += [
            _spec(n.param(i, "attn_norm"), (h,), rep, None, [], "layer", i),
            _spec(n.param(i, "attn_norm", "bias"), (h,), rep, None, [], "layer", i),
            _spec(n.param(i, "qkv"), (h, 3 * h), "column", 1, qkv, "layer", i),
            _spec(n.param(i, "qkv", "bias"), (3 * h,), "column", 0, qkv, "layer", i),
            _spec(n.param(i, "o"), (h, h), "row", 0, [Component(0, nh, hd)], "layer", i),
            _spec(n.param(i, "o", "bias"), (h,), rep, None, [], "layer", i),
            _spec(n.param(i, "mlp_norm"), (h,), rep, None, [], "layer", i),
            _spec(n.param(i, "mlp_norm", "bias"), (h,), rep, None, [], "layer", i),
            _spec(n.param(i, "fc"), (h, inner), "column", 1, [ic], "layer", i),
            _spec(n.param(i, "fc", "bias"), (inner,), "column", 0, [ic], "layer", i),
            _spec(n.param(i, "proj"), (inner, h), "row", 0, [ic], "layer", i),
            _spec(n.param(i, "proj", "bias"), (h,), rep, None, [], "layer", i),
        ]
    specs += [
        _spec(f"{n.norm()}weight", (h,), rep, None, [], "last"),
        _spec(f"{n.norm()}bias", (h,), rep, None, [], "last"),
    ]
    if not d.tied:
        specs.append(_spec(n.head_weight(), (d.vocab, h), "vocab", 0, vocab, "last"))
    return specs


def model_param_specs(config: Any) -> tuple[ParamSpec, ...]:
    """Specs of every unique parameter (tied lm_head omitted), in HF ``named_parameters``
    order for the supported families.

    Raises:
        ValueError: unsupported ``model_type``.
    """
    d = model_dims(config)
    specs = _gpt2_specs(config, d) if d.model_type == "gpt2" else _llama_specs(config, d)
    return tuple(specs)


# ---- validation ----------------------------------------------------------------------
def validate_tp(dims: ModelDims, tp: int, role: str) -> None:
    """Check that ``tp`` splits heads, KV heads (or replicates them), intermediate size
    and vocabulary evenly.

    Raises:
        ValueError: naming the numbers and the TP degrees the model allows.
    """
    if tp == 1:
        return
    allowed = [t for t in range(1, dims.heads + 1) if _tp_ok(dims, t)]
    hint = f"{dims.model_type} allows TP in {allowed}"
    if dims.heads % tp:
        raise ValueError(
            f"{role}.tensor_parallel_size={tp} does not divide the {dims.heads} attention heads "
            f"({dims.kv_heads} KV heads); {hint}"
        )
    if dims.kv_heads % tp and tp % dims.kv_heads:
        raise ValueError(
            f"{role}.tensor_parallel_size={tp} neither divides nor is a multiple of the "
            f"{dims.kv_heads} KV heads ({dims.heads} heads); {hint}"
        )
    if dims.intermediate % tp:
        raise ValueError(
            f"{role}.tensor_parallel_size={tp} does not divide intermediate size "
            f"{dims.intermediate}; {hint}"
        )
    if dims.vocab % tp:
        raise ValueError(
            f"{role}.tensor_parallel_size={tp} does not divide vocabulary size {dims.vocab}; "
            f"pad the vocabulary to a multiple of {tp} or use TP in {allowed}"
        )


def _tp_ok(d: ModelDims, t: int) -> bool:
    return (
        d.heads % t == 0
        and (d.kv_heads % t == 0 or t % d.kv_heads == 0)
        and d.intermediate % t == 0
        and d.vocab % t == 0
    )


def validate_layout(dims: ModelDims, layout: ParallelLayout, world_size: int, role: str) -> None:
    """Check a layout against the world size and the model.

    Raises:
        ValueError: product of degrees != world size, TP not splitting the model
            (see :func:`validate_tp`), PP greater than the layer count, or ZeRO-3 combined
            with PP (DeepSpeed's pipeline engine supports ZeRO 0/1 only).
    """
    if layout.world_size != world_size:
        raise ValueError(
            f"{role}: pipeline_parallel_size {layout.pp} x data_parallel_size {layout.dp} x "
            f"tensor_parallel_size {layout.tp} = {layout.world_size} != world size {world_size}"
        )
    validate_tp(dims, layout.tp, role)
    if layout.pp > dims.num_layers:
        raise ValueError(
            f"{role}.pipeline_parallel_size={layout.pp} exceeds the model's {dims.num_layers} "
            f"layers; use at most {dims.num_layers}"
        )
    if layout.zero_stage == 3 and layout.pp > 1:
        raise ValueError(
            f"{role}: zero_stage=3 with pipeline_parallel_size={layout.pp} is not supported "
            "(DeepSpeed's pipeline engine runs ZeRO stage 0 or 1); set zero_stage <= 2"
        )


# ---- boxes per rank ------------------------------------------------------------------
def _unit_range(n_units: int, tp: int, t: int) -> tuple[int, int]:
    if n_units % tp == 0:
        per = n_units // tp
        return t * per, (t + 1) * per
    rep = tp // n_units  # replicated (GQA KV heads when TP is a multiple of them)
    return t // rep, t // rep + 1


def tp_pieces(spec: ParamSpec, tp: int, t: int) -> tuple[tuple[int, ...], list[tuple[Box, Box]]]:
    """TP-local shape and ``(global box, local box)`` pairs for TP rank ``t`` of ``tp``.

    Fused components (GPT-2 c_attn) are concatenated along the split dim in order.
    """
    full: Box = tuple((0, s) for s in spec.shape)
    if spec.split == "replicated" or tp == 1:
        return spec.shape, [(full, full)]
    d = spec.dim
    pairs, local_off = [], 0
    for c in spec.components:
        u0, u1 = _unit_range(c.n_units, tp, t)
        g0, g1 = c.offset + u0 * c.unit, c.offset + u1 * c.unit
        gbox = full[:d] + ((g0, g1),) + full[d + 1 :]
        lbox = full[:d] + ((local_off, local_off + g1 - g0),) + full[d + 1 :]
        pairs.append((gbox, lbox))
        local_off += g1 - g0
    shape = list(spec.shape)
    shape[d] = local_off
    return tuple(shape), pairs


def _flat_range_boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    """Decompose flat row-major range ``[a, b)`` of ``shape`` into boxes, each contiguous."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [((a, b),)]
    inner = math.prod(shape[1:])
    r0, r1 = a // inner, (b - 1) // inner
    if r0 == r1:
        return [
            ((r0, r0 + 1),) + bx
            for bx in _flat_range_boxes(shape[1:], a - r0 * inner, b - r0 * inner)
        ]
    out: list[Box] = []
    full_inner = tuple((0, s) for s in shape[1:])
    first_full, last_full = r0, r1 + 1
    if a % inner:
        out += [((r0, r0 + 1),) + bx for bx in _flat_range_boxes(shape[1:], a % inner, inner)]
        first_full = r0 + 1
    if b % inner:
        last_full = r1
    if first_full < last_full:
        out.append(((first_full, last_full),) + full_inner)
    if b % inner:
        out += [((r1, r1 + 1),) + bx for bx in _flat_range_boxes(shape[1:], 0, b - r1 * inner)]
    return out


def _local_to_global(pairs: list[tuple[Box, Box]], lbox: Box) -> list[tuple[Box, Box]]:
    """Split a local box across the TP pieces; returns ``(global box, local box)`` pairs."""
    out = []
    for gbox, pl in pairs:
        sub = intersect(pl, lbox)
        if sub is None:
            continue
        g = tuple((g0 + s0 - l0, g0 + s1 - l0) for (s0, s1), (l0, _), (g0, _) in zip(sub, pl, gbox))
        out.append((g, sub))
    return out


def holds_param(spec: ParamSpec, layout: ParallelLayout, stage: int, dims: ModelDims) -> bool:
    """Whether pipeline ``stage`` of ``layout`` holds ``spec`` at all.

    A tied embedding lives on the first and the last stage (Megatron-LM keeps a copy on
    both and all-reduces its gradient).
    """
    last = layout.pp - 1
    if spec.owner == "layer":
        return spec.layer in stage_layer_range(dims.num_layers, layout.pp, stage)
    if spec.owner == "first":
        return stage == 0
    if spec.owner == "last":
        return stage == last
    if spec.owner == "embed":
        return stage == 0 or (dims.tied and stage == last)
    raise ValueError(f"unknown owner {spec.owner!r} for {spec.name}")


def shard_for(spec: ParamSpec, layout: ParallelLayout, rank: int, dims: ModelDims) -> Shard | None:
    """What ``rank`` holds of ``spec`` in ``layout`` (None when nothing).

    Under ZeRO-3 the storage is the rank's
    1-D flat partition of the TP-local tensor, padded to ``ceil(numel / dp)``.
    """
    pp, dp, tp = layout.coords(rank)
    if not holds_param(spec, layout, pp, dims):
        return None
    local_shape, pairs = tp_pieces(spec, layout.tp, tp)
    strides = contiguous_strides(local_shape)

    def offset(lbox: Box) -> int:
        return sum(lo * s for (lo, _), s in zip(lbox, strides))

    if layout.zero_stage != 3 or layout.dp == 1:
        pieces = tuple(Piece(g, offset(lb), strides) for g, lb in pairs)
        return Shard(local_shape, math.prod(local_shape), pieces)
    n = math.prod(local_shape)
    ps = -(-n // layout.dp)
    a, b = min(dp * ps, n), min((dp + 1) * ps, n)
    pieces = []
    for lbox in _flat_range_boxes(local_shape, a, b):
        for g, sub in _local_to_global(pairs, lbox):
            pieces.append(Piece(g, offset(sub) - a, strides))
    return Shard((ps,), ps, tuple(pieces))


def piece_view(storage: torch.Tensor, piece: Piece) -> torch.Tensor:
    """Strided view of ``piece`` in a rank's 1-D contiguous ``storage`` (no copy)."""
    return storage.as_strided(
        box_shape(piece.gbox), piece.strides, storage.storage_offset() + piece.offset
    )


def slice_shard(full: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Build the local tensor of ``shard`` from the full parameter (a copy; ZeRO-3 padding
    is zero). Used to construct training layouts in tests and to check results.

    Args:
        full: global tensor, shape = the spec's shape, any dtype/device.

    Returns:
        contiguous tensor of shape ``shard.local_shape``.
    """
    out = torch.zeros(shard.numel, dtype=full.dtype, device=full.device)
    for p in shard.pieces:
        piece_view(out, p).copy_(full[tuple(slice(a, b) for a, b in p.gbox)])
    return out.view(shard.local_shape)
