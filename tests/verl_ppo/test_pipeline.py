"""PPO on DeepSpeed's pipeline engine (4 gloo ranks, PP2 x DP2) against pure DP4.

Two comparisons, each from the same seed and the same initial weights:

1. The probe (tests/verl_ppo/_pipeline_probe.py): one PPO update of actor and critic
   (2 epochs x 2 mini-batches) on a fixed synthetic batch with O(1) random advantages and
   returns, old and reference log-probs moved off the policy (so the KL loss has a
   gradient). Every weight after it, the actor's first-step gradients before and after
   clipping (ZeRO-0), the gradient norm (ZeRO-1) and the logged losses must agree within
   1e-5 relative (Qwen2's attention key bias: 1e-4, see _rel_bound): this is where the
   pipeline must compute what DP computes (measured: weights <= 7.5e-7, Qwen2's q/v biases
   2.2e-6, its key bias 3.2e-5, ZeRO-0 gradients 2.8e-7, grad norm 6e-8).
2. Five PPO steps of the real loop (same data and rollout: TP1 rollout model in both runs,
   so responses are identical): per-step losses within 1e-5 relative (1e-6 absolute), and
   every tensor of the final actor and critic weights within 1e-5 relative (_rel_bound).
   The workload is chosen so that fp32 rounding is not amplified: the reward is a tiny
   random reward classifier's logit of prompt + response (_reward_folder; std ~1 over
   responses), and the KL is an actor loss term (k3, coefficient 0.01), not a reward.
   With the task's rule reward instead (0 for every response of a random policy) and the
   KL in the reward, the KL (a difference of two log-probs near -10.8 that differ by ~1e-2)
   was the only spread of the rewards, and advantage whitening turned its fp32 rounding
   into O(1e-4) relative errors of O(1) advantages: final weights agreed to only 8e-5
   (llama) / 2e-4 (qwen2); pure DP against itself, with every element of one weight tensor
   (llama layer 0's up_proj) moved by one ulp, ended 0.16 (actor) and 0.89 (critic) apart
   after 5 steps, where this workload gives 1.9e-7 and bit-equal critics.
   Measured here: final weights 3.8e-7 (llama actor), 9e-8 (llama critic), 6.9e-6 (qwen2
   actor: the key bias; other tensors <= 9.6e-7), 5.4e-7 (qwen2 critic); per step, the
   entropy 2e-7 relative, the PPO and KL losses 2.2e-7 and 1.7e-8 absolute (means near
   1e-3 of cancelling terms: whitened advantages, log-prob differences), the value loss and
   the rewards bit-equal. A pipeline that weights every second micro-batch's policy loss
   twice ends 9e-2 apart; one that doubles the first stage's actor gradients, 1e-2.

The same run checks the reshard from the real stage shards (bytes == lower bound computed
from the stage's own parameters, greedy TP2 decoding == the unsharded HF model), the
parameter memory per rank, and the timeout of every group DeepSpeed created.
"""

from __future__ import annotations

import os

import pytest
import torch

from verl_comm.distributed.launch import spawn

pytestmark = pytest.mark.timeout(1200)

TINY = {
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "max_position_embeddings": 256,
    },
}
COMPARE = ("actor/pg_loss", "actor/entropy", "actor/kl", "actor/kl_loss", "critic/vf_loss")
HE = "actor.model_config.hybrid_engine"


def _reward_folder(path: str) -> str:
    """A tiny random BERT sequence classifier with one label, saved with the packaged
    MiniLM tokenizer into ``path``: ``reward.model`` names the folder, and its raw logit of
    prompt + response is the reward (verl_ppo.reward.model.ModelReward, kind classifier).

    Its ``initializer_range`` 0.3 spreads that logit over responses with a standard
    deviation of ~1 (at BERT's default 0.02 the pooled CLS output barely depends on the
    text: std ~2e-5 over random responses)."""
    from tests._models import tiny_reward_classifier

    return tiny_reward_classifier(path, 1, initializer_range=0.3)


