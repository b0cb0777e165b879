"""Your data and your reward: verl-format files, a verl-signature reward function, export.

Schema errors fail in preflight (before any rank) naming the file, row and column; the
custom function's float / dict / exception / wrong signature; export then train draws the
built-in task's prompts and gets its rewards for the same seed.
"""

import json
import os

import pytest

from tests.verl_ppo._run import ROOT
from verl_ppo.config import build_config
from verl_ppo.data.export_cli import main as data_main
from verl_ppo.data.file_source import FileSource, build_prompt_source
from verl_ppo.data.tasks import Task
from verl_ppo.data.verl_format import DataFormatError, read_rows, task_rows, write_rows
from verl_ppo.job.preflight import PreflightError, preflight
from verl_ppo.reward.base import RewardBatch, RewardError
from verl_ppo.reward.custom import CustomReward, CustomRewardError
from verl_ppo.reward.rule import RuleReward
from verl_ppo.workers.models import load_tokenizer

EXAMPLE = os.path.join(ROOT, "examples", "arithmetic_reward.py")
TASK_KW = {"min_digits": 1, "max_digits": 1}


def _row(i=0, **over):
    row = {
        "data_source": "basic_arithmetic",
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"index": i},
    }
    row.update(over)
    return row


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(build_config().model)


# ------------------------------------------------------------------ schema
@pytest.mark.parametrize(
    "bad, column",
    [
        ({"data_source": 3}, "data_source"),
        ({"reward_model": "7"}, "reward_model"),
        ({"prompt": "What is 2 + 2?"}, "prompt"),
        ({"prompt": [{"role": "user"}]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [{"role": "robot", "content": "hi"}]}, "prompt"),
        ({"extra_info": [1, 2]}, "extra_info"),
    ],
)
def test_jsonl_schema_errors_name_file_row_column(tmp_path, bad, column):
    path = _jsonl(tmp_path / "t.jsonl", [_row(0), _row(1), _row(2, **bad)])
    with pytest.raises(DataFormatError) as e:
        read_rows(path)
    msg = str(e.value)
    assert path in msg and "row 2" in msg and repr(column) in msg


def test_missing_column_and_empty_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(i) for i in range(3)]
    for r in rows:
        del r["reward_model"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    with pytest.raises(DataFormatError, match=r"m\.parquet.*'reward_model'.*missing column"):
        read_rows(tmp_path / "m.parquet")
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataFormatError, match=r"e\.jsonl.*no rows"):
        read_rows(tmp_path / "e.jsonl")
    (tmp_path / "j.jsonl").write_text("{oops\n")
    with pytest.raises(DataFormatError, match=r"j\.jsonl', line 1: not JSON"):
        read_rows(tmp_path / "j.jsonl")


def test_parquet_wrong_type_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(i) for i in range(5)]
    rows[3]["prompt"] = None  # a null in a list<struct> column
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "w.parquet")
    with pytest.raises(DataFormatError, match=r"w\.parquet', row 3, column 'prompt'"):
        read_rows(tmp_path / "w.parquet")
    table = pa.Table.from_pylist([_row(i) for i in range(2)])  # prompt stored as plain text
    table = table.set_column(1, "prompt", pa.array(["What is 2 + 2?"] * 2))
    pq.write_table(table, tmp_path / "s.parquet")
    with pytest.raises(DataFormatError, match=r"s\.parquet', row 0, column 'prompt'.*got str"):
        read_rows(tmp_path / "s.parquet")


def test_preflight_refuses_bad_file_before_any_rank(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [_row(0), _row(1, prompt="plain text")])
    cfg = build_config(**{"data.task": None, "data.train_files": [train], "data.eval_size": 0})
    with pytest.raises(PreflightError, match=r"train\.jsonl', row 1, column 'prompt'"):
        preflight(cfg, 1, check_port=False)


