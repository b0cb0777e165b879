"""verl_comm stands alone: every module imports with verl_ppo's dependencies absent.

The subprocess blocks deepspeed, transformers and every other package of the ``ppo`` and
``plot`` extras (setup.py) with a meta-path finder, so what passes here is what
``pip install .`` (torch, triton, numpy, pydantic) gives; a missing extra is named with its
install command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib, importlib.abc, pkgutil, sys
from verl_comm.extras import EXTRA_OF
BLOCKED = set(EXTRA_OF) | {"verl_ppo"}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

for m in list(sys.modules):
    if m.split(".")[0] in BLOCKED:
        del sys.modules[m]
sys.meta_path.insert(0, Block())
"""

IMPORT_ALL = """
import verl_comm, verl_comm.kernels
names = [m.name for m in pkgutil.walk_packages(verl_comm.__path__, "verl_comm.")]
for n in names:
    importlib.import_module(n)
leaked = sorted(k for k in sys.modules if k.split(".")[0] in BLOCKED)
assert not leaked, leaked
try:
    import deepspeed
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("the blocker let deepspeed through")
print("imported", len(names) + 2)
"""

HINTS = """
from verl_comm.extras import require
try:
    require("matplotlib")
except ModuleNotFoundError as e:
    print("PLOT:", e)
BLOCKED.discard("verl_ppo")  # verl_ppo itself may import now; its dependencies may not
from verl_ppo.cli import main
print("RC:", main(["train", "--config", "configs/tiny.yaml"]))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_every_verl_comm_module_imports_without_the_extras():
    r = _run(IMPORT_ALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) > 40  # every module of the package, not a few


@pytest.mark.timeout(300)
def test_a_missing_extra_is_named_with_its_install_command():
    r = _run(HINTS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PLOT: matplotlib is missing" in r.stdout and "pip install '.[plot]'" in r.stdout
    assert "RC: 2" in r.stdout
    assert "comes with the 'ppo' extra" in r.stderr and "pip install '.[ppo]'" in r.stderr
