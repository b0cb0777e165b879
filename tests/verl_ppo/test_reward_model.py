"""ModelReward: the packaged MiniLM encoder as a similarity reward, and a
sequence-classification folder."""

import pytest
import reasoning_gym
import torch

from verl_ppo.reward import ModelReward, RewardBatch, RewardError, default_encoder_path

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def minilm():
    return ModelReward(max_length=64)


def _batch(entries, responses, prompts=None):
    n = len(entries)
    prompts = prompts or [e.get("question", "") for e in entries]
    return RewardBatch([(1,)] * n, [(i,) for i in range(n)], prompts, responses, entries)


def test_default_path_is_the_packaged_encoder():
    p = default_encoder_path()
    assert (p / "config.json").is_file() and (p / "model.safetensors").is_file()


def test_similarity_reward_on_real_entries(minilm):
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=2))
    right = [f"Working... <answer>{e['answer']}</answer>" for e in entries]
    out = minilm.score(_batch(entries, right))
    assert minilm.kind == "similarity" and out.dtype == torch.float32 and out.shape == (3,)
    assert torch.allclose(out, torch.ones(3), atol=1e-5)  # identical text: cosine 1
    e = {"answer": "the capital of France is Paris"}
    out2 = minilm.score(
        _batch(
            [e, e],
            [
                "<answer>Paris is the capital of France</answer>",
                "<answer>bananas are yellow</answer>",
            ],
        )
    )
    assert 0.0 <= out2[1] < out2[0] < 1.0
    # Order and batching do not change a sample's reward.
    one = minilm.score(_batch([e], ["<answer>bananas are yellow</answer>"]))
    assert torch.allclose(one[0], out2[1], atol=1e-5)


def test_similarity_matches_manual_mean_pooling(minilm):
    emb = minilm.embed(["hello world", "a longer sentence with more tokens"])
    tok, model = minilm.tokenizer, minilm.model
    for i, t in enumerate(["hello world", "a longer sentence with more tokens"]):
        with torch.no_grad():
            h = model(**tok([t], return_tensors="pt")).last_hidden_state[0]
        want = torch.nn.functional.normalize(h.mean(0), dim=-1)
        assert torch.allclose(emb[i], want, atol=1e-5)


def test_missing_answer_is_a_clear_error(minilm):
    with pytest.raises(RewardError, match="sample 1: entry has no 'answer'"):
        minilm.score(_batch([{"answer": "1"}, {}], ["1", "2"]))


def test_sequence_classification_folder(tmp_path):
    from tests._models import tiny_reward_classifier

    tiny_reward_classifier(tmp_path, 2)
    rm = ModelReward(tmp_path, max_length=32, batch_size=2)
    assert rm.kind == "classifier" and rm.positive_label == 1
    prompts = ["What is 2+2?", "Name a colour.", "Hi"]
    responses = ["4", "blue", "hello there"]
    out = rm.score(_batch([{}, {}, {}], responses, prompts))
    assert out.shape == (3,) and out.dtype == torch.float32
    with torch.no_grad():
        for i in range(3):
            enc = rm.tokenizer([prompts[i] + responses[i]], return_tensors="pt")
            want = rm.model(**enc).logits.softmax(-1)[0, 1]
            assert torch.allclose(out[i], want, atol=1e-5)
    with pytest.raises(ValueError, match="positive_label"):
        ModelReward(tmp_path, positive_label=5)
    with pytest.raises(RewardError, match="no config.json"):
        ModelReward(tmp_path / "missing")
