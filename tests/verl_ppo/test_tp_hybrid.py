"""TP rollout model and the hybrid engine context manager (CPU; TP1 in-process, TP2 on 2 gloo ranks)."""

import pytest
import torch

from tests._models import causal_lm, left_padded_prompts
from verl_comm.distributed.launch import spawn
from verl_ppo.reshard.config import HybridEngineConfig
from verl_ppo.reshard.layout import ParallelLayout
from verl_ppo.reshard.testing import tiny_config
from verl_ppo.rollout.tp_generate import filter_logits, tp_generate
from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup

GEN = dict(do_sample=False, eos_token_id=1, pad_token_id=2)


PROMPTS = dict(vocab=(3, 64), pads={0: 3, 1: 1}, pad_id=2)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_tp1_greedy_matches_hf(kind):
    model = causal_lm(tiny_config(kind), train=False)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    ids, mask = left_padded_prompts(1, (3, 7), **PROMPTS)
    got = tp_generate(TPCausalLM(model.config, weights, TPGroup.single()), ids, mask, 10, **GEN)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=10, **GEN))


def test_filter_logits_top_k_top_p():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)[0, :2]).all()
    kept = filter_logits(logits, 1.0, 0, 0.5)  # top token alone has p = 0.64 >= 0.5
    assert torch.isfinite(kept).sum() == 1 and torch.isfinite(kept[0, 3])
    with pytest.raises(ValueError, match="temperature"):
        filter_logits(logits, 0.0, 0, 1.0)


def worker_hybrid(rank, world):
    from verl_ppo.reshard.hybrid import HybridEngine

    res = {}
    for kind, training in (("qwen2", {}), ("gpt2", {"pipeline_parallel_size": 2})):
        model = causal_lm(tiny_config(kind), train=False)
        cfg = HybridEngineConfig(
            enable=True, rollout_sharding={"tensor_parallel_size": 2}, training_sharding=training
        )
        train = ParallelLayout(pp=training.get("pipeline_parallel_size", 1))
        train = ParallelLayout(train.pp, world // train.pp)
        hybrid = HybridEngine.build(model.config, cfg, train)
        ids, mask = left_padded_prompts(
            10 + rank, (2 + rank, 6 + rank), **PROMPTS
        )  # ranks differ in B and P
        # a full model holds every stage's tensors: the engine reads this rank's stage
        with hybrid.rollout(dict(model.named_parameters())) as rm:
            m_in = mask if kind == "qwen2" else mask.bool()  # int or bool masks
            got = rm.generate(ids, m_in, max_new_tokens=8, **GEN)
            # sampling happens on TP index 0 and is broadcast: the other member's RNG
            # state must not matter, and both members must agree on every token
            kw = dict(
                max_new_tokens=8,
                do_sample=True,
                top_k=20,
                top_p=0.9,
                eos_token_id=1,
                pad_token_id=2,
            )
            s1 = rm.generate(ids, mask, generator=torch.Generator().manual_seed(1000 + rank), **kw)
            s2 = rm.generate(
                ids, mask, generator=torch.Generator().manual_seed(1000 + 7 * rank), **kw
            )
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GEN)
        res[f"{kind}_greedy_equal"] = got.shape[1] <= ref.shape[1] and torch.equal(
            got, ref[:, : got.shape[1]]
        )
        res[f"{kind}_greedy_shapes"] = (tuple(got.shape), tuple(ref.shape))
        res[f"{kind}_sampled_same_on_tp_members"] = torch.equal(s1, s2) and torch.equal(
            s1[:, : 6 + rank], ids
        )
        res[f"{kind}_metrics"] = dict(hybrid.last_metrics)
        try:
            rm.generate(ids, mask, max_new_tokens=2, **GEN)
            res[f"{kind}_released"] = False
        except RuntimeError:
            res[f"{kind}_released"] = True
    res["zero3"] = _zero3_deepspeed(rank, world)
    try:  # modifying training weights inside the block is refused on leaving
        with hybrid.rollout(dict(model.named_parameters())):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        res["modify_error"] = ""
    except RuntimeError as e:
        res["modify_error"] = str(e)
    return res


