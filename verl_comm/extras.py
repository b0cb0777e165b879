"""Optional dependencies: which ``pip install .[extra]`` provides a missing module.

``pip install .`` installs verl_comm with torch, triton, numpy and pydantic only (setup.py);
the plots need the ``plot`` extra and verl_ppo the ``ppo`` extra. A missing one is reported
by name with the command that installs it, instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

EXTRA_OF: dict[str, str] = {
    "matplotlib": "plot",
    "deepspeed": "ppo",
    "transformers": "ppo",
    "accelerate": "ppo",
    "gguf": "ppo",
    "reasoning_gym": "ppo",
    "yaml": "ppo",
    "tqdm": "ppo",
    "prometheus_client": "ppo",
    "pyarrow": "ppo",
    "tensorboard": "ppo",
    "wandb": "ppo",
}
"""Top-level module -> the setup.py extra that installs it."""


def install_hint(exc: ModuleNotFoundError) -> str | None:
    """``"<module> is missing: pip install '.[extra]' ..."`` when ``exc`` is about a module of
    an extra (see :data:`EXTRA_OF`), else None."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return (
        f"{top} is missing: it comes with the {extra!r} extra; install it with "
        f"pip install '.[{extra}]' in a checkout (or 'verl-comm-ppo[{extra}]')"
    )


def require(module: str) -> ModuleType:
    """Import ``module`` (a module of an extra).

    Raises:
        ModuleNotFoundError: naming the extra and the install command.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        hint = install_hint(exc)
        if hint is None:
            raise
        raise ModuleNotFoundError(hint, name=exc.name) from exc


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files, no display).

    Raises:
        ModuleNotFoundError: naming the ``plot`` extra and the install command.
    """
    require("matplotlib").use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it as a PNG to ``path`` (folders created) and close it."""
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=dpi)
    pyplot().close(fig)
    return p
