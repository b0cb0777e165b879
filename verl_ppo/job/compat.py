"""Version differences of third-party libraries, decided in one place with packaging.version."""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

_TRANSFORMERS = Version(version("transformers"))

# transformers renamed the forward kwarg ``past_key_values`` to ``cache`` (the old name is
# deprecated, removal announced for 5.40). 5.24 is the oldest release we saw with the new
# name; older ones (the GPU machine's 5.17) take the old one.
CACHE_KWARG = "cache" if _TRANSFORMERS >= Version("5.24") else "past_key_values"


def extension_build_dir(name: str) -> str | None:
    """The folder torch JIT-builds extension ``name`` in (``$TORCH_EXTENSIONS_DIR/<name>``,
    else ``~/.cache/torch_extensions/py<ver>_<accelerator>/<name>``), or None where this
    torch lacks the helper. torch exposes the rule only as the private
    ``torch.utils.cpp_extension._get_build_directory`` (which also creates the folder, as the
    build would); one place calls it."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return None
    return _get_build_directory(name, verbose=False)
