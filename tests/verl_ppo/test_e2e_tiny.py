"""2-process gloo end-to-end runs of the main job on a tiny model built from a config."""

import json
from pathlib import Path

import pytest

from tests.verl_ppo._run import run_job
from tests.verl_ppo.test_tracking import assert_tensorboard_matches_jsonl

pytestmark = pytest.mark.timeout(600)


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_two_ppo_steps_then_resume(tmp_path):
    run = tmp_path / "run"
    tb = "train.logger=[console,jsonl,tensorboard]"
    r = run_job(["--config", "configs/tiny.yaml", f"run_dir={run}", tb])
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _metrics(run)
    steps = [x for x in recs if "reward/mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    for key in (
        "reward/mean",
        "actor/kl",
        "actor/entropy",
        "actor/pg_clipfrac",
        "critic/vf_loss",
        "response/length_mean",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/update_critic",
        "perf/throughput_tokens_per_s",
    ):
        assert key in steps[-1], key
    assert "eval/reward" in recs[0] and "eval/reward" in steps[-1]
    ckpt = run / "checkpoints"
    assert (ckpt / "LATEST").read_text() == "step_000002"
    assert (ckpt / "step_000002" / "COMPLETE").is_file()
    # resume: the next call continues at step 3 and does not repeat steps 1-2
    # a key that cannot change mid-run is refused by the launcher, before any rank starts
    bad = run_job(["--config", "configs/tiny.yaml", f"run_dir={run}", "gradient_compression=int8"])
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "compression.gradient_compression: none -> int8" in bad.stderr
    assert "train.resume=never" in bad.stderr
    r2 = run_job(["--config", "configs/tiny.yaml", f"run_dir={run}", "train.num_steps=3", tb])
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "train.num_steps: 2 -> 3" in r2.stderr  # a key that may change: logged
    rows2 = [x for x in _metrics(run) if "reward/mean" in x]
    assert [x["step"] for x in rows2] == [1, 2, 3]
    assert rows2[-1]["run/resumed_from_step"] == 2 and "run/resumed_from_step" not in rows2[0]
    summary = [x for x in r2.stderr.splitlines() if "done |" in x][-1]
    assert "resumed at step 2 | eval " in summary and " -> " in summary, summary
    assert "step 3 | reward" in r2.stdout + r2.stderr  # the console backend
    # TensorBoard events (read back with EventAccumulator) hold the JSONL's values
    assert_tensorboard_matches_jsonl(run)
    assert (ckpt / "LATEST").read_text() == "step_000003"


def test_grpo_with_kl_loss(tmp_path):
    r = run_job(
        [
            "--config",
            "configs/tiny.yaml",
            f"run_dir={tmp_path}",
            "algorithm.adv_estimator=grpo",
            "algorithm.n_samples=2",
            "algorithm.kl.use_kl_in_reward=false",
            "algorithm.kl.use_kl_loss=true",
            "algorithm.kl.estimator=k3",
            "train.num_steps=1",
            "data.eval_size=0",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = _metrics(tmp_path)[-1]
    assert "actor/kl_loss" in last and "critic/vf_loss" not in last


def test_everything_on_hybrid_tp2_int8_packing_async_reward(tmp_path):
    """The main job with the resharding engine (TP2 rollout), int8 gradient compression,
    sequence packing, token-budget micro-batches, async + cached reward and the profiler."""
    r = run_job(
        [
            "--config",
            "configs/tiny.yaml",
            f"run_dir={tmp_path}",
            "train.num_steps=3",
            "data.eval_size=0",
            "actor.model_config.hybrid_engine.enable=true",
            "actor.model_config.hybrid_engine.rollout_sharding.tensor_parallel_size=2",
            "gradient_compression=int8",
            "compression.start_iter=1",
            "train.sequence_packing=true",
            "train.max_tokens_per_micro_batch=160",
            "rollout.micro_batch_size=1",
            "reward.cache_entries=64",
            "profiler.enable=true",
            "profiler.steps=[2,3]",
            f"profiler.output_dir={tmp_path / 'prof'}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    last = _metrics(tmp_path)[-1]
    assert last["step"] == 3
    assert last["reshard/tensor_parallel_size"] == 2.0
    assert last["reshard/bytes_per_rank"] == last["reshard/lower_bound_bytes"]
    assert "timing_s/reshard" in last and "reward/exposed_s" in last
    assert last["comm/actor/compression_ratio"] > 3.0
    assert (tmp_path / "prof" / "profile_rank0.json").is_file()
    prof = json.loads((tmp_path / "prof" / "profile_rank1.json").read_text())
    assert [s["step"] for s in prof["steps"]] == [2, 3]  # the log's step numbers
    assert prof["meta"]["world_size"] == 2
    assert "verl-comm profile report" in r.stdout + r.stderr  # where the profile went
