"""The Python API launches ``comm.nproc`` ranks like the CLI; one rank with compression warns."""

import pytest

from tests.verl_ppo._run import last_json, run_python

SCRIPT = """
import json, sys
from verl_ppo import PPOTrainer, __version__
from verl_comm import __version__ as comm_version
t = PPOTrainer("configs/tiny.yaml", gradient_compression="int8", compression_rank=0,
               run_dir=sys.argv[1], **{"data.eval_size": 0, "comm.nproc": int(sys.argv[2])})
assert t.config.compression.gradient_compression == "int8"
out = t.run(num_steps=2)
t.close()
print(json.dumps({"steps": [m["step"] for m in out], "v": [__version__, comm_version],
                  "wire": [m.get("comm/actor/wire_bytes", 0) for m in out],
                  "ratio": [m.get("comm/actor/compression_ratio", 0) for m in out]}))
"""


def _api(tmp_path, nproc):
    return run_python(SCRIPT, str(tmp_path), str(nproc))


@pytest.mark.timeout(600)
def test_python_api_launches_the_ranks_like_the_cli(tmp_path):
    r = _api(tmp_path, 2)
    res = last_json(r)
    assert res["steps"] == [1, 2]
    # two ranks really exchanged compressed gradients (start_iter 1: from step 2 on)
    assert res["wire"][-1] > 0 and res["ratio"][-1] > 3.0
    assert (tmp_path / "config.yaml").is_file()  # the ranks ran the API's resolved config
    assert "no peer" not in r.stderr


@pytest.mark.timeout(600)
def test_python_api_one_rank_with_compression_warns(tmp_path):
    r = _api(tmp_path, 1)
    assert last_json(r)["steps"] == [1, 2]
    assert "world size 1: gradient_compression=int8 has no peer" in r.stderr
    assert "never turned on: the world size is 1" in r.stderr
