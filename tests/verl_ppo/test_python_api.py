"""The Python API runs the same trainer in a plain process (a one-rank gloo group)."""

import subprocess
import sys

import pytest

from tests.verl_ppo._run import ROOT

SCRIPT = """
import json, sys
from verl_ppo import PPOTrainer, __version__
from verl_comm import __version__ as comm_version
t = PPOTrainer("configs/tiny.yaml", gradient_compression="int8", compression_rank=0,
               run_dir=sys.argv[1], **{"train.num_steps": 2, "data.eval_size": 0,
               "compression.start_iter": 1})
assert t.config.compression.gradient_compression == "int8"
out = t.run()
t.close()
print(json.dumps({"steps": [m["step"] for m in out], "v": [__version__, comm_version]}))
"""


@pytest.mark.timeout(600)
def test_python_api_single_process(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert '"steps": [1, 2]' in r.stdout.splitlines()[-1]
