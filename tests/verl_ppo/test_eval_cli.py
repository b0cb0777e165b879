"""`verl-ppo eval` on the packaged SmolLM2 gives the trainer's own step-0 held-out score;
`verl-ppo generate` answers in the chat template."""

import pytest

from tests.verl_ppo._run import last_json, run_python

pytestmark = pytest.mark.timeout(600)

SCRIPT = """
import json, sys
from verl_ppo import PPOTrainer
from verl_ppo.data.model_store import ensure_smollm2
from verl_ppo.step.evaluate import eval_main

run = sys.argv[1]
# the default job's eval (its task options, 16 tokens, batch), cut to 4 prompts, one process
t = PPOTrainer("configs/default.yaml", run_dir=run, **{"comm.nproc": 1, "data.eval_size": 4})
t.setup()
step0 = t.evaluate()
t.close()
out = run + "/eval.jsonl"
code = eval_main(["--model", str(ensure_smollm2()), "--config", "configs/default.yaml",
                  "--n", "4", "--world", "1", "--output", out])
rows = [json.loads(x) for x in open(out)]
print(json.dumps({"code": code, "step0": step0, "cli": sum(r["score"] for r in rows) / len(rows),
                  "n": len(rows)}))
"""


def test_eval_equals_trainer_step0_eval(tmp_path):
    r = run_python(SCRIPT, str(tmp_path))
    res = last_json(r)
    assert res["code"] == 0 and res["n"] == 4
    # bit-equality is the property (the CLI reproduces the trainer's eval): one process, the
    # same weights, prompts, batches and padding run the same kernels, so the greedy tokens
    # are the same on any CPU, and the mean of 4 scores in {0, 1} is exact in float
    assert res["cli"] == res["step0"]
    assert res["step0"] > 0  # SmolLM2 solves some of these one-digit sums: not a 0 == 0 match
    assert "mean reward" in r.stdout and "expected" in r.stdout  # summary line and table
    # progress while it works, as plain lines when stderr is not a terminal
    assert "verl-ppo eval: loading " in r.stderr and "verl-ppo eval: 4/4 prompts (" in r.stderr
    assert "\r" not in r.stderr


def test_generate_answers_in_the_chat_template(capsys):
    from verl_ppo.data.model_store import ensure_smollm2
    from verl_ppo.step.evaluate import generate_main

    assert (
        generate_main(
            ["--model", str(ensure_smollm2()), "--prompt", "Say hi.", "--max-new-tokens", "6"]
        )
        == 0
    )
    out = capsys.readouterr().out.strip()
    assert out and "<|im_start|>" not in out  # the response only, special tokens dropped


def test_bad_model_is_one_clear_line(tmp_path, capsys):
    from verl_ppo.step.evaluate import eval_main

    assert eval_main(["--model", "no-such-org/no-such-model"]) == 2
    assert "not in the local cache" in capsys.readouterr().err
