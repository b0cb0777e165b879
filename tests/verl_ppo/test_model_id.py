"""model.path as a Hugging Face model id, resolved offline from a test-made local hub cache."""

import pytest

from tests._models import tiny_causal_lm
from verl_ppo.data.model_store import ModelStoreError, resolve_model_path

REPO = "test-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _make_cache(hf_home):
    """The hub cache layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/}."""
    repo = hf_home / "hub" / "models--test-org--tiny-llama"
    snap = repo / "snapshots" / COMMIT
    tiny_causal_lm(
        "llama",
        vocab_size=128,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).save_pretrained(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_hf_id_in_local_cache_resolves(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    snap = _make_cache(tmp_path / "hf")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = resolve_model_path(REPO)
    assert path == snap
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 16


def test_absent_hf_id_names_the_id_and_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelStoreError) as e:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in msg and str(tmp_path / "hf" / "hub") in msg


def test_local_folder_still_wins(tmp_path):
    with pytest.raises(ModelStoreError, match="not a HF model folder"):
        resolve_model_path(str(tmp_path))  # an existing folder is never taken for an id
