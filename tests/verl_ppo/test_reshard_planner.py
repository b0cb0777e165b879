"""Pure tests of layouts, shard specs, the planner and the config (no process group)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from verl_ppo.reshard.config import HybridEngineConfig
from verl_ppo.reshard.engine import build_plan
from verl_ppo.reshard.layout import ParallelLayout as L
from verl_ppo.reshard.layout import stage_layer_range
from verl_ppo.reshard.planner import choose_rollout_order, make_buckets, make_plan
from verl_ppo.reshard.specs import (
    box_numel,
    model_dims,
    model_param_specs,
    piece_view,
    shard_for,
    slice_shard,
)
from verl_ppo.reshard.testing import random_full_state, tiny_config

PAIRS = [
    (L(pp=2, dp=2), L(tp=4)),
    (L(tp=4, dp=2), L(tp=2, dp=4)),
    (L(pp=2, dp=2, tp=2), L(tp=4, dp=2)),
    (L(dp=4, zero_stage=3), L(tp=2, dp=2)),
    (L(dp=2), L(tp=2)),
]


def test_layout_coordinates_and_groups():
    lay = L(pp=2, dp=2, tp=2)
    assert [lay.coords(r) for r in range(8)][:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(lay.rank_of(*lay.coords(r)) == r for r in range(8))
    assert lay.tp_group(5) == [4, 5] and lay.dp_group(5) == [5, 7] and lay.pp_group(5) == [1, 5]
    assert sorted(sum(lay.all_tp_groups(), [])) == list(range(8))
    perm = L(tp=2, dp=2, rank_order=(0, 2, 1, 3))
    assert perm.tp_group(0) == [0, 2] and perm.coords(2) == (0, 0, 1)
    assert L(tp=2, rank_order=(0, 1)).rank_order is None  # identity normalised
    assert L(pp=2, dp=2).describe() == "PP2xDP2" and L(dp=4, zero_stage=3).describe() == "ZeRO3-DP4"
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        L(tp=0)
    with pytest.raises(ValueError, match="permutation"):
        L(tp=2, rank_order=(0, 0))
    assert [len(stage_layer_range(30, 4, s)) for s in range(4)] == [8, 8, 7, 7]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layer_range(2, 3, 0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_specs_match_hf_parameters(kind):
    cfg = tiny_config(kind)
    model = AutoModelForCausalLM.from_config(cfg)
    got = {s.name: s.shape for s in model_param_specs(cfg)}
    assert got == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_gpt2_fused_c_attn_split_per_component():
    cfg = tiny_config("gpt2")
    specs = {s.name: s for s in model_param_specs(cfg)}
    spec = specs["transformer.h.0.attn.c_attn.weight"]  # (32, 96) = (in, q|k|v)
    full = torch.arange(32 * 96, dtype=torch.float32).view(32, 96)
    for t in range(2):
        got = slice_shard(full, shard_for(spec, L(tp=2), t, model_dims(cfg)))
        want = torch.cat([full[:, c * 32 + t * 16 : c * 32 + (t + 1) * 16] for c in range(3)], 1)
        assert torch.equal(got, want)


def test_gqa_kv_heads_replicated_when_tp_exceeds_them():
    cfg = tiny_config("qwen2")  # 8 heads, 2 KV heads, head_dim 4
    spec = next(s for s in model_param_specs(cfg) if s.name.endswith("0.self_attn.k_proj.weight"))
    boxes = [shard_for(spec, L(tp=4), t, model_dims(cfg)).pieces[0].gbox for t in range(4)]
    assert [b[0] for b in boxes] == [(0, 4), (0, 4), (4, 8), (4, 8)]


def test_zero3_partitions_tile_the_flat_parameter():
    cfg = tiny_config("gpt2")
    dims, specs = model_dims(cfg), model_param_specs(cfg)
    full = random_full_state(specs, seed=3)
    for lay in (L(dp=3, zero_stage=3), L(dp=2, tp=2, zero_stage=3)):
        for spec in specs:
            covered = 0
            for r in range(lay.world_size):
                sh = shard_for(spec, lay, r, dims)
                part = slice_shard(full[spec.name], sh)
                local = spec.numel // (1 if spec.split == "replicated" else lay.tp)
                assert part.shape == (sh.numel,) and sh.numel == -(-local // lay.dp)
                for pc in sh.pieces:  # every piece's strided view equals the global box
                    want = full[spec.name][tuple(slice(a, b) for a, b in pc.gbox)]
                    assert torch.equal(piece_view(part.view(-1), pc), want)
                    covered += box_numel(pc.gbox)
            # each TP rank's DP group tiles its TP shard once; replicated: once per TP rank
            assert covered == spec.numel * (lay.tp if spec.split == "replicated" else 1)


@pytest.mark.parametrize("train,rollout", PAIRS, ids=lambda x: x.describe())
def test_plan_moves_exactly_the_lower_bound(train, rollout):
    cfg = tiny_config("llama")
    plan = build_plan(cfg, train, rollout, train.world_size)
    assert plan.recv_elems == plan.lower_bound_elems
    assert sum(plan.recv_elems) == sum(plan.send_elems) == sum(t.numel for t in plan.transfers)
    for r in range(plan.world_size):  # local + received covers the rollout shard exactly
        got = sum(t.numel for t in plan.local if t.dst == r) + plan.recv_elems[r]
        assert got == plan.rollout_elems[r]
    assert make_plan(plan.train, plan.rollout, plan.specs, model_dims(cfg)) is plan  # cached


def _split_elems(specs, pred=lambda s: True):
    return sum(s.numel for s in specs if s.split != "replicated" and pred(s))


def test_pp2dp2_to_tp4_moves_an_eighth_of_the_split_weights():
    cfg = tiny_config("llama", num_hidden_layers=4, tie_word_embeddings=False)
    plan = build_plan(cfg, L(pp=2, dp=2), L(tp=4), 4)
    specs, dims = plan.specs, model_dims(cfg)
    for r in range(4):
        stage = plan.train.coords(r)[0]
        other = [s for s in specs if shard_for(s, plan.train, r, dims) is None]
        want = sum(s.numel // 4 for s in other if s.split != "replicated")
        want += sum(s.numel for s in other if s.split == "replicated")  # norms: whole
        assert plan.recv_elems[r] == want, (r, stage)
    # the split weights of each stage are half the model's: M_split / 8 per rank
    m_split = _split_elems(specs)
    assert abs(max(plan.recv_elems) - m_split / 8) / m_split < 0.01


def test_tp4dp2_to_tp2dp4_matches_hybridflow_volume():
    cfg = tiny_config("llama")  # 8 heads / 4 KV heads: TP 4 splits every tensor
    plan = build_plan(cfg, L(tp=4, dp=2), L(tp=2, dp=4), 8)
    d_g, p, t = 2, 1, 4  # (d_g - 1) / (p t) x M, HybridFlow Table 2
    m_split = _split_elems(plan.specs)
    assert set(plan.recv_elems) == {(d_g - 1) * m_split // (p * t)}
    assert plan.rollout.rank_order == (0, 2, 1, 3, 4, 6, 5, 7)  # micro-DP groups
    identity = make_plan(
        plan.train, plan.rollout.with_rank_order(None), plan.specs, model_dims(cfg)
    )
    assert max(identity.recv_elems) > max(plan.recv_elems)  # placement matters


def test_buckets_respect_the_cap_and_cover_the_plan():
    cfg = tiny_config("qwen2")
    plan = build_plan(cfg, L(dp=4, zero_stage=3), L(tp=2, dp=2), 4)
    cap = 300
    buckets = make_buckets(plan, cap)
    assert len(buckets) > 1
    for b in buckets:
        load = [0] * 4
        for t in b:
            load[t.src] += t.numel
            load[t.dst] += t.numel
        assert max(load) <= cap
    assert sum(t.numel for b in buckets for t in b) == sum(t.numel for t in plan.transfers)


def test_bad_layouts_name_the_numbers():
    smol = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 does not divide the 9 attention heads.*\[1, 3\]"
    ):
        build_plan(smol, L(dp=2), L(tp=2), 2)
    build_plan(smol, L(dp=3), L(tp=3), 3)  # TP 3 is fine
    cfg = tiny_config("qwen2")
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's 2 layers"):
        build_plan(cfg, L(pp=4), L(tp=4), 4)
    with pytest.raises(ValueError, match="= 4 != world size 8"):
        build_plan(cfg, L(pp=2, dp=2), L(tp=4), 8)
    with pytest.raises(ValueError, match="vocabulary size 63"):
        build_plan(tiny_config("gpt2", vocab_size=63), L(dp=2), L(tp=2), 2)
    with pytest.raises(ValueError, match="neither divides nor is a multiple of the 3 KV heads"):
        build_plan(
            tiny_config("llama", num_key_value_heads=3, num_attention_heads=6, hidden_size=36),
            L(dp=2),
            L(tp=2),
            2,
        )


def test_hybrid_config_keys_and_layouts():
    cfg = HybridEngineConfig.model_validate(
        {
            "enable": True,
            "rollout_sharding": {"tensor_parallel_size": 4},
            "training_sharding": {"pipeline_parallel_size": 2, "data_parallel_size": 2},
        }
    )
    train, roll = cfg.layouts(4)
    assert (train.pp, train.dp, train.tp, roll.tp, roll.dp) == (2, 2, 1, 4, 1)
    assert HybridEngineConfig().layouts(4)[0].dp == 4  # DP inferred
    with pytest.raises(ValueError, match="= 4 != world size 8"):
        cfg.layouts(8)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide world size 6"):
        HybridEngineConfig(rollout_sharding={"tensor_parallel_size": 4}).layouts(6)
    with pytest.raises(ValueError, match="extra"):
        HybridEngineConfig.model_validate({"rollout_sharding": {"tp": 2}})
    with pytest.raises(ValueError):
        HybridEngineConfig(method="gather")


def test_choose_rollout_order_never_worse_than_identity():
    cfg = tiny_config("gpt2")
    dims, specs = model_dims(cfg), model_param_specs(cfg)
    for train, roll in PAIRS[:1] + PAIRS[3:]:
        best = choose_rollout_order(train, roll, specs, dims)
        a = make_plan(train, best, specs, dims).recv_elems
        b = make_plan(train, roll, specs, dims).recv_elems
        assert max(a) <= max(b) and math.isfinite(sum(a))
