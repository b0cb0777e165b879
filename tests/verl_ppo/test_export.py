"""Hugging Face export: from_pretrained gives the trained actor's logits (and critic's values)
exactly (tiny model, CPU, fp32), from a live engine (ZeRO-0 and ZeRO-3) and from a checkpoint."""

import pytest
import torch

from tests._models import tiny_causal_lm
from tests.verl_ppo._run import last_json, run_job, run_python
from verl_ppo.run.export import (
    ExportError,
    export_checkpoint,
    find_checkpoint,
    gather_state_dict,
    save_model_meta,
    write_causal_lm,
    write_value_model,
)


def _tiny_policy(seed=0):
    m = tiny_causal_lm("llama", seed=seed, vocab_size=49152, tie_word_embeddings=True)
    return m.float().eval()


def _load(path, critic=False):
    """from_pretrained, then each tensor copied out of the memory-mapped file: a tensor at
    an offset that is not 64-byte aligned can take another CPU matmul kernel (the critic's
    Linear(h, 1) differed by 1 ulp with identical bits), which is not what we test here."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    model = cls.from_pretrained(path).eval()
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()
    return model


@torch.no_grad()
def test_write_and_load_actor_and_critic_exactly(tmp_path):
    from transformers import AutoTokenizer

    from verl_ppo.data.model_store import ensure_smollm2
    from verl_ppo.workers.models import build_value_model

    policy = _tiny_policy()
    meta = save_model_meta(tmp_path, policy.config, ensure_smollm2(), policy.generation_config)
    sd, stats = gather_state_dict(policy, rank=0)
    assert stats["buckets"] == 0  # nothing partitioned: no collective
    out = write_causal_lm(sd, meta, tmp_path / "hf" / "actor")
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    ids = torch.randint(0, 49152, (2, 9))
    assert torch.equal(_load(out)(ids).logits, policy(ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    critic = build_value_model(policy, torch.float32).eval()
    torch.nn.init.normal_(critic.value_head.weight)  # a head that is not all zeros
    torch.nn.init.normal_(critic.value_head.bias)
    sd, _ = gather_state_dict(critic, rank=0)
    cdir = write_value_model(sd, meta, tmp_path / "hf" / "critic")
    mask = torch.ones_like(ids)
    got = _load(cdir, critic=True)(ids, attention_mask=mask).logits[..., 0]
    # bit-equality is the property (the export is exact): the same backbone class on the same
    # bits, then one Linear(h, 1) on the same hidden states: the same kernels on any CPU, once
    # the memory-offset dependence is removed (_load)
    assert torch.equal(got, critic(ids, mask))


@torch.no_grad()
def test_strategy_gathering_itself_is_used_and_a_tied_name_may_be_missing(tmp_path):
    """The hook a pipeline strategy plugs in (``full_state_dict()``, stages gathered by it):
    its dict is what gets written, and naming the tied embedding once is enough."""
    from verl_ppo.data.model_store import ensure_smollm2
    from verl_ppo.run.export import engine_state_dict

    policy = _tiny_policy(seed=3)
    meta = save_model_meta(tmp_path, policy.config, ensure_smollm2(), policy.generation_config)

    class StagesStrategy:
        calls = 0

        def full_state_dict(self):
            StagesStrategy.calls += 1
            sd = {k: v.clone() for k, v in policy.state_dict().items()}
            del sd["lm_head.weight"]  # the stages hold the tied tensor under one name
            return sd

    sd, _ = engine_state_dict(StagesStrategy(), rank=0)
    out = write_causal_lm(sd, meta, tmp_path / "actor")
    assert StagesStrategy.calls == 1
    ids = torch.randint(0, 49152, (2, 5))
    assert torch.equal(_load(out)(ids).logits, policy(ids).logits)


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(ExportError, match="no step 7; complete checkpoints: none"):
        find_checkpoint(tmp_path, 7)
    with pytest.raises(ExportError, match="model_config is missing"):
        export_checkpoint(tmp_path, tmp_path / "out")


SCRIPT = """
import json, sys, torch
from verl_ppo import PPOTrainer
from verl_ppo.run.export import export_checkpoint
from transformers import AutoModelForCausalLM as LM, AutoModelForTokenClassification as TC

def aligned(model):  # see _load in the test file
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()
    return model

run = sys.argv[1]
t = PPOTrainer("configs/tiny.yaml", run_dir=run, **{"comm.nproc": 1,
    "train.num_steps": 1, "data.eval_size": 0, "actor.zero_stage": 3, "critic.zero_stage": 0,
    "train.export_critic": True})
t.run()
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 49152, (2, 11), generator=g)
mask = torch.ones_like(ids)
mask[0, :3] = 0
pos = (mask.cumsum(-1) - 1).clamp_min(0)
with torch.no_grad():
    t.actor.module.eval()
    t.critic.module.eval()
    logits = t.actor.module(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    values = t.critic.module(ids, mask)
zero3 = all(hasattr(p, "ds_id") for p in t.actor.module.parameters())
t.close()
export_checkpoint(run, run + "/from_ckpt", critic=True)
res = {"zero3": zero3, "trained_head": bool(values.abs().max() > 0)}
with torch.no_grad():
    for name, d in (("live", run + "/hf"), ("ckpt", run + "/from_ckpt")):
        actor = d + "/actor" if name == "live" else d
        m = aligned(LM.from_pretrained(actor).eval())
        res[name + "_logits"] = torch.equal(
            m(input_ids=ids, attention_mask=mask, position_ids=pos).logits, logits)
        c = aligned(TC.from_pretrained(d + "/critic").eval())
        got = c(ids, attention_mask=mask, position_ids=pos).logits[..., 0]
        res[name + "_values"] = torch.equal(got, values)
print(json.dumps(res))
"""


@pytest.mark.timeout(600)
def test_export_of_zero3_actor_and_zero0_critic_gives_the_trained_logits(tmp_path):
    """One process (a one-rank group): the actor under ZeRO-3 (gathered bucket by bucket;
    from the checkpoint via DeepSpeed's zero_to_fp32), the critic under ZeRO-0."""
    res = last_json(run_python(SCRIPT, str(tmp_path)))
    assert res == {
        "zero3": True,
        "trained_head": True,  # the critic's head left zero would make any values match
        "live_logits": True,
        "live_values": True,
        "ckpt_logits": True,
        "ckpt_values": True,
    }


@pytest.mark.timeout(600)
def test_two_rank_zero3_export_equals_checkpoint_export(tmp_path):
    """2 gloo ranks, ZeRO-3 actor and critic: the end-of-run export (live all-gathers of
    each rank's partition) and `verl-ppo export` of the checkpoint give identical models."""
    r = run_job(
        [
            "--config",
            "configs/tiny.yaml",
            f"run_dir={tmp_path}",
            "train.num_steps=1",
            "data.eval_size=0",
            "rollout.ignore_eos=true",  # same number of ZeRO-3 forwards on both ranks
            "actor.zero_stage=3",
            "critic.zero_stage=3",
            "train.export_critic=true",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    from verl_ppo.cli import main

    assert main(["export", str(tmp_path), "--step", "1", str(tmp_path / "out"), "--critic"]) == 0
    ids = torch.randint(0, 49152, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        live, ckpt = _load(tmp_path / "hf" / "actor"), _load(tmp_path / "out")
        assert torch.equal(live(ids).logits, ckpt(ids).logits)
        live_c = _load(tmp_path / "hf" / "critic", critic=True)
        ckpt_c = _load(tmp_path / "out" / "critic", critic=True)
        assert torch.equal(live_c(ids).logits, ckpt_c(ids).logits)