def _overrides(kind: str, run_dir: str, pp: int, zero: int, reward: str) -> dict:
    return {
        "config": None,
        "run_dir": run_dir,
        "reward.model": reward,  # a reward of O(1) spread over responses (_reward_folder)
        "model.tiny": TINY[kind],
        "data.eval_size": 0,
        "rollout.max_new_tokens": 6,
        "train.num_steps": 5,
        "train.rollout_batch_size": 8,
        "train.ppo_mini_batch_size": 4,
        "train.micro_batch_size": 1,
        "train.resume": "never",
        # the KL as an actor loss term (it is 0 at step 1, then small against the reward):
        # as a reward it would be the only spread of a near-constant reward (module docstring)
        "algorithm.kl.use_kl_in_reward": False,
        "algorithm.kl.use_kl_loss": True,
        "algorithm.kl.kl_coef": 0.01,
        "algorithm.kl.estimator": "k3",
        "algorithm.entropy_coeff": 0.01,  # the entropy bonus's gradient spans the stages too
        "actor.optim.lr": 1e-3,
        "actor.optim.grad_clip": 0.05,  # clipping active: the norm must span the stages
        "critic.optim.grad_clip": 0.05,
        "actor.zero_stage": zero,
        "critic.zero_stage": zero,
        f"{HE}.enable": True,
        f"{HE}.training_sharding.pipeline_parallel_size": pp,
        f"{HE}.rollout_sharding.tensor_parallel_size": 1,
    }


def _trainer(kind, run_dir, pp, zero):
    from verl_ppo.trainer import PPOTrainer

    ov = _overrides(kind, run_dir, pp, zero, f"{os.path.dirname(run_dir)}/reward_model")
    ov.pop("config")
    return PPOTrainer(None, **ov)


def _full_dp(strategy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in strategy.hf_named_parameters().items()}


def _group_timeouts_ok(engine, timeout_s: float) -> bool:
    """Every group DeepSpeed made for the pipeline carries the job's timeout."""
    grid = engine.grid
    groups = [grid.get_pipe_parallel_group(), grid.get_data_parallel_group()]
    groups.append(grid.get_model_parallel_group())
    ok = True
    for g in groups:
        opts = g._get_backend(torch.device("cpu")).options
        ok &= abs(opts._timeout.total_seconds() - timeout_s) < 1e-6
    return bool(ok)


