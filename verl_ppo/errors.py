"""The error every configuration check raises, and :func:`divisors` that its fixes offer
(a leaf module: the schema
:mod:`verl_ppo.config`, the rule table :mod:`verl_ppo.job.rules` and the resolver
:mod:`verl_ppo.job.fast_path` all raise it, and none of them imports another to do so)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names each bad field and the fix."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the sizes a fix may offer)."""
    return [k for k in range(1, n + 1) if n % k == 0]
