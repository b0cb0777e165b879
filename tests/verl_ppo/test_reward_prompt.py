"""A classifier reward model scores the prompt plus the response, in the policy's template.

Drives the trainer's :class:`ExperienceMaker` (the rollout phase) with a tiny random
policy and a tiny random ``LlamaForSequenceClassification`` reward folder, both with
SmolLM2's tokenizer, and records the texts the classifier tokenizes: with synchronous and
asynchronous scoring, and for the greedy evaluation batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_ppo.config import load_config
from verl_ppo.data.tasks import Task
from verl_ppo.observe.metrics import PhaseTimer
from verl_ppo.reward import ModelReward
from verl_ppo.step.experience_maker import ExperienceMaker
from verl_ppo.workers.models import build_policy, load_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = load_config("configs/tiny.yaml", ["rollout.max_new_tokens=4", "data.eval_size=2"])
    tok = load_tokenizer(cfg.model)
    folder = tmp_path_factory.mktemp("classifier")
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    rm_cfg = LlamaConfig(
        vocab_size=len(tok), num_attention_heads=2, num_key_value_heads=1, num_labels=1,
        pad_token_id=tok.pad_token_id, **small,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(rm_cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    task = Task(cfg.data.task, train_size=8, eval_size=2, seed=0)
    policy = build_policy(cfg.model, tok, torch.float32, 0).eval()
    return cfg, tok, folder, task, policy


@pytest.mark.parametrize("async_scoring", [False, True])
def test_classifier_sees_prompt_plus_response_in_template(parts, async_scoring):
    cfg, tok, folder, task, policy = parts
    cfg = cfg.model_copy(
        update={"reward": cfg.reward.model_copy(update={"async_scoring": async_scoring})}
    )
    rm = ModelReward(folder)
    assert rm.kind == "classifier"
    seen: list[str] = []
    encode = rm._encode
    rm._encode = lambda texts: (seen.extend(texts), encode(texts))[1]
    em = ExperienceMaker(
        cfg, cfg.derived(1), tok, task, SimpleNamespace(module=policy), rm,
        rank=0, world_size=1, device=torch.device("cpu"), timeout_s=120,
    )  # fmt: skip
    try:
        exp, _ = em.make_experience(0, PhaseTimer())
        prompts, _, _ = em.prompts(0)
        responses = em.decode(exp.responses, exp.response_mask)
        assert seen == [p + r for p, r in zip(prompts, responses)]
        for text, sample in zip(seen, [task.sample(tok, "train", i) for i in range(len(seen))]):
            assert text.startswith(sample.prompt)  # the rendered prompt, then the response
            assert f"<|im_start|>user\n{sample.question}" in text  # SmolLM2's ChatML turns
            assert sample.prompt.endswith("<|im_start|>assistant\n")
        seen.clear()
        em.greedy_scores("eval", [0, 1])
        for text, j in zip(seen, (0, 1)):
            assert text.startswith(task.sample(tok, "eval", j).prompt)
        assert len(seen) == 2
    finally:
        em.close()