def _zero3_deepspeed(rank, world):
    """A real DeepSpeed ZeRO-3 engine: the hybrid engine reads its ds_tensor partitions."""
    import copy
    import os

    import deepspeed

    from verl_ppo.reshard.hybrid import HybridEngine, named_parameters
    from verl_ppo.workers.strategy import data_parallel_layout

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    model = causal_lm(tiny_config("qwen2"), seed=3, train=False)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    partitioned = all(p.numel() == 0 for p in engine.module.parameters())
    cfg = HybridEngineConfig(enable=True, rollout_sharding={"tensor_parallel_size": 2})
    hybrid = HybridEngine.build(ref.config, cfg, data_parallel_layout(engine))  # ZeRO-3 from DS
    ids, mask = left_padded_prompts(20 + rank, (3, 7), **PROMPTS)
    with hybrid.rollout(named_parameters(engine)) as rm:
        got = rm.generate(ids, mask, max_new_tokens=6, **GEN)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    m = hybrid.last_metrics
    out = {
        "partitioned": partitioned,
        "equal": torch.equal(got, want[:, : got.shape[1]]),
        "bytes": m["reshard/bytes_per_rank"],
        "lower": m["reshard/lower_bound_bytes"],
    }
    del engine, model, opt
    return out


def test_hybrid_engine_two_processes():
    res = spawn(f"{__file__}:worker_hybrid", 2, timeout_s=300)
    for r in res:
        for kind in ("qwen2", "gpt2"):
            assert r[f"{kind}_greedy_equal"], (kind, r[f"{kind}_greedy_shapes"])
            assert r[f"{kind}_sampled_same_on_tp_members"], kind
            assert r[f"{kind}_released"], kind
            m = r[f"{kind}_metrics"]
            assert m["timing_s/reshard"] > 0 and m["reshard/back_bytes"] == 0
            assert m["reshard/bytes_per_rank"] == m["reshard/lower_bound_bytes"]
            assert m["reshard/bytes_over_lower_bound"] == 1.0
            assert m["reshard/tensor_parallel_size"] == 2
            assert any(k.startswith("memory/enter_before_") for k in m)
            assert any(k.startswith("memory/exit_after_") for k in m)
        assert r["qwen2_metrics"]["reshard/bytes_per_rank"] == 0  # DP2 -> TP2: all local
        assert r["gpt2_metrics"]["reshard/bytes_per_rank"] > 0  # PP2 -> TP2
        assert "modified inside hybrid.rollout()" in r["modify_error"]
        z = r["zero3"]
        assert z["partitioned"] and z["equal"] and z["bytes"] == z["lower"] > 0, z


def test_single_rank_reshard_aliases_training_weights():
    """World size 1, TP 1: with alias the rollout shards are the training tensors (no copy)."""
    from verl_ppo.reshard.engine import ReshardEngine
    from verl_ppo.reshard.layout import ParallelLayout

    model = causal_lm(tiny_config("llama"), train=False)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    for alias in (True, False):
        eng = ReshardEngine(model.config, ParallelLayout(), ParallelLayout(), alias=alias)
        out = eng.reshard(weights)
        same = [out[n].data_ptr() == w.data_ptr() for n, w in weights.items()]
        assert all(same) if alias else not any(same)
        assert all(torch.equal(out[n], w) for n, w in weights.items())
        s = eng.last_stats
        assert s.bytes_received == 0 and s.buckets == 0
        assert s.peak_extra_bytes == (0 if alias else s.rollout_bytes)
    ids, mask = left_padded_prompts(5, (3, 7), **PROMPTS)
    got = tp_generate(TPCausalLM(model.config, out, TPGroup.single()), ids, mask, 6, **GEN)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN))
