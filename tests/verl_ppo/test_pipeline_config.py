"""Pipeline training refuses what it cannot run, at config time (no process started)."""

import pytest

from verl_ppo.config import ConfigError, build_config
from verl_ppo.job.fast_path import layouts

HE = "actor.model_config.hybrid_engine"
PP2 = {f"{HE}.enable": True, f"{HE}.training_sharding.pipeline_parallel_size": 2}


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({f"{HE}.enable": False}, "hybrid_engine.enable: true"),
        ({"actor.zero_stage": 2}, "actor.zero_stage=2"),
        ({"critic.zero_stage": 3}, "critic.zero_stage=3"),
        ({"gradient_compression": "int8"}, "gradient_compression='int8'"),
        ({"train.sequence_packing": True}, "sequence_packing"),
        ({"train.max_tokens_per_micro_batch": 64}, "max_tokens_per_micro_batch"),
        ({"actor.zero_stage": 1, "actor.offload_optimizer": True}, "actor.offload_optimizer"),
        ({"model.gradient_checkpointing": True}, "gradient_checkpointing"),
        ({"rollout.use_cuda_graph": True}, "use_cuda_graph"),
        ({"model.tiny": {"model_type": "gpt2"}}, "model.tiny.model_type='gpt2'"),
    ],
)
def test_refused_with_pipeline(extra, needle):
    with pytest.raises(ConfigError, match=None) as e:
        build_config({}, **{**PP2, **extra})
    assert needle in str(e.value) and "pipeline_parallel_size=2" in str(e.value)


def test_training_tp_and_moved_zero_stage_refused():
    with pytest.raises(ConfigError) as e:
        build_config({}, **{f"{HE}.training_sharding.tensor_parallel_size": 2})
    assert "tensor_parallel_size=2" in str(e.value) and "AutoTP" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_config({}, **{f"{HE}.training_sharding.zero_stage": 1})
    assert "actor.zero_stage" in str(e.value)


def test_supported_pipeline_config_and_world_checks():
    cfg = build_config({}, **{**PP2, "actor.zero_stage": 1, "critic.zero_stage": 1})
    train, _ = layouts(cfg, 4, 1)
    assert (train.pp, train.dp, train.zero_stage) == (2, 2, 1)  # PP2 x DP2
    odd = build_config({}, **{**PP2, "train.rollout_batch_size": 6, "train.ppo_mini_batch_size": 6})
    with pytest.raises(ValueError, match="= 2 does not divide world size 3"):
        layouts(odd, 3, 0)
    small = build_config(
        {}, **{**PP2, "train.ppo_mini_batch_size": 2, "train.rollout_batch_size": 4}
    )
    layouts(small, 2, 0)  # PP2 x DP1
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=2 does not divide evenly by ranks"):
        layouts(small, 4, 0)
