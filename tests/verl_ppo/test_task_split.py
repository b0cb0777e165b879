"""Train and held-out prompts are disjoint for every built-in task and shipped config.

The split is by a hash of each question's key (``verl_ppo/data/tasks.py``); these tests
draw real reasoning-gym entries and compare the two sides, so a split by seed (the former
design: 11-13 of 48 eval sums among the first 24 train prompts) fails them.
"""

from pathlib import Path

import pytest

from verl_ppo.config import load_config
from verl_ppo.data.tasks import TASKS, Task, TaskError, is_held_out, split_key
from verl_ppo.job.preflight import PreflightError, preflight

CONFIGS = sorted(Path("configs").glob("*.yaml"))
# countdown generates an entry in ~20 ms: fewer train draws keep the test in seconds
TRAIN_DRAWS = {"countdown": 120}


def _check_disjoint(task: Task, eval_size: int, train_draws: int) -> None:
    eval_keys = [split_key(e) for e in task.eval]
    eval_questions = {e["question"] for e in task.eval}
    assert len(eval_keys) == eval_size == len(set(eval_keys)), "eval prompts are distinct"
    train = [task.train[i] for i in range(train_draws)]
    assert not {split_key(e) for e in train} & set(eval_keys)
    assert not {e["question"] for e in train} & eval_questions
    # membership is the hash, not the draw: no train entry belongs to the held-out part
    assert not any(is_held_out(e, task.eval_fraction) for e in train)
    assert all(is_held_out(e, task.eval_fraction) for e in task.eval)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_builtin_tasks_split_disjoint(name):
    for seed in (0, 1):
        task = Task(name, train_size=400, eval_size=16, seed=seed)
        _check_disjoint(task, 16, TRAIN_DRAWS.get(name, 400))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_split_disjoint_for_three_seeds(path):
    cfg = load_config(path)
    for seed in (0, 1, 2):  # benchmarks/default_job.py runs seeds 0, 1, 2
        task = Task(
            cfg.data.task,
            eval_size=cfg.data.eval_size,
            seed=seed,
            overrides=cfg.data.task_kwargs,
        )
        _check_disjoint(task, cfg.data.eval_size, TRAIN_DRAWS.get(cfg.data.task, 400))


def test_train_split_covers_only_the_rest_of_a_small_space():
    # 2-term 1-digit sums: 121 questions; the train draws reach every non-held-out one
    task = Task("basic_arithmetic", train_size=3000, eval_size=8, overrides=_one_digit())
    train_keys = {split_key(e) for e in task.train}
    held = {split_key(task.eval[0])}
    everything = {f"{a} + {b}" for a in range(11) for b in range(11)}
    assert train_keys | {k for k in everything if is_held_out({"question": k})} == everything
    assert not train_keys & held


def _one_digit():
    return {"min_digits": 1, "max_digits": 1}


def test_eval_size_larger_than_the_held_out_part_is_refused():
    with pytest.raises(TaskError, match=r"data.eval_size=100 .* holds out only \d+ .* <= \d+"):
        Task("basic_arithmetic", eval_size=100, overrides=_one_digit())


def test_preflight_refuses_the_eval_size_before_any_process_starts():
    cfg = load_config(
        "configs/tiny.yaml",
        ["data.eval_size=100", "data.task_kwargs={min_digits: 1, max_digits: 1}"],
    )
    with pytest.raises(PreflightError, match=r"data.eval_size=100 .* set data.eval_size <= "):
        preflight(cfg, 2, check_port=False)


def test_seeds_draw_unrelated_train_streams_and_one_eval_set():
    # reasoning-gym seeds item i with Random(seed + i): passed the job's seed as it is, seed 1
    # was seed 0's stream shifted by one item (47 of the first 48 prompts shared)
    tasks = [Task("basic_arithmetic", train_size=400, eval_size=16, seed=s) for s in (0, 1, 2)]
    firsts = [[split_key(t.train[i]) for i in range(48)] for t in tasks]
    # 2-term 2-digit sums: ~4,000 train questions; independent draws of 48 share ~0.6
    for a in range(3):
        for b in range(a + 1, 3):
            shared = len(set(firsts[a]) & set(firsts[b]))
            assert shared <= 5, (a, b, shared)
    evals = [[split_key(e) for e in t.eval] for t in tasks]
    assert evals[0] == evals[1] == evals[2]