def test_overlong_prompts_refused_or_filtered_and_counted(tmp_path, tok, caplog):
    long = _row(1, prompt=[{"role": "user", "content": "word " * 300}])
    rows = [_row(0), long, _row(2), _row(3)]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    base = {"data.task": None, "data.train_files": [path], "data.eval_size": 0}
    with pytest.raises(PreflightError, match=r"t\.jsonl', row 1.*filter_overlong_prompts"):
        preflight(build_config(**base, **{"train.num_steps": 1}), 1, check_port=False)
    cfg = build_config(**base, **{"train.num_steps": 1, "data.filter_overlong_prompts": True})
    import logging

    log = logging.getLogger("test_user_data")
    with caplog.at_level(logging.INFO, logger="test_user_data"):
        src = build_prompt_source(cfg, tok, log)
    assert src.filtered == 1
    assert "row 1" in caplog.text and "1 train rows filtered" in caplog.text
    drawn = [src.sample(tok, "train", i).entry["reward_model"]["ground_truth"] for i in range(4)]
    assert drawn == ["1", "3", "4", "1"]  # row 1 skipped; cycles over the 3 kept rows


# ------------------------------------------------------------ the function
FUNCS = """
def as_float(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == ground_truth else 0.25

def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str)), "length": len(solution_str), "note": "text"}

def raises(data_source, solution_str, ground_truth, extra_info=None):
    if "boom" in solution_str:
        raise ZeroDivisionError("boom in the scorer")
    return 1.0

def two_args(solution_str, ground_truth):
    return 0.0
"""


def _batch(responses, truths):
    entries = [_row(i, reward_model={"style": "rule", "ground_truth": t}) for i, t in
               enumerate(truths)]  # fmt: skip
    n = len(responses)
    return RewardBatch([[1]] * n, [[2]] * n, ["p"] * n, list(responses), entries)


@pytest.fixture()
def funcs(tmp_path):
    p = tmp_path / "funcs.py"
    p.write_text(FUNCS)
    return str(p)


@pytest.mark.parametrize("workers", [1, 2])
def test_custom_function_float_and_dict(funcs, workers):
    r = CustomReward(funcs, "as_float", num_workers=workers)
    assert r.score(_batch(["7", "8"], ["7", "7"])).tolist() == [1.0, 0.25]
    r.close()
    d = CustomReward(funcs, "as_dict", num_workers=workers)
    assert d.score(_batch(["ab", "abcd"], ["1", "2"])).tolist() == [2.0, 4.0]
    m = d.metrics(reset=True)
    assert m["reward/extra/length"] == pytest.approx(3.0)  # mean of 2 and 4; "note" dropped
    assert "reward/extra/note" not in m and m["reward/custom_errors"] == 0.0
    d.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_custom_function_exception_raise_or_zero(funcs, workers, caplog):
    r = CustomReward(funcs, "raises", num_workers=workers)
    with pytest.raises(RewardError, match=r"sample 1 .*ZeroDivisionError: boom.*on_error=zero"):
        r.score(_batch(["ok", "boom"], ["1", "2"]))
    r.close()
    z = CustomReward(funcs, "raises", num_workers=workers, on_error="zero")
    assert z.score(_batch(["boom", "ok", "boom"], ["1", "2", "3"])).tolist() == [0.0, 1.0, 0.0]
    assert z.metrics()["reward/custom_errors"] == 2.0
    assert "scored 0 (2 so far)" in caplog.text
    z.close()


def test_custom_function_wrong_signature_refused_at_preflight(funcs, tmp_path):
    with pytest.raises(CustomRewardError, match=r"two_args.*cannot take verl's arguments"):
        CustomReward(funcs, "two_args")
    train = _jsonl(tmp_path / "t.jsonl", [_row(0)])
    base = {"data.task": None, "data.train_files": [train], "data.eval_size": 0}
    for name, match in (("two_args", "signature"), ("missing", "defines no function")):
        cfg = build_config(**base, **{"reward.custom_reward_function.path": funcs,
                                      "reward.custom_reward_function.name": name})  # fmt: skip
        with pytest.raises(PreflightError, match=match):
            preflight(cfg, 1, check_port=False)


def test_rule_reward_needs_reasoning_gym_sources(tmp_path):
    train = _jsonl(tmp_path / "t.jsonl", [_row(0, data_source="my_math")])
    cfg = build_config(**{"data.task": None, "data.train_files": [train], "data.eval_size": 0})
    with pytest.raises(PreflightError, match=r"data_source='my_math'.*custom_reward_function"):
        preflight(cfg, 1, check_port=False)


