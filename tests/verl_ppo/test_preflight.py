"""Every error a config file can reveal is raised before any process starts."""

import time

import pytest

from tests.verl_ppo._run import run_job
from verl_ppo.config import ConfigError, build_config, load_config
from verl_ppo.job.preflight import PreflightError, preflight

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def _hybrid(tp, **extra):
    he = {"enable": True, "rollout_sharding": {"tensor_parallel_size": tp}}
    return build_config({"actor": {"model_config": {"hybrid_engine": he}}, **extra})


def test_rollout_tp_checked_against_the_packaged_models_heads():
    # SmolLM2-135M: 9 heads, 3 KV heads (read from its config.json, no weights loaded)
    with pytest.raises(
        PreflightError,
        match=r"actor.model_config.hybrid_engine.rollout_sharding.tensor_parallel_size=2 does "
        r"not divide the 9 attention heads \(3 KV heads\); llama allows TP in \[1, 3\]",
    ):
        preflight(_hybrid(2), 2)
    preflight(
        _hybrid(3, comm={"nproc": 3}, train={"rollout_batch_size": 6, "ppo_mini_batch_size": 6}), 3
    )


def test_rollout_tp_checked_against_kv_heads_and_vocabulary():
    kv = {**TINY, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
    with pytest.raises(PreflightError, match="neither divides nor is a multiple of the 3 KV"):
        preflight(_hybrid(2, model={"tiny": kv}), 2)
    odd_vocab = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 49153}
    with pytest.raises(PreflightError, match="does not divide vocabulary size 49153"):
        preflight(_hybrid(2, model={"tiny": odd_vocab}), 2)


def test_training_layout_checked_against_the_world():
    he = {"enable": True, "training_sharding": {"pipeline_parallel_size": 3}}
    cfg = build_config({"actor": {"model_config": {"hybrid_engine": he}}})
    with pytest.raises(PreflightError, match="pipeline_parallel_size 3 .* does not divide world"):
        preflight(cfg, 2)


def test_batch_shapes_and_task_arguments():
    cfg = load_config("configs/default.yaml", ["train.micro_batch_size=3"])
    with pytest.raises(PreflightError, match="set train.micro_batch_size to one of"):
        preflight(cfg, cfg.comm.nproc)
    cfg = load_config("configs/default.yaml", ["comm.nproc=3"])
    with pytest.raises(PreflightError, match=r"does not divide evenly by ranks \(3\)"):
        preflight(cfg, cfg.comm.nproc)
    cfg = load_config("configs/tiny.yaml", ["data.task_kwargs={min_digits: 0}"])
    with pytest.raises(PreflightError, match="reasoning-gym rejected data.task_kwargs"):
        preflight(cfg, 2)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.micro_batch_size=3", "set train.micro_batch_size to one of"),
        ("comm.nproc=3", "does not divide evenly by ranks (3)"),
    ],
)
def test_cli_fails_in_the_launcher_once(tmp_path, override, message):
    t0 = time.monotonic()
    r = run_job(["--config", "configs/default.yaml", f"run_dir={tmp_path}", override], timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count(message) == 1, r.stderr[-2000:]
    assert "[rank" not in r.stderr and "Traceback" not in r.stderr  # no rank ever started
    assert time.monotonic() - t0 < 90
    assert not (tmp_path / "metrics.jsonl").exists()


def test_compression_backend_reward_and_ports(tmp_path):
    import socket

    # one rule (verl_ppo.job.rules), refused as soon as the config is built
    with pytest.raises(ConfigError, match="needs actor.zero_stage 0 or 1, got 2"):
        build_config({"gradient_compression": "int8", "actor": {"zero_stage": 2}})
    with pytest.raises(ConfigError, match="needs critic.zero_stage 0 or 1, got 3"):
        build_config({"gradient_compression": "int8", "critic": {"zero_stage": 3}})
    with pytest.raises(PreflightError, match="comm.backend=nccl needs CUDA"):
        preflight(build_config({"comm": {"backend": "nccl"}}), 2)
    with pytest.raises(PreflightError, match=r"reward.model='nope' is not a reward model"):
        preflight(build_config({"reward": {"model": "nope"}}), 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(PreflightError, match=f"port {port} .* set monitor.prometheus_port"):
            preflight(build_config({"monitor": {"prometheus_port": port}}), 2)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
def test_fast_path_switch_that_cannot_apply_on_this_machine():
    cfg = build_config({"rollout": {"use_cuda_graph": True}})
    with pytest.raises(PreflightError, match="rollout.use_cuda_graph=true cannot apply: no CUDA"):
        preflight(cfg, 2)
