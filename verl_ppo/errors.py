"""The error every configuration check raises (a leaf module: the schema
:mod:`verl_ppo.config`, the rule table :mod:`verl_ppo.rules` and the resolver
:mod:`verl_ppo.fast_path` all raise it, and none of them imports another to do so)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names each bad field and the fix."""