# ------------------------------------------------------------- round trip
def test_export_then_train_draws_the_builtin_batches(tmp_path, tok):
    """The exported files give the trainer the built-in task's prompts, entries and rule
    rewards (seed 0, configs/default.yaml's task), and the example function scores like
    the task on every response."""
    out_t, out_v = tmp_path / "train.parquet", tmp_path / "val.jsonl"
    default = os.path.join(ROOT, "configs", "default.yaml")
    assert data_main(["export", "--config", default, "--n", "40", "--out", str(out_t)]) == 0
    assert data_main(["export", "--config", default, "--split", "eval", "--n", "12",
                      "--out", str(out_v)]) == 0  # fmt: skip
    task = Task("basic_arithmetic", eval_size=12, seed=0, overrides=TASK_KW)
    src = FileSource([str(out_t)], [str(out_v)], tok, eval_size=12)
    custom = CustomReward(EXAMPLE)
    for split, n in (("train", 40), ("eval", 12)):
        for i in range(n):
            a, b = task.sample(tok, split, i), src.sample(tok, split, i)
            assert a.prompt == b.prompt and a.question == b.question
            assert str(a.entry["answer"]) == b.entry["reward_model"]["ground_truth"]
            responses = [a.entry["answer"], f"<answer>{a.entry['answer']}</answer>", "12",
                         f"so {a.entry['answer']}0", "<answer>1", "no idea"]  # fmt: skip
            want = [task.score(r, a.entry) for r in responses]
            rule = [RuleReward().score_one(r, b.entry) for r in responses]
            batch = RewardBatch([[1]] * 6, [[2]] * 6, ["p"] * 6, responses, [b.entry] * 6)
            # the same float operations on the same strings: bit-equal by construction
            assert rule == want and custom.score(batch).tolist() == pytest.approx(want, abs=1e-7)


@pytest.mark.parametrize("name", ["chain_sum", "gsm_symbolic"])  # Fractions in metadata
def test_write_rows_round_trips_jsonl_and_parquet(tmp_path, name):
    task = Task(name, eval_size=2, seed=3)
    rows = list(task_rows(task, "train", 5))
    for file in ("r.jsonl", "r.parquet"):
        back = read_rows(write_rows(rows, tmp_path / file))
        assert [back[i] for i in range(5)] == rows
    for i, r in enumerate(rows):  # the rule reward scores an exported row as the task does
        for text in (f"<answer>{task.train[i]['answer']}</answer>", "<answer>-1</answer>"):
            assert RuleReward().score_one(text, r) == task.score(text, task.train[i])


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "over, key",
    [
        ({"data.train_files": ["t.jsonl"]}, "data.task"),
        ({"data.task": None, "data.train_files": ["t.jsonl"]}, "data.eval_size"),
        ({"data.val_files": ["v.jsonl"]}, "data.val_files"),
        ({"data.filter_overlong_prompts": True}, "data.filter_overlong_prompts"),
        ({"reward.num_workers": 8}, "reward.num_workers"),
        ({"reward.custom_reward_function.on_error": "zero"}, "on_error"),
        ({"reward.custom_reward_function.path": "f.py", "reward.model": "minilm"}, "both score"),
        ({"data.task": None}, "no prompts"),
        (
            {
                "data.task": None,
                "data.train_files": ["t.jsonl"],
                "data.eval_size": 0,
                "data.task_kwargs": {"max_digits": 1},
            },
            "data.task_kwargs=null",
        ),  # fmt: skip
    ],
)
def test_keys_that_cannot_apply_are_refused(over, key):
    from verl_ppo.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        build_config(**over)


TINY_RUN = """
import json, sys
from verl_ppo import PPOTrainer
d, files = sys.argv[1], sys.argv[2] == "files"
kw = {"comm.nproc": 1, "train.num_steps": 1, "train.export_hf": False, "data.eval_size": 4}
if files:
    kw.update({"data.task": None, "data.train_files": [d + "/t.parquet"],
               "data.val_files": [d + "/v.jsonl"],
               "reward.custom_reward_function.path": "examples/arithmetic_reward.py"})
t = PPOTrainer("configs/tiny.yaml", run_dir=d + "/" + sys.argv[2], **kw)
m = t.run()[-1]
t.close()
print(json.dumps([m["reward/mean"], m["eval/reward"], m["response/length_mean"], m["perf/tokens"],
                  m.get("reward/extra/tagged")]))
"""


