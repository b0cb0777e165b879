"""configs/gpu.yaml, the main job made for one GPU: its preflight passes on a CUDA machine
and its job resolves to the GPU fast path (checked on the H200 before each claim about it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_ppo.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpu.yaml"


def test_gpu_config_is_valid_anywhere():
    cfg = load_config(CONFIG, [])
    d = cfg.derived(cfg.comm.nproc)
    assert cfg.comm.nproc == 1 and d.local_rollout_batch_size == cfg.train.rollout_batch_size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (configs/gpu.yaml)")
def test_gpu_config_preflight_and_fast_path_on_cuda():
    from verl_ppo.job.fast_path import ModelFacts, model_config_of, resolve
    from verl_ppo.job.preflight import preflight

    cfg = load_config(CONFIG, [])
    preflight(cfg, cfg.comm.nproc, check_port=False)  # raises PreflightError naming the key
    job = resolve(cfg, True, ModelFacts.of_config(model_config_of(cfg)))
    assert job.use_cuda_graph and job.sequence_packing and job.fused_log_probs, job.reasons
