"""The one way PPO maths is registered by name (verl's ``core_algos.py`` is the model)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def registrar(table: dict[str, F]) -> Callable[[str], Callable[[F], F]]:
    """A decorator factory that stores functions in ``table`` under a name::

        ADV_ESTIMATORS = {}
        register_adv_estimator = registrar(ADV_ESTIMATORS)

        @register_adv_estimator("gae")
        def compute_gae(...): ...

    Raises (from the decorator):
        ValueError: ``name`` is registered already (two entries would silently shadow).
    """

    def register(name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in table:
                raise ValueError(f"{name!r} is registered already ({table[name].__qualname__})")
            table[name] = fn
            return fn

        return deco

    return register
