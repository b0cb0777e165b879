"""Triton int8 kernels with their torch references (installed as ``verl_comm.kernels``).

Absmax int8 block quantization (fp32 scale per block of B in {32, 64, 128, 256}), with
optional stochastic rounding or fused error feedback, plain dequantization, and the
dequantize-sum-requantize step that the owner of a chunk runs in a quantized reduce-scatter.
Launchers dispatch CUDA tensors to Triton and CPU tensors to the public ``*_ref`` torch
references, which the kernels match bit for bit. Rounding rule, error bound, NaN/Inf policy:
see :mod:`verl_comm.kernels._common`. Codes and scales of a chunk travel in one byte buffer:
:func:`pack` / :func:`unpack` (layout in :mod:`verl_comm.kernels.pack`).
"""

if __name__ == "kernels":
    # Imported under the bare name: the repository root is on sys.path (``python -m`` or
    # pytest run from the checkout) and this folder shadows the PyPI distribution
    # ``kernels``, which transformers >= 5.25 imports whenever it is installed
    # (transformers/integrations/hub_kernels.py). Load that distribution instead, from the
    # rest of sys.path, and put it in sys.modules: the import statement returns what
    # sys.modules holds once this file has run (importlib's _load_unlocked).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
    _path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        # No distribution: stay an empty module that reads as "not installed". transformers
        # (5.17 and 5.25 alike) finds this folder with find_spec, finds no metadata, imports
        # it as a last resort and takes a module without __version__ and __file__ for a
        # shadow, not an install (utils/import_utils.py, _is_package_available); raising
        # here instead broke every import of a modeling file (activations ->
        # integrations/hub_kernels.py), e.g. Qwen2ForCausalLM on the GPU machine.
        __file__ = None  # noqa: A001

        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            raise AttributeError(
                f"module 'kernels' has no attribute {name!r}: the folder kernels/ of this "
                "checkout is the package verl_comm.kernels (import it by that name), and the "
                "PyPI distribution 'kernels' is not installed"
            )
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        try:
            _spec.loader.exec_module(_module)
        except BaseException:
            del _sys.modules["kernels"]
            raise
else:
    from ._common import QMAX, SUPPORTED_BLOCKS, TINY, packed_nbytes, padded_numel
    from .cast import all_finite, cast_scale, copy_finite
    from .ops import dequant_sum_requant, dequantize, quantize, quantize_ef
    from .pack import pack, unpack
    from .reference import (
        dequant_sum_requant_ref,
        dequantize_ref,
        philox_uniform_ref,
        quantize_ef_ref,
        quantize_ref,
    )

    __all__ = [
        "QMAX",
        "SUPPORTED_BLOCKS",
        "TINY",
        "all_finite",
        "cast_scale",
        "copy_finite",
        "dequant_sum_requant",
        "dequant_sum_requant_ref",
        "dequantize",
        "dequantize_ref",
        "pack",
        "packed_nbytes",
        "padded_numel",
        "philox_uniform_ref",
        "quantize",
        "quantize_ef",
        "quantize_ef_ref",
        "quantize_ref",
        "unpack",
    ]
