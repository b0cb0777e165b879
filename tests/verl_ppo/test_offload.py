"""``actor/critic.offload_optimizer``: refused with compression at config time, and the main
job trains with it at ZeRO 1, 2 and 3 (2 gloo ranks on the CPU; 1 GPU when there is one).

The countdown task is used because reasoning-gym gives every countdown answer at least
0.01: rewards, advantages and value targets are then non-zero from the first step on, so
both engines really take optimizer steps (a zero-initialised value head predicts exactly 0
until the critic's first update; the policy's KL to the reference is 0 until the actor's).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.verl_ppo._run import run_job
from verl_ppo.config import ConfigError, build_config

OFFLOAD = ["actor.offload_optimizer=true", "critic.offload_optimizer=true"]
TASK = ["data.task=countdown", "data.max_prompt_length=256", "data.eval_size=0"]


@pytest.mark.parametrize("method", ["int8", "bf16"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_offload_with_compression_is_refused_at_config_time(role, method):
    with pytest.raises(
        ConfigError, match=rf"{role}.offload_optimizer=true cannot be combined"
    ) as e:
        build_config(
            {role: {"zero_stage": 2, "offload_optimizer": True}, "gradient_compression": method}
        )
    assert "gradient_compression=none" in str(e.value)  # the fix


def test_offload_without_zero_is_refused_at_config_time():
    # zero_stage 0 written out: auto resolves to 1 on a CUDA machine, where offload applies
    with pytest.raises(ConfigError, match=r"critic.offload_optimizer=true needs critic.zero_stage"):
        build_config({"critic": {"offload_optimizer": True, "zero_stage": 0}})


def _check_trained(run_dir: Path, log: str, stage: int) -> None:
    for role in ("actor", "critic"):
        want = f"{role} engine: ZeRO stage {stage}, AdamW, optimizer state offloaded to CPU"
        assert want in log, log[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(v) for r in steps for v in r.values())
    first, second = steps
    assert first["actor/grad_norm"] > 0 and first["critic/grad_norm"] > 0
    assert second["actor/kl"] != 0.0  # the actor's optimizer step moved the policy
    assert second["critic/vpred_mean"] != 0.0  # ... and the critic's moved the value head


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_two_ppo_steps_two_ranks_cpu(tmp_path, stage):
    zero = [f"actor.zero_stage={stage}", f"critic.zero_stage={stage}"]
    r = run_job(
        ["--config", "configs/tiny.yaml", f"run_dir={tmp_path}", *zero, *OFFLOAD, *TASK],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _check_trained(tmp_path, r.stdout + r.stderr, stage)


@pytest.fixture(scope="module")
def one_rank_nccl():
    """A one-rank NCCL group on this GPU (DeepSpeed adopts it)."""
    import torch.distributed as dist

    from verl_ppo.workers.distributed import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_strategy_steps_on_gpu(one_rank_nccl, stage):
    """The shipped strategy (``ds_config`` + :class:`DeepSpeedStrategy`) with offload on a
    CUDA device, bf16, a tiny Llama: two optimizer steps change the weights, the optimizer
    state lives on the CPU. (The GPU hosts have no reasoning-gym, so the PPO job itself runs
    in the CPU tests above.)"""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ppo.workers.strategy import DeepSpeedStrategy, ds_config

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    conf = ds_config(
        zero_stage=stage, micro_batch_size=2, grad_accum_steps=1, world_size=1, bf16=True,
        grad_clip=1.0, offload_optimizer=True,
    )  # fmt: skip
    strategy = DeepSpeedStrategy(conf, lr=1e-3, timeout_s=120)
    engine = strategy.init(model)
    assert strategy.describe() == (
        f"ZeRO stage {stage}, AdamW, optimizer state offloaded to CPU"
    ), strategy.describe()
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    losses, norms = [], []
    for _ in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        strategy.backward(loss)
        strategy.step()
        losses.append(float(loss.detach()))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        norms = [float(p.float().norm()) for p in engine.module.parameters()]
    assert all(math.isfinite(x) for x in losses + norms)
    assert losses[1] < losses[0]  # the second step sees the first update
    state = engine.optimizer.optimizer.state if hasattr(engine.optimizer, "optimizer") else {}
    devices = {t.device.type for s in state.values() for t in s.values() if torch.is_tensor(t)}
    assert devices == {"cpu"}, devices
    del engine, strategy, model
