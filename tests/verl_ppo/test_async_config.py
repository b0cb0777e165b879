"""Async rollout keys: refused where they cannot apply, impossible splits named before any
process starts (the rule table runs when a config is built and again in preflight)."""

import pytest

from verl_ppo.config import ConfigError, build_config
from verl_ppo.job.preflight import PreflightError, preflight

ASYNC = {"rollout.mode": "async", "rollout.n_ranks": 2, "algorithm.policy_loss": "decoupled"}


def test_defaults_are_colocated():
    r = build_config({}).rollout
    assert (r.mode, r.n_ranks, r.max_staleness, r.sync_wire, r.dtype) == (
        "colocated",
        0,
        1,
        "delta",
        "bfloat16",
    )


@pytest.mark.parametrize(
    "key,value",
    [("n_ranks", 2), ("max_staleness", 0), ("sync_wire", "full"), ("dtype", "float32")],
)
def test_async_key_refused_in_colocated_mode(key, value):
    with pytest.raises(
        ConfigError, match=rf"rollout\.{key}=.*rollout\.mode=colocated.*set rollout\.mode: async"
    ):
        build_config({}, **{f"rollout.{key}": value})


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"rollout.n_ranks": 0}, r"rollout\.n_ranks=0: the rollout group is empty"),
        ({"rollout.n_ranks": 3}, r"comm\.nproc=2 training ranks do not split evenly"),
        (
            {"rollout.n_ranks": 2, "rollout.tensor_model_parallel_size": 4},
            r"rollout\.n_ranks=2 is not a multiple of rollout\.tensor_model_parallel_size=4",
        ),
        ({"actor.zero_stage": 3}, r"actor\.zero_stage=3: the sync reads full weights"),
        (
            {"actor.model_config.hybrid_engine.enable": True},
            r"hybrid_engine\.enable=true: the rollout ranks hold their own weights",
        ),
        (
            {"rollout.dtype": "float32"},
            r"rollout\.sync_wire=delta with rollout\.dtype=float32.*set rollout\.sync_wire: full",
        ),
        (
            {"algorithm.policy_loss": "vanilla"},
            r"rollout\.max_staleness=1 with algorithm\.policy_loss=vanilla.*decoupled",
        ),
    ],
)
def test_impossible_async_split_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config({}, **{**ASYNC, **overrides})


def test_valid_async_config_builds():
    cfg = build_config({}, **ASYNC)
    assert cfg.rollout.mode == "async"
    cfg = build_config(
        {}, **{**ASYNC, "rollout.max_staleness": 0, "algorithm.policy_loss": "vanilla"}
    )
    assert cfg.rollout.max_staleness == 0


def test_preflight_refuses_the_split_before_any_process(tmp_path):
    cfg = build_config({"model": {"tiny": {"hidden_size": 32}}}, **ASYNC, run_dir=str(tmp_path))
    bad = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"n_ranks": 3})})
    with pytest.raises(PreflightError, match=r"do not split evenly"):
        preflight(bad, bad.comm.nproc, check_port=False)


def test_preflight_checks_the_sync_plan_against_the_model(tmp_path):
    tiny = {"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4}
    cfg = build_config({"model": {"tiny": tiny}}, **ASYNC, run_dir=str(tmp_path))
    with pytest.raises(PreflightError, match=r"rollout\.mode=async: model_type 'gpt_neox'"):
        preflight(cfg, cfg.comm.nproc, check_port=False)
