"""Import-time stand-ins for modules a benchmark's third-party code imports but never uses.

TRL imports pandas, datasets and pyarrow at module level; on the GPU machine they are absent
(and too large to carry), while its PPO loop never calls them. The stand-ins' classes raise
on use, so nothing can silently run on a fake.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-in modules for ``names`` (and their submodules) that are not installed.

    Only names that failed to import are served (first in ``sys.meta_path``, so that a
    broken installation is not half-used). Any attribute of a stand-in is a class that
    raises ImportError when instantiated.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: D102
        return None

    def exec_module(self, module: types.ModuleType) -> None:  # noqa: D102
        name = module.__name__
        module.__path__ = []

        def _getattr(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)

            def _refuse(*a: Any, **k: Any) -> None:
                raise ImportError(f"{name}.{attr}: {name} is not installed (stand-in module)")

            return type(attr, (), {"__init__": _refuse})

        module.__getattr__ = _getattr  # type: ignore[method-assign]


def install_import_stand_ins(names: tuple[str, ...] = ("pandas", "datasets", "pyarrow")) -> list:
    """Serve import-time stand-ins for those of ``names`` that cannot be imported (absent, or
    installed without their own dependencies); returns the names stood in for (empty when
    all import). Modules that import are never replaced."""
    missing = set()
    for n in names:
        if importlib.util.find_spec(n) is None:
            missing.add(n)
            continue
        try:
            importlib.import_module(n)
        except Exception:  # noqa: BLE001 - any failure: unusable here
            missing.add(n)
            for m in [m for m in sys.modules if m.split(".")[0] == n]:
                del sys.modules[m]
    if missing:
        sys.meta_path.insert(0, _StandInFinder(missing))
    return sorted(missing)
