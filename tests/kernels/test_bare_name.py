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
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["None", "True"]  # the empty stand-in


# Hides the distribution, as on a machine without it: from kernels/__init__.py's own lookup
# (PathFinder with an explicit path) and from its metadata (importlib.metadata.version);
# importlib's top-level search (path None) still finds the folder, as transformers' does.
_HIDE = """
import importlib.machinery as m
_find = m.PathFinder.find_spec.__func__
def find_spec(cls, name, path=None, target=None):
    if name == "kernels" and path is not None:
        return None
    return _find(cls, name, path, target)
m.PathFinder.find_spec = classmethod(find_spec)
import importlib.metadata as md
_version = md.version
def version(name):
    if name == "kernels":
        raise md.PackageNotFoundError(name)
    return _version(name)
md.version = version
"""


def test_without_the_distribution_the_folder_is_an_empty_stand_in() -> None:
    out = _run(
        _HIDE + "import kernels\n"
        "print(kernels.__file__, getattr(kernels, '__version__', 'N/A'))\n"
        "try:\n    kernels.quantize\nexcept AttributeError as e:\n    print('verl_comm.kernels' in str(e))\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "N/A", "True"]


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_transformers_modeling_imports_without_the_distribution() -> None:
    # the GPU machine's failure (transformers 5.17, no 'kernels' distribution): a modeling
    # file imports activations -> integrations/hub_kernels.py -> is_kernels_available()
    out = _run(
        _HIDE + "from transformers.models.llama import modeling_llama\n"
        "from transformers.utils import import_utils as u\n"
        "print(u.is_kernels_available())\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


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
