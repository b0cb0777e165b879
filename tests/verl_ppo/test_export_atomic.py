"""``verl-ppo export`` from a checkpoint: written aside and renamed when complete, ordinary
file permissions, ``--critic`` on a run without a critic refused before anything is written."""

import json
import os
import stat

import pytest
import torch

from tests._models import tiny_causal_lm
from verl_ppo.run.export import ExportError, export_checkpoint, main, save_model_meta


def _run_without_critic(run):
    """A run folder as ``verl-ppo train`` leaves it for a GRPO job: model_config and one
    ZeRO-0 checkpoint holding the actor only."""
    from verl_ppo.data.model_store import ensure_smollm2

    run.mkdir()
    policy = tiny_causal_lm("llama", seed=0, vocab_size=49152, tie_word_embeddings=True).float()
    save_model_meta(run, policy.config, ensure_smollm2(), policy.generation_config)
    ckpt = run / "checkpoints" / "step_000006"
    (ckpt / "actor").mkdir(parents=True)
    torch.save({"module": policy.state_dict()}, ckpt / "actor" / "mp_rank_00_model_states.pt")
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 6}))
    (run / "checkpoints" / "LATEST").write_text(ckpt.name)
    return policy


def _modes(folder):
    return {
        p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in [folder, *folder.rglob("*")]
    }


def test_export_is_atomic_with_ordinary_permissions(tmp_path, capsys):
    _run_without_critic(tmp_path / "run")
    out = tmp_path / "exported"
    umask = os.umask(0o022)
    try:
        with pytest.raises(ExportError, match="no critic.*drop --critic"):
            export_checkpoint(tmp_path / "run", out, critic=True)
        assert not out.exists()  # nothing written, not even the actor
        assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no temporary folder left
        assert main([str(tmp_path / "run"), str(out), "--critic"]) == 2
        assert "drop --critic" in capsys.readouterr().err and not out.exists()
        assert main([str(tmp_path / "run"), str(out)]) == 0
    finally:
        os.umask(umask)
    modes = _modes(out)
    assert modes["model.safetensors"] == 0o644 and modes["."] == 0o755, modes
    assert set(modes.values()) <= {0o644, 0o755}, modes
    assert json.loads((out / "verl_ppo_export.json").read_text())["checkpoint"] == "step_000006"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]
