"""The next step's prompts are built on a worker thread and equal the ones built on demand."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from verl_ppo.config import load_config
from verl_ppo.data.tasks import Task
from verl_ppo.step.experience_maker import ExperienceMaker
from verl_ppo.step.prompt_prefetch import PromptPrefetcher, StepPrompts
from verl_ppo.workers.models import load_tokenizer

pytestmark = pytest.mark.timeout(120)


def _fake(step: int) -> StepPrompts:
    ids = torch.full((2, 3), step, dtype=torch.long)
    return StepPrompts([f"p{step}"] * 2, [{}] * 2, torch.zeros(2, dtype=torch.long), ids, ids)


def test_prefetcher_builds_on_its_thread_and_serves_the_next_step():
    calls: list[tuple[int, str]] = []
    gate = threading.Event()

    def build(step: int) -> StepPrompts:
        calls.append((step, threading.current_thread().name))
        if step == 1:
            gate.wait(5)
        return _fake(step)

    pf = PromptPrefetcher(build)
    try:
        assert pf.get(0).texts == ["p0", "p0"]
        assert pf.hits == 0
        gate.set()
        assert pf.get(1).input_ids[0, 0] == 1  # the prefetched build
        assert pf.hits == 1
        assert pf.get(5).texts[0] == "p5"  # out of order: built on demand
        assert pf.hits == 1
    finally:
        pf.close()
    assert all(name.startswith("prompts") for _, name in calls)  # never the caller's thread
    assert [s for s, _ in calls][:2] == [0, 1]
    assert 5 in [s for s, _ in calls]


def test_prefetcher_reraises_the_builders_error():
    def build(step: int) -> StepPrompts:
        if step == 1:
            raise ValueError("a prompt has 9 tokens > data.max_prompt_length=4")
        return _fake(step)

    pf = PromptPrefetcher(build)
    try:
        pf.get(0)
        with pytest.raises(ValueError, match="max_prompt_length"):
            pf.get(1)
    finally:
        pf.close()


def test_experience_maker_prefetched_prompts_equal_on_demand():
    cfg = load_config("configs/tiny.yaml", [])
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
