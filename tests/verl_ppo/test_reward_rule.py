"""RuleReward on real reasoning-gym entries."""

import pytest
import reasoning_gym
import torch

from verl_ppo.reward import RewardBatch, RewardError, RuleReward, extract_tagged_answer


def _batch(entries, responses):
    n = len(entries)
    return RewardBatch([(1,)] * n, [(2,)] * n, [e["question"] for e in entries], responses, entries)


def test_extract_tagged_answer():
    assert extract_tagged_answer("think <answer> 12 </answer>") == "12"
    assert extract_tagged_answer("<answer>a</answer> then <ANSWER>b</ANSWER>") == "b"
    assert extract_tagged_answer("no tags, 12") is None


def test_correct_and_incorrect_answers_on_real_entries():
    arith = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=7))
    chain = list(reasoning_gym.create_dataset("chain_sum", size=2, seed=3))
    entries = arith + chain
    responses = [f"Let me compute. <answer>{e['answer']}</answer>" for e in entries]
    wrong = [f"<answer>{int(e['answer']) + 1}</answer>" for e in entries]
    untagged = [f"The answer is {e['answer']}" for e in entries]
    r = RuleReward()
    good = r.score(_batch(entries, responses))
    assert good.dtype == torch.float32 and good.shape == (6,)
    assert good.tolist() == [1.0] * 6
    assert r.score(_batch(entries, wrong)).tolist() == [0.0] * 6
    # the tasks' rule (as in process): a numeric answer without a tag, or cut off after
    # the opening tag, still counts; closed tags only with extract_tagged_answer
    assert r.score(_batch(entries, untagged)).tolist() == [1.0] * 6
    cut = [f"<answer>{e['answer']}" for e in entries]
    assert r.score(_batch(entries, cut)).tolist() == [1.0] * 6
    strict = RuleReward(extract_fn=extract_tagged_answer)
    assert strict.score(_batch(entries * 2, untagged + cut)).tolist() == [0.0] * 12
    mixed = r.score(_batch(entries[:2], [responses[0], wrong[1]]))
    assert mixed.tolist() == [1.0, 0.0]


def test_custom_extract_and_score_fn():
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=2, seed=1))
    r = RuleReward(extract_fn=lambda t: t.split("=")[-1].strip())
    out = r.score(_batch(entries, [f"x = {entries[0]['answer']}", "x = 99999"]))
    assert out.tolist() == [1.0, 0.0]
    r2 = RuleReward(score_fn=lambda text, entry: len(text) / 10)
    assert r2.score(_batch(entries, ["abc", "abcde"])).tolist() == pytest.approx([0.3, 0.5])


def test_errors_name_sample_and_fix():
    r = RuleReward()
    with pytest.raises(RewardError, match="sample 0: entry has no metadata.source_dataset"):
        r.score(_batch([{"question": "q", "answer": "1"}], ["<answer>1</answer>"]))
    bad = {"question": "q", "answer": "1", "metadata": {"source_dataset": "no_such_task"}}
    with pytest.raises(RewardError, match="no dataset 'no_such_task'"):
        r.score(_batch([bad], ["<answer>1</answer>"]))
