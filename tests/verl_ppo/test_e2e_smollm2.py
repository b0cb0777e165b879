"""One end-to-end PPO step of the main job on the real, packaged SmolLM2-135M-Instruct."""

import json
from pathlib import Path

import pytest

from tests.verl_ppo._run import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_one_step_on_smollm2(tmp_path):
    r = run_job(
        [
            "--config",
            "configs/default.yaml",
            f"run_dir={tmp_path}",
            "train.num_steps=1",
            "algorithm.n_samples=2",
            "train.rollout_batch_size=4",
            "train.ppo_mini_batch_size=4",
            "train.micro_batch_size=1",
            "rollout.max_new_tokens=8",
            "data.eval_size=2",
            "rollout.eval_max_new_tokens=8",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    step = recs[-1]
    assert step["step"] == 1
    assert 0.0 <= step["reward/mean"] <= 1.0
    assert 0 < step["response/length_mean"] <= 8
    assert step["actor/entropy"] > 0  # a real language model, not a constant
    assert (Path(tmp_path) / "checkpoints" / "step_000001" / "COMPLETE").is_file()