@pytest.mark.timeout(900)
def test_tiny_run_from_files_equals_builtin(tmp_path):
    """One step of the tiny model on one rank: the exported files with the example function
    give the built-in task's rewards and eval, and the same responses (lengths, tokens: same
    prompts, same sampling seed). A random tiny model mostly scores 0; that rewards agree
    on real answers is checked above (test_export_then_train_draws_the_builtin_batches)
    and, on the default job, by benchmarks/user_data.py."""
    from tests.verl_ppo._run import last_json, run_python

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    assert (
        data_main(["export", "--config", tiny, "--n", "8", "--out", f"{tmp_path}/t.parquet"]) == 0
    )
    assert data_main(["export", "--config", tiny, "--split", "eval", "--n", "4",
                      "--out", f"{tmp_path}/v.jsonl"]) == 0  # fmt: skip
    builtin = last_json(run_python(TINY_RUN, str(tmp_path), "builtin"))
    files = last_json(run_python(TINY_RUN, str(tmp_path), "files"))
    # same prompts, same sampling seed, same float arithmetic: bit-equal by construction
    assert builtin[:4] == files[:4]
    assert builtin[4] is None and files[4] is not None  # the function's extra value logged


@pytest.mark.timeout(300)
def test_server_rule_model_scores_verl_rows_like_the_task():
    """``reward-server --model rule`` given verl-format rows (as exported, and bare: only
    data_source and ground_truth) scores like the trainer's in-process task reward: the
    800 cases of test_reward_rule_server (4 tasks, cut-off and tag-less answers)."""
    import torch

    from tests.verl_ppo.test_reward_rule_server import _cases
    from verl_ppo.data.verl_format import task_row
    from verl_ppo.reward import RemoteReward, RewardServer
    from verl_ppo.reward.factory import build_reward_model

    tasks, batch, names = _cases()
    by_name = {t.name: t for t in tasks}
    local = [by_name[n].score(r, e) for n, r, e in zip(names, batch.responses, batch.entries)]
    local = torch.tensor(local, dtype=torch.float32).tolist()  # rewards travel as float32
    rows = [task_row(n, e, "train", i) for i, (n, e) in enumerate(zip(names, batch.entries))]
    bare = [{"data_source": r["data_source"], "reward_model": r["reward_model"]} for r in rows]
    with RewardServer(build_reward_model("rule"), port=0) as server:
        client = RemoteReward(server.url, timeout_s=60)
        for entries in (rows, bare):
            sent = RewardBatch(batch.prompt_ids, batch.response_ids, batch.prompts,
                               batch.responses, entries)  # fmt: skip
            got = torch.cat(
                [client.score(sent.select(range(s, s + 200))) for s in range(0, 800, 200)]
            )
            if entries is rows:  # exact entries: every task, countdown included
                assert got.tolist() == local
            else:  # the answer alone: the arithmetic tasks' scorers need nothing else
                ok = [i for i, n in enumerate(names) if n in ("basic_arithmetic", "chain_sum")]
                assert [got[i].item() for i in ok] == [local[i] for i in ok]


def test_readme_path_commands_are_valid():
    """The README's "Your data and your reward" commands: the export lines parse, the train
    line's overrides build a valid config on configs/default.yaml, its function loads."""
    import re
    import shlex

    from verl_ppo.config import load_config
    from verl_ppo.data.export_cli import _parser
    from verl_ppo.reward.custom import load_function

    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Your data and your reward", 1)[1].split("\n## ", 1)[0]
    blocks = [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)\n```", section, re.S)]
    exports = [ln for b in blocks for ln in b.splitlines() if ln.startswith("verl-ppo data")]
    assert len(exports) == 2
    for line in exports:
        _parser().parse_args(shlex.split(line)[3:])
    train = next(ln for b in blocks for ln in b.splitlines() if ln.startswith("verl-ppo train"))
    args = shlex.split(train)[2:]
    cfg = load_config(os.path.join(ROOT, args[1]), args[2:])
    assert cfg.data.train_files and cfg.data.val_files and cfg.data.task is None
    load_function(os.path.join(ROOT, cfg.reward.custom_reward_function.path))
