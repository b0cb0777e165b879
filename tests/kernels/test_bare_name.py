"""The top-level ``kernels/`` folder never shadows the PyPI distribution ``kernels``.

From the checkout's root the folder is importable as ``kernels`` (``python -m`` and pytest
put the root on ``sys.path``); transformers >= 5.25 imports the distribution of that name
whenever it is installed, and got this folder instead (ImportError: cannot import name
'CUDAProperties'). Each case runs in a fresh interpreter whose working directory is the root.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _distribution_installed() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        return False
    return True


def test_bare_name_is_the_distribution_or_absent() -> None:
    out = _run(
        "import kernels, sys; print(kernels.__file__); print(sys.modules['kernels'] is kernels)"
    )
    if _distribution_installed():
        assert out.returncode == 0, out.stderr
        path, same = out.stdout.split()
        assert not Path(path).resolve().is_relative_to(ROOT / "kernels"), path
        assert same == "True"
    else:
        assert out.returncode != 0
        assert "verl_comm.kernels" in out.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_transformers_imports_from_the_root() -> None:
    out = _run(
        "from transformers import LlamaConfig\n"
        "import verl_comm.kernels as k\n"
        "print(k.quantize.__module__)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "verl_comm.kernels.ops"