def worker_equal(rank, world, kind, zero, tmp):
    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    out = {}
    from tests.verl_ppo._pipeline_probe import probe_update

    dp = _trainer(kind, f"{tmp}/dp", 1, zero)
    dp.setup()
    dp_probe = probe_update(dp, rank, world, f"{tmp}/dp_probe")
    dp_hist = dp.run()
    dp_actor, dp_critic = _full_dp(dp.actor.strategy), _full_dp(dp.critic.strategy)
    dp_gas = dp.d.grad_accum_steps
    dp.close()
    del dp

    pp = _trainer(kind, f"{tmp}/pp", 2, zero)
    pp.setup()
    pp_probe = probe_update(pp, rank, world, f"{tmp}/pp_probe")
    pp_hist = pp.run()
    strat = pp.actor.strategy
    out["stage"] = strat.stage
    out["timeouts_ok"] = _group_timeouts_ok(strat.engine, pp.config.comm.timeout_s)
    pp_actor = strat.full_state_dict()
    pp_critic = pp.critic.strategy.full_state_dict()

    def rel(a, b, keys=None):  # per tensor ||a - b|| / ||b||, worst tensor
        return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in (keys or b))

    def rel_max(a, b):  # per tensor max |a - b| / max |b| (reported)
        return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b)

    # the probe: this rank's stage against the same tensors of DP (same rank, same rows)
    out["probe"] = {
        role: {k: rel(pp_probe[role], dp_probe[role], keys=[k]) for k in pp_probe[role]}
        for role in ("actor", "critic", "grads", "raw_grads")
        if pp_probe[role]
    }
    out["probe_n_grads"] = (
        len(pp_probe["grads"]),
        len(pp_probe["raw_grads"]),
        len(pp.actor.strategy.hf_named_parameters()),
    )
    if pp_actor is not None:
        out["actor_keys_equal"] = set(pp_actor) == set(dp_actor)
        out["final"] = {  # per tensor, the whole model (this rank gathered its pipeline's)
            "actor": {k: rel(pp_actor, dp_actor, keys=[k]) for k in dp_actor},
            "critic": {k: rel(pp_critic, dp_critic, keys=[k]) for k in dp_critic},
        }
        out["max_rel"] = (rel_max(pp_actor, dp_actor), rel_max(pp_critic, dp_critic))
    # a logged token-mean loss is one micro-batch's share of its mini-batch's loss (the
    # global token divisor over the DP ranks), averaged over micro-batches: times the
    # micro-batches per mini-batch on a rank it is the mini-batch loss in any layout
    share = {"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"}

    def scaled(h, k, n):
        return None if h.get(k) is None else h[k] * (n if k in share else 1)

    n_dp, n_pp = dp_gas, strat.engine.gradient_accumulation_steps()
    out["probe_metrics"] = {
        k: (scaled(dp_probe["metrics"], k, n_dp), scaled(pp_probe["metrics"], k, n_pp))
        for k in COMPARE[:2]
        + ("actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm", "critic/vf_loss")
    }
    out["steps"] = [
        {
            k: (scaled(a, k, n_dp), scaled(b, k, n_pp))
            for k in COMPARE + ("actor/grad_norm", "reward/mean")
        }
        for a, b in zip(dp_hist, pp_hist)
    ]
    last = pp_hist[-1]
    mine = pp.hybrid.last_metrics  # this rank's (the logged metrics are averaged over ranks)
    out["bytes"] = (mine["reshard/bytes_per_rank"], mine["reshard/lower_bound_bytes"])
    # the lower bound from the real holdings: every parameter of the (TP1) rollout model
    # this rank's stage does not hold
    from verl_ppo.reshard.specs import model_param_specs

    held = strat.hf_named_parameters()
    specs = model_param_specs(pp.policy_config)
    out["lower_from_holdings"] = 4 * sum(s.numel for s in specs if s.name not in held)
    out["stage_param_bytes"] = strat.param_bytes()
    out["full_param_bytes"] = last["memory/policy_full_param_bytes"]
    out["rollout_extra_bytes"] = mine["memory/rollout_extra_param_bytes"]

    # greedy decoding after a reshard to TP2 equals the unsharded HF model
    from transformers import AutoModelForCausalLM

    from verl_ppo.reshard.config import HybridEngineConfig
    from verl_ppo.reshard.hybrid import HybridEngine

    box = [pp_actor]
    dist.broadcast_object_list(box, src=strat.pipe_ranks[0], group=strat.pipe_group)
    hf = AutoModelForCausalLM.from_config(pp.policy_config).eval()
    hf.load_state_dict(box[0], strict=False)
    if pp.policy_config.tie_word_embeddings:
        hf.tie_weights()
    cfg = HybridEngineConfig(enable=True, rollout_sharding={"tensor_parallel_size": 2})
    hyb = HybridEngine.build(pp.policy_config, cfg, strat.layout, ctx=pp.ctx)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, 200, (2, 5), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = pp.tokenizer.pad_token_id, 0
    kw = dict(do_sample=False, eos_token_id=-1, pad_token_id=pp.tokenizer.pad_token_id)
    with torch.no_grad(), hyb.rollout(strat.hf_named_parameters()) as rm:
        got = rm.generate(ids, mask, max_new_tokens=6, **kw)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=6, **kw)
    out["greedy_equal"] = torch.equal(got, want)
    m = hyb.last_metrics
    need = 0
    plan = hyb.engine.plan
    for p_, spec in enumerate(plan.specs):  # rollout TP2 shard elements not held by the stage
        sh = plan.rollout_shards[hyb.engine.rank][p_]
        if sh is not None and spec.name not in held:
            need += sum(int(torch.tensor([b - a for a, b in pc.gbox]).prod()) for pc in sh.pieces)
    out["tp2_bytes"] = (m["reshard/bytes_per_rank"], m["reshard/lower_bound_bytes"], 4 * need)
    pp.close()
    return out


