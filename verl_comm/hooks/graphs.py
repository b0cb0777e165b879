"""One CUDA graph per bucket: a bucket's whole reduction chain costs one launch on the host.

Why: a DDP step with our hooks was host-bound on an H200. The int8 chain of one 16.8 M
element bucket is ~20 kernel and NCCL launches (quantize with error feedback, pack,
all-to-all, dequantize-sum-requantize, pack, all-gather, dequantize, finiteness), low rank
~60; their Python and launch cost (1.8 ms and 3.5 ms per bucket, against ~0.1 ms and
~0.5 ms of GPU work, ``benchmarks/gpu/hook_host_cost.py``) left the GPU idle. Replaying a
captured graph costs one launch. Torch documents the mechanism and its rules in "CUDA
Graphs" (``torch.cuda.CUDAGraph``, https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs);
NCCL collectives can be captured (NCCL >= 2.9.6).

Rules kept here:

* a bucket's chain is captured only once it has run eagerly with the same inputs: the
  same path, bucket buffer, unused-parameter ranges and state tensors (error-feedback
  residuals, low-rank Q, which the chain updates in place), the *key*. A changed key (DDP
  rebuilt its buckets, a state was loaded, a parameter got no gradient) runs eagerly
  again and is captured at the next step; after ``MAX_CAPTURES`` captures of one bucket
  it stays eager (a warning says so);
* a step that computes error statistics (``CompressionConfig.stats_every``) runs eagerly
  and leaves the captured graph as it is;
* low rank is captured only with ``warm_start`` (a fresh random Q per step is drawn on the
  host);
* all graphs of a state share one memory pool and replay on one side stream in capture
  order, so their transient buffers may share memory (the pool rule of torch's notes);
* capture uses ``capture_error_mode="thread_local"``: the autograd thread captures while
  other threads may use CUDA; no host sync is made (``torch.cuda.graph`` would synchronise
  and empty the cache, so the lower-level ``capture_begin`` is used);
* an error while capturing turns graphs off for the state (logged) and the bucket runs
  eagerly: graphs are an optimisation, never a failure mode;
* bytes sent are counted while capturing; a replay adds the captured count to the
  collective's ``bytes_sent``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("verl_comm.hooks")

MAX_CAPTURES = 4
"""Captures per bucket before it stays eager (layouts or inputs that keep changing)."""


@dataclass
class BucketGraph:
    """A captured chain: its key, the graph, its static result, bytes one run sends."""

    key: tuple
    graph: Any
    result: Any
    wire_bytes: int


def graph_key(path: str, buf: torch.Tensor, keep: tuple, state_tensors: list) -> tuple:
    """What a captured chain depends on: path, buffer address and size, ranges without a
    gradient, and the address of every state tensor it reads and updates in place."""
    return (path, buf.data_ptr(), buf.numel(), keep, tuple(t.data_ptr() for t in state_tensors))


def run_path(
    state: Any,
    bs: Any,
    path: str,
    fn: Callable[..., Any],
    buf: torch.Tensor,
    coll: Any,
    keep: tuple,
) -> Any:
    """Run ``fn(state, bs, buf, coll, keep)`` (a reduction path) eagerly, or as the bucket's
    CUDA graph when the rules of this module allow; returns its ``PathResult``.

    Must be called on the state's side stream (a non-default stream) for CUDA buffers.
    """
    if not _eligible(state, bs, path, buf):
        return fn(state, bs, buf, coll, keep)
    key = graph_key(path, buf, keep, bs._tensors())
    g = bs.graph
    if g is not None and g.key == key:
        g.graph.replay()
        coll.bytes_sent += g.wire_bytes
        return g.result
    if bs.graph_seen != key or bs.graph_captures >= MAX_CAPTURES:
        if bs.graph_captures == MAX_CAPTURES:
            bs.graph_captures += 1
            logger.warning(
                "comm hook: bucket inputs changed after %d CUDA-graph captures; the bucket "
                "runs eagerly from now on",
                MAX_CAPTURES,
            )
        res = fn(state, bs, buf, coll, keep)
        bs.graph_seen = graph_key(path, buf, keep, bs._tensors())  # as the next step sees it
        return res
    return _capture(state, bs, key, fn, buf, coll, keep)


def _eligible(state: Any, bs: Any, path: str, buf: torch.Tensor) -> bool:
    cfg = state.config
    if not (buf.is_cuda and cfg.cuda_graph and not state._graphs_off and buf.numel()):
        return False
    if state.collect_stats:  # a sampled statistics step runs eagerly; the graph stays
        return False
    return path != "lowrank_int8" or cfg.warm_start


def _capture(state: Any, bs: Any, key: tuple, fn, buf, coll, keep) -> Any:
    dev = buf.device
    pool = state._graph_pools.get(dev)
    if pool is None:
        pool = state._graph_pools[dev] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    sent0 = coll.bytes_sent
    bs.graph_captures += 1
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            res = fn(state, bs, buf, coll, keep)
        finally:
            graph.capture_end()
    except Exception as e:  # noqa: BLE001 - an optimisation must not fail the step
        state._graphs_off = True
        bs.graph = None
        coll.bytes_sent = sent0
        logger.warning(
            "comm hook: capturing the reduction of a bucket of %d elements as a CUDA graph "
            "failed (%s: %s); CUDA graphs are off for this hook state, buckets run eagerly",
            buf.numel(),
            type(e).__name__,
            e,
        )
        return fn(state, bs, buf, coll, keep)
    bs.graph = BucketGraph(key, graph, res, coll.bytes_sent - sent0)
    graph.replay()  # capturing recorded the work; this runs it for the current step
    return res
