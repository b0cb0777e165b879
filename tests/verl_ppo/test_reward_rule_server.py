"""The reward server's ``rule`` model scores exactly like the trainer's in-process reward.

The in-process reward is what the trainer builds when ``reward.model`` is ``rule``
(``RuleReward(score_fn=task.score)``); the server is what ``verl-ppo reward-server --model
rule`` serves (``build_reward_model("rule")``), reached over loopback HTTP with
:class:`RemoteReward` (entries go through JSON, tuples becoming lists). Cases: 4 tasks x 20
entries x 10 response forms = 800, among them answers cut off after ``<answer>`` by the
length limit and answers without any tag.
"""

from __future__ import annotations

import pytest
import torch

from verl_ppo.data.tasks import TASKS, Task
from verl_ppo.reward import RemoteReward, RewardBatch, RewardServer, RuleReward
from verl_ppo.reward.factory import build_reward_model

pytestmark = pytest.mark.timeout(300)


def _forms(answer: str) -> list[str]:
    """Response forms a policy produces: right, wrong, cut off, tag-less, restated format."""
    wrong = f"{answer}1"
    return [
        f"Let me add. <answer>{answer}</answer>",
        f"<answer>{wrong}</answer>",
        f"The sum is <answer>{answer}",  # cut off at the length limit
        f"so the result is {answer}",  # no tag
        f"so the result is {wrong}",
        f"Format: <answer></answer>. Then <ANSWER> {answer} </ANSWER>",
        f"<answer>{answer}</answer> no wait <answer>{wrong}</answer>",
        "",
        "I am not sure.",
        f"<answer>\n{answer}\n",
    ]


def _cases() -> tuple[list[Task], RewardBatch, list[str]]:
    tasks, prompts, responses, entries, names = [], [], [], [], []
    for name in sorted(TASKS):
        task = Task(name, train_size=20, eval_size=1, seed=5)
        tasks.append(task)
        for entry in [task.train[i] for i in range(20)]:  # 20 train prompts (held-out skipped)
            for text in _forms(str(entry["answer"])):
                prompts.append(entry["question"])
                responses.append(text)
                entries.append(entry)
                names.append(name)
    n = len(responses)
    ids = [(1, 2, i % 50) for i in range(n)]
    return tasks, RewardBatch(ids, [(3,)] * n, prompts, responses, entries), names


def test_server_rule_model_equals_in_process_task_reward():
    tasks, batch, names = _cases()
    assert len(batch) == 800  # 4 tasks x 20 prompts x 10 response forms
    by_name = {t.name: RuleReward(score_fn=t.score) for t in tasks}  # the trainer's reward
    local = torch.tensor(
        [by_name[n].score(batch.select([i]))[0].item() for i, n in enumerate(names)]
    )
    with RewardServer(build_reward_model("rule"), port=0) as server:
        client = RemoteReward(server.url, timeout_s=60)
        remote = torch.cat(
            [client.score(batch.select(range(s, s + 200))) for s in range(0, 800, 200)]
        )
    diff = [(names[i], batch.responses[i], local[i].item(), remote[i].item())
            for i in range(len(batch)) if local[i] != remote[i]]  # fmt: skip
    assert not diff, diff[:10]
    # the hard cases really score: cut-off and tag-less right answers get full reward
    cut = [i for i, r in enumerate(batch.responses) if r.startswith("The sum is <answer>")]
    bare = [i for i, r in enumerate(batch.responses) if r.startswith("so the result is")][::2]
    numeric = [i for i in cut + bare if names[i] != "countdown"]
    assert numeric and all(remote[i] == 1.0 for i in numeric)
    assert 0 < float(remote.mean()) < 1