def _rel_bound(name: str) -> float:
    """1e-5, except for the attention key bias (Qwen2): softmax is invariant to a shift of
    every key, so without RoPE its gradient would be exactly 0; with RoPE only the rotated
    part survives, a sum of nearly cancelling terms whose fp32 rounding is a larger share of
    it (measured 3.2e-5 after the probe's 4 steps, 6.9e-6 after the 5 PPO steps; q/v biases
    2.2e-6, weights <= 7.5e-7)."""
    return 1e-4 if name.endswith("self_attn.k_proj.bias") else 1e-5


@pytest.mark.parametrize("kind,zero", [("llama", 0), ("qwen2", 1)])
def test_pp2_dp2_equals_dp4(kind, zero, tmp_path):
    _reward_folder(str(tmp_path / "reward_model"))
    res = spawn(
        f"{__file__}:worker_equal",
        4,
        args=(kind, zero, str(tmp_path)),
        timeout_s=300,
        deadline_s=1100,
    )
    for r in res:
        assert r["timeouts_ok"]
        # the probe (fixed batch, O(1) advantages, 4 optimizer steps per role): the pipeline
        # computes what DP computes, to float rounding
        for role, per_tensor in r["probe"].items():
            for name, x in per_tensor.items():
                assert x < _rel_bound(name), (kind, "probe", role, name, x)
        n_clipped, n_raw, n_params = r["probe_n_grads"]
        assert n_clipped == n_raw == (n_params if zero == 0 else 0), r["probe_n_grads"]
        for i, step in enumerate(r["steps"]):
            for k, (a, b) in step.items():
                if a is None and b is None:
                    continue
                # abs 1e-6: the PPO loss of whitened advantages and the KL of log-probs near
                # -10 are cancellations of O(1) terms; their rounding is ~1e-7 absolute
                assert b == pytest.approx(a, rel=1e-5, abs=1e-6), (kind, i + 1, k, a, b)
        assert r["bytes"][0] == r["bytes"][1] == r["lower_from_holdings"] > 0, r["bytes"]
        assert r["greedy_equal"], kind
        b, lb, mine = r["tp2_bytes"]
        assert b == lb == mine > 0, r["tp2_bytes"]
        half = r["full_param_bytes"] / 2
        if kind == "llama":  # untied: the target holds
            assert r["stage_param_bytes"] <= 1.15 * half, (r["stage_param_bytes"], half)
        else:  # tied: the last stage holds a copy of the embedding (DeepSpeed tied layers)
            assert r["stage_param_bytes"] < r["full_param_bytes"]
    # update metrics are per rank (DP: its rows; PP: its pipeline's): compare the means over
    # ranks, as the trainer logs them
    for k, (a, b) in res[0]["probe_metrics"].items():
        if a is None and b is None:
            continue
        a = sum(r["probe_metrics"][k][0] for r in res) / len(res)
        b = sum(r["probe_metrics"][k][1] for r in res) / len(res)
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6), (kind, "probe", k, a, b)
    firsts = [r for r in res if "final" in r]
    assert len(firsts) == 2  # one per pipeline
    for r in firsts:
        assert r["actor_keys_equal"]
        # the final weights of the 5 PPO steps, every tensor of both roles (module docstring)
        for role, per_tensor in r["final"].items():
            for name, x in per_tensor.items():
                assert x < _rel_bound(name), (kind, "final", role, name, x)
    moved = [s["actor/entropy"] for s in res[0]["steps"]]
    assert moved[0][0] != moved[-1][0]  # the policy did train
