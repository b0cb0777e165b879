"""Where a decode step of the static-cache rollout spends its time, at the shape of
``benchmarks/ppo_throughput.py`` (Qwen2.5-0.5B shape, random weights, bf16, 128 prompts of
256 tokens, 256 new tokens), against its memory floor (weights + KV cache read once per step,
:meth:`verl_ppo.observe.perf.ModelFlops.decode_floor_s`).

Prints: the whole rollout's time and its fraction of the floor; a decode step split into
the model's step (graph replay, or eager) and the sampler; the one-pass sampler alone in a CUDA
graph (sampled and greedy) against the logits' bytes; and torch.profiler's kernel tables of a
few steps of each, and of the prefill.

    python benchmarks/gpu/profile_decode.py [--shape qwen05b] [--layers N] [--batch 128]
        [--prompt 256] [--new 256] [--tables] [--sweep]

Three decoders in turn: the default (decode kernels and fused q/k/v, gate/up projections),
without the fused projections, and without either. The default is also timed with sampling
outside the captured step (the Python loop around the model-step graph).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._ppo_workload import SHAPES  # noqa: E402


def _timed(fn, n: int) -> float:
    """Median seconds of ``fn()`` over ``n`` calls, each synchronised."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _graph_time(fn, n: int = 20, reps: int = 20) -> float:
    """Median device seconds of one ``fn()``, from a CUDA graph of ``n`` calls replayed
    ``reps`` times (no launch overhead: what a captured decode step pays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    return _timed(g.replay, reps) / n


def _table(fn, n: int, title: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    print(f"== {title} ({n} calls)")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60)
    )


def _measure(model, ids, mask, S, R, params, kernel, fused, a, floors) -> None:
    """Time one decoder (decode kernels on or off, fused projections on or off) and print
    its line (and tables)."""
    from verl_ppo.rollout.cuda_graph import StaticCacheDecoder
    from verl_ppo.rollout.sampler import sample_next

    (B, P), (floor, step_floor) = ids.shape, floors
    dec = StaticCacheDecoder(model, max_seq_len=S, use_cuda_graph=not a.eager)
    dec.tp_model.decode_kernel = kernel and dec.tp_model.decode_kernel
    if not fused:
        dec.tp_model.fused = None
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rollout():
        return dec.rollout(
            ids, mask, max_new_tokens=R, eos_token_id=None, pad_token_id=0, params=params,
            generator=gen,
        )  # fmt: skip

    rollout()  # capture + warm-up
    t_roll = _timed(rollout, 3)
    if kernel and fused and not a.eager:
        # the same decoder with sampling and bookkeeping outside the graph (decode_loop with
        # the model-step graph): a caller-supplied `pick`, same draws
        def loop_outside():
            return dec.rollout(
                ids, mask, max_new_tokens=R, eos_token_id=None, pad_token_id=0, params=params,
                generator=gen, pick=lambda lg, seed: sample_next(lg, params, gen, seed),
            )  # fmt: skip

        loop_outside()
        t_out = _timed(loop_outside, 3)
        print(
            f"sampling outside the graph: rollout {t_out:.4f} s ({floor / t_out:.1%} of floor) "
            f"vs inside {t_roll:.4f} s ({floor / t_roll:.1%})"
        )
    t_pre = _timed(lambda: dec.prefill(ids, mask), 3)
    logits = dec.prefill(ids, mask)
    tok = torch.zeros(B, dtype=torch.long, device="cuda")
    pos = torch.full((B,), P, dtype=torch.long, device="cuda")
    t_step = _timed(lambda: dec.decode(tok, pos, P + 100), 50)
    t_samp = _timed(lambda: sample_next(logits, params, gen), 50)
    print(
        f"decode_kernel={dec.tp_model.decode_kernel} fused={dec.tp_model.fused is not None} "
        f"graph={not a.eager}: rollout B={B} P={P} "
        f"R={R} {t_roll:.4f} s, floor {floor:.4f} s -> {floor / t_roll:.1%} of floor; prefill "
        f"{t_pre * 1e3:.2f} ms; model step {t_step * 1e3:.3f} ms; sampler {t_samp * 1e3:.3f} "
        f"ms; per step incl. loop {(t_roll - t_pre) / R * 1e3:.3f} ms (floor {step_floor * 1e3:.3f} ms)"
    )
    if kernel and fused:
        from verl_comm.kernels.sampling import gumbel_sample

        from verl_ppo.observe.perf import device_peaks

        seed = torch.tensor([1234], device="cuda")
        t_draw = _graph_time(lambda: gumbel_sample(logits, 1.0, seed))
        t_greedy = _graph_time(lambda: gumbel_sample(logits, 1.0, None))
        peaks = device_peaks(torch.device("cuda"))
        nbytes = logits.numel() * logits.element_size()
        floor_us = f"{nbytes / peaks[1] * 1e6:.1f} us" if peaks else "unknown device"
        print(
            f"one-pass sampler in a CUDA graph, {tuple(logits.shape)} {logits.dtype}: sampled "
            f"{t_draw * 1e6:.1f} us, greedy {t_greedy * 1e6:.1f} us (logits' bytes at HBM "
            f"bandwidth: {floor_us})"
        )
    if kernel and fused and a.tables:
        _table(lambda: dec.decode(tok, pos, P + 100), 10, "decode step (model)")
        _table(lambda: sample_next(logits, params, gen), 10, "sampler")
        _table(lambda: dec.prefill(ids, mask), 2, "prefill")


def _sweep_attention(B: int, S: int, L: int) -> None:
    """Time the decode attention kernel's launch configurations at one layer of the shape
    (``(B, 14, 64)`` queries over a ``(B, 2, S, 64)`` bf16 cache, ``L`` slots written)."""
    import math

    from verl_comm.kernels.decode_attention import decode_attention

    kw = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (
        torch.randn(B, 14, 64, **kw),
        torch.randn(B, 2, S, 64, **kw),
        torch.randn(B, 2, S, 64, **kw),
    )
    valid = torch.ones(B, S, dtype=torch.bool, device="cuda")
    length = torch.tensor([L], device="cuda")
    mask = valid[:, None, None, :] & (torch.arange(S, device="cuda") < L)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q.view(B, 2, 7, 64), k, v, attn_mask=mask, scale=1 / math.sqrt(64)
    )
    print(f"sdpa (B,2,7,64) x (B,2,{S},64) masked: {_graph_time(sdpa) * 1e6:.1f} us")
    from verl_comm.kernels.decode_attention import RopeNew
    from verl_comm.kernels.rope_cache import rope_write_cache

    kn, vn = torch.randn(B, 2, 64, **kw), torch.randn(B, 2, 64, **kw)
    cos, sin = torch.rand(B, 64, **kw), torch.rand(B, 64, **kw)
    slot = length - 1

    def two_kernels():
        qr = rope_write_cache(q, kn, vn, cos, sin, k, v, slot)
        return decode_attention(qr, k, v, valid, length, 0.125)

    def one_kernel():
        return decode_attention(q, k, v, valid, length, 0.125, rope=RopeNew(kn, vn, cos, sin))

    for name, fn in (("rope_write_cache + decode_attention", two_kernels),
                     ("decode_attention(rope=...)", one_kernel)) * 2:  # fmt: skip
        print(f"{name}, {L} slots: {_graph_time(fn) * 1e6:.1f} us")
    for split, block_n, warps in [(128, 64, 4), (64, 64, 4), (256, 64, 4), (128, 128, 4),
                                  (128, 64, 8), (256, 128, 8), (512, 64, 4), (64, 32, 2),
                                  (512, 128, 4), (512, 128, 8)]:  # fmt: skip
        fn = functools.partial(
            decode_attention, q, k, v, valid, length, 0.125, split=split, block_n=block_n,
            num_warps=warps,
        )  # fmt: skip
        print(
            f"decode_attention split={split} block_n={block_n} warps={warps}: {_graph_time(fn) * 1e6:.1f} us"
        )


def main() -> None:
    """Print the rollout's fraction of its floor and the split of a decode step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_ppo.observe.perf import ModelFlops, device_peaks
    from verl_ppo.rollout.sampler import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's depth")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--eager", action="store_true", help="no CUDA graph")
    p.add_argument("--tables", action="store_true", help="print the profiler's kernel tables")
    p.add_argument(
        "--sweep", action="store_true", help="time the attention kernel's launch configs"
    )
    a = p.parse_args()
    fields = dict(SHAPES[a.shape])
    if a.layers:
        fields["num_hidden_layers"] = a.layers
    cfg = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    B, P, R = a.batch, a.prompt, a.new
    ids = torch.randint(0, cfg.vocab_size, (B, P), device="cuda")
    mask = torch.ones_like(ids)
    S = -(-(P + R) // 64) * 64
    params = SamplingParams()
    mf = ModelFlops.of(cfg)
    peak = device_peaks(torch.device("cuda"))
    floor = mf.decode_floor_s(B, P, R, peak)
    step_floor = (floor - mf.forward(torch.full((B,), P), B) / peak[0]) / R
    if a.sweep:
        _sweep_attention(B, S, P + 100)
    for kernel, fused in ((True, True), (True, False), (False, False)):
        _measure(model, ids, mask, S, R, params, kernel, fused, a, (floor, step_floor))


if __name__ == "__main__":
    main()
