"""The next step's prompts are tokenized on a worker thread and equal the ones built on
demand; the task is only ever sampled on the caller's thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from verl_ppo.config import load_config
from verl_ppo.data.tasks import Task
from verl_ppo.step.experience_maker import ExperienceMaker
from verl_ppo.step.prompt_prefetch import PromptPrefetcher
from verl_ppo.workers.models import load_tokenizer

pytestmark = pytest.mark.timeout(120)


def _texts(step: int):
    return [f"p{step}"] * 2, [{}] * 2, torch.zeros(2, dtype=torch.long)


def _tokens(texts: list[str]):
    ids = torch.tensor([[int(t[1:])] * 3 for t in texts])
    return ids, torch.ones_like(ids)


def test_draws_on_the_callers_thread_tokenizes_on_the_worker():
    drawn: list[tuple[int, str]] = []
    tokenized: list[tuple[str, str]] = []
    gate = threading.Event()

    def prompts_of(step: int):
        drawn.append((step, threading.current_thread().name))
        return _texts(step)

    def tokenize(texts: list[str]):
        tokenized.append((texts[0], threading.current_thread().name))
        if texts[0] == "p1":
            gate.wait(5)
        return _tokens(texts)

    pf = PromptPrefetcher(prompts_of, tokenize, last_step=6)
    try:
        got = pf.get(0)
        assert got.texts == ["p0", "p0"] and got.input_ids[0, 0] == 0 and pf.hits == 0
        assert [s for s, _ in drawn] == [0, 1]  # step 1's texts are drawn at once
        gate.set()
        assert pf.get(1).input_ids[0, 0] == 1 and pf.hits == 1  # the prefetched tokens
        assert pf.get(5).texts[0] == "p5" and pf.hits == 1  # out of order: on demand
        assert pf.get(6).input_ids[0, 0] == 6 and pf.hits == 2
    finally:
        pf.close()
    me = threading.current_thread().name
    assert all(name == me for _, name in drawn)  # the task never sees a second thread
    assert all(name.startswith("prompts") for _, name in tokenized)
    assert [s for s, _ in drawn] == [0, 1, 2, 5, 6]  # nothing past last_step=6


@pytest.mark.parametrize("where", ["prompts_of", "tokenize"])
def test_an_error_is_raised_in_the_step_it_belongs_to(where):
    def prompts_of(step: int):
        if where == "prompts_of" and step == 1:
            raise ValueError("task: step 1 has no prompts")
        return _texts(step)

    def tokenize(texts: list[str]):
        if where == "tokenize" and texts[0] == "p1":
            raise ValueError("a prompt has 9 tokens > data.max_prompt_length=4")
        return _tokens(texts)

    pf = PromptPrefetcher(prompts_of, tokenize)
    try:
        assert pf.get(0).texts[0] == "p0"  # step 1's failure is not step 0's
        with pytest.raises(ValueError, match="step 1|max_prompt_length"):
            pf.get(1)
    finally:
        pf.close()


def test_experience_maker_prefetched_prompts_equal_on_demand():
    cfg = load_config("configs/tiny.yaml", ["train.num_steps=4"])
    tok = load_tokenizer(cfg.model)
    task = Task(cfg.data.task, train_size=16, eval_size=2, seed=0)
    em = ExperienceMaker(
        cfg, cfg.derived(1), tok, task, SimpleNamespace(module=None), SimpleNamespace(),
        rank=0, world_size=1, device=torch.device("cpu"), timeout_s=60,
    )  # fmt: skip
    try:
        for step in range(4):
            got = em.step_prompts(step)
            texts, entries, groups = em.prompts(step)
            ids, mask = em.encode(texts)
            assert got.texts == texts and got.entries == entries
            assert torch.equal(got.groups, groups)
            assert torch.equal(got.input_ids, ids) and torch.equal(got.attention_mask, mask)
        assert em._prefetch.hits == 3  # steps 1-3 came from the worker
    finally:
        em.close()
    assert em._prefetch is None
