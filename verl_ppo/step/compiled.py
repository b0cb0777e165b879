"""``torch.compile`` where it pays: the elementwise work around the matmuls, on CUDA.

Two uses, both optional and both with an eager fallback:

- :class:`CompiledOrEager`: one function (the decode step's RMSNorm / RoPE / SiLU-mul, the
  fused LM head's per-chunk softmax statistics and gradient) through ``torch.compile`` on
  CUDA tensors, eager on the CPU, eager for good after a compiler failure (logged once).
- :func:`compile_decoder_layers`: regional compilation of a HF decoder's layers for the
  training and no-grad forwards (``train.torch_compile``). Every layer is an instance of
  one class, so the layer's forward and backward compile once and every layer reuses them
  (torch's "regional compilation" recipe,
  https://pytorch.org/tutorials/recipes/regional_compilation.html). In eager mode a
  Qwen2.5-0.5B layer over a 64k-token micro-batch spends about as long in its ~40
  elementwise kernels (RMSNorm in fp32, rotate-half RoPE, SiLU-mul, residual adds, each
  a full pass over the activations) as in its matmuls; inductor fuses each group into one
  kernel. Generation through the HF model (:class:`verl_ppo.rollout.generate.HFGenerator`,
  a growing KV cache: a new shape every step) runs the layers eagerly
  (:func:`eager_layers`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from verl_ppo.job.model_family import decoder_layers

log = logging.getLogger("verl_ppo")


class CompiledOrEager:
    """``fn`` through ``torch.compile`` when its first argument is a CUDA tensor, eager
    otherwise (CPU tensors, or while a CUDA graph is being captured before the first
    compilation). If compilation fails, ``fn`` runs eagerly from then on and the reason is
    logged once and kept in ``failure``.

    Args:
        fn: the eager function (the reference: same arithmetic).
        dynamic: ``torch.compile``'s ``dynamic`` (None: static first, dynamic on a change).
        fullgraph: refuse graph breaks.
        options: inductor options of this function only (``torch.compile``'s ``options``).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        dynamic: bool | None = None,
        fullgraph: bool = True,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.fn, self.compiled, self.failure = fn, None, None
        self.dynamic, self.fullgraph, self.options = dynamic, fullgraph, options
        self.__name__ = getattr(fn, "__name__", "fn")

    def __call__(self, *args: Any) -> Any:
        if (
            self.failure is not None
            or not args[0].is_cuda
            or torch.cuda.is_current_stream_capturing()
            and self.compiled is None
        ):
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(
                self.fn, fullgraph=self.fullgraph, dynamic=self.dynamic, options=self.options
            )
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, say so
            self.failure = f"{type(e).__name__}: {e}"[:300]
            log.warning(
                "torch.compile of %s failed, running it eagerly: %s", self.__name__, self.failure
            )
            return self.fn(*args)


_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")

RECOMPILE_LIMIT = 32
"""Compilations allowed per code object (torch's default is 8). Actor, reference and critic
share one decoder-layer forward, and it compiles once per case it meets: grad or no-grad,
parameters that require grad or not (the frozen reference), an attention mask or None (HF
passes None when a batch has no padding, so the first batch with a padded response is a
new case, possibly steps into a run), static then dynamic shapes. Measured on one H200
(``benchmarks/results/ppo_throughput.md``): 7 cases, the last two in the third step. Past
the limit dynamo would run the layers eagerly from then on."""


class _LayerCall:
    """A layer's ``_compiled_call_impl``: the compiled call, except with a KV cache (HF
    decoding or any forward that builds one), which runs eagerly: a cache's per-layer
    state would make the layers compile once each and exhaust the recompile limit."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.eager = layer._call_impl
        self.compiled = torch.compile(layer._call_impl, dynamic=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def compile_decoder_layers(model: Any) -> int:
    """Regional ``torch.compile`` of each decoder layer of ``model`` (in place, module
    names and parameters unchanged; compiled on the first call, forward and backward; a
    call with a KV cache runs eagerly). Raises dynamo's ``recompile_limit`` to at least
    :data:`RECOMPILE_LIMIT` (process-wide).

    Returns:
        The number of layers compiled (0: no decoder layers found).
    """
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
    layers = decoder_layers(model)
    for layer in layers:
        layer._compiled_call_impl = _LayerCall(layer)
    return len(layers)


@contextlib.contextmanager
def eager_layers(model: Any) -> Iterator[None]:
    """Within the block, the layers :func:`compile_decoder_layers` compiled run eagerly
    (generation with a growing KV cache would recompile every step)."""
    saved = [(m, m._compiled_call_impl) for m in decoder_layers(model)]
    saved = [(m, c) for m, c in saved if c is not None]
    for m, _ in saved:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, c in saved:
            m._compiled_call_impl = c


def torch_compile_unsupported(cuda: bool, model: Any) -> str | None:
    """Why ``train.torch_compile`` cannot apply (None: it can)."""
    if not cuda:
        return "no CUDA device (inductor on the CPU would build C++ on every new host)"
    if not decoder_layers(model):
        return f"{type(model).__name__} has no decoder layer list to compile"
    return None
