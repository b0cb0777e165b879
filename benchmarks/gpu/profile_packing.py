"""torch.profiler tables of one packed and one padded micro-batch (forward + backward) of
``benchmarks/packing.py``'s update, to see where the packed path spends its time.

    python benchmarks/gpu/profile_packing.py [--micro 16]      # on the GPU machine
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.packing import SHAPES, batch, build  # noqa: E402


def main() -> None:
    """Print the profiler tables (CUDA and CPU time, top ops) of one padded and one packed
    micro-batch of ``--micro`` sequences, forward + backward, bf16, on CUDA."""
    from torch.nn.attention.varlen import varlen_attn
    from torch.profiler import ProfilerActivity, profile

    from verl_ppo.roles.common import sequence_log_probs
    from verl_ppo.step.packing import packed_log_probs

    p = argparse.ArgumentParser()
    p.add_argument("--micro", type=int, default=16)
    a = p.parse_args()
    print("varlen_attn", inspect.signature(varlen_attn))
    model = build("qwen05b", "cuda", torch.bfloat16)
    ids, mask = batch(a.micro, 64, 16, 256, SHAPES["qwen05b"]["vocab_size"], "cuda")
    for name, fn in (("padded", sequence_log_probs), ("packed", packed_log_probs)):
        for _ in range(3):  # warm-up
            fn(model, ids, mask, 64, fused=True)[0].sum().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(model, ids, mask, 64, fused=True)[0].sum().backward()
            torch.cuda.synchronize()
        print(f"== {name}")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=18, max_name_column_width=60
            )
        )
        print(
            prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=10, max_name_column_width=60
            )
        )


if __name__ == "__main__":
    main()
