"""Version differences of third-party libraries, decided in one place with packaging.version."""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

_TRANSFORMERS = Version(version("transformers"))

# transformers renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name is
# deprecated, removal announced for 5.40). 5.24 is the oldest release we saw with the new
# name; older ones (the GPU machine's 5.17) take the old one.
CACHE_KWARG = "cache" if _TRANSFORMERS >= Version("5.24") else "past_key_values"
