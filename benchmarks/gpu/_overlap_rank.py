"""One launch of ``benchmarks/gpu/async_overlap.py``: a colocated job (``--gpus`` data-parallel
processes) or an async job (1 training + 1 rollout process), timed on training rank 0.

Run by :func:`verl_comm.distributed.launch.run_ranks` (``--gpus`` ranks colocated, 2 async:
``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` ... set); rank 0 appends one JSON line (per-step
times, tokens, phases, numerics; async: the bridge's measured line rate,
``benchmarks/gpu/_bridge_probe.py``) to ``--raw``. The global batch is the same in both
modes (``train.rollout_batch_size``: each of 2 colocated ranks makes half of it). The
workload is the one of ``benchmarks/ppo_throughput.py`` (``benchmarks/_ppo_workload.py``:
random-init model of a named shape, fixed-length prompts, :class:`FixedLengthTask`,
:func:`run_verl`'s config), with ``--spread LO HI``: every response ends with EOS forced at
a length drawn uniformly from ``[LO, HI]`` per prompt (:func:`forced_lengths`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH_DIR))  # the ppo_throughput helper modules
from _ppo_env import _sync  # noqa: E402
from _ppo_verl import _task_replaced, check_log_probs_vs_hf, verl_config  # noqa: E402
from _ppo_workload import FixedLengthTask, Setup, fixed_length_prompts, load_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bridge_probe import probing_join  # noqa: E402


def row_lengths(input_ids: torch.Tensor, lo: int, hi: int, seed: int) -> list[int]:
    """Per row, a length uniform in ``[lo, hi]`` drawn from a generator seeded by the row's
    prompt tokens (CRC32) and ``seed``: the same prompt gets the same length in every
    process and run."""
    out = []
    for row in input_ids.tolist():
        key = zlib.crc32(json.dumps(row).encode()) ^ seed
        out.append(random.Random(key).randint(lo, hi))
    return out


@contextmanager
def forced_lengths(lo: int, hi: int, seed: int):
    """Within the block, :func:`verl_ppo.rollout.generate.decode_loop` (every rollout path's
    decode loop: the HF one and the static-cache / CUDA-graph one) emits EOS at step
    ``L - 1`` of each row (``L`` from :func:`row_lengths`), with that token's log-probability
    under the temperature-scaled logits; other tokens are sampled as usual. The loop then
    stops at the batch's longest row, as it does when a model ends its answers. The static
    decoder samples outside its graph within the block (the captured draw would skip the
    loop), so the rollout's decode steps each take a Python loop turn as before the captured
    draw existed."""
    import verl_ppo.rollout.cuda_graph as cg
    import verl_ppo.rollout.generate as gen

    orig = gen.decode_loop

    def loop(prefill, step, input_ids, attention_mask, **kw):
        eos = gen.eos_list(kw["eos_token_id"])
        if not eos:
            raise RuntimeError("forced response lengths need an EOS token")
        ends = torch.tensor(row_lengths(input_ids, lo, hi, seed), device=input_ids.device) - 1
        at = set(ends.tolist())
        params, generator, base = kw["params"], kw.get("generator"), kw.get("pick")
        t = [0]

        def pick(
            logits: torch.Tensor, seed: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            tok, lp = (
                base(logits, seed) if base else gen.sample_next(logits, params, generator, seed)
            )
            if t[0] in at:  # a host-side test: no device sync per step
                force = ends == t[0]
                scaled = logits.float() / params.temperature
                eos_lp = scaled[:, eos[0]] - torch.logsumexp(scaled, -1)
                tok = torch.where(force, torch.full_like(tok, eos[0]), tok)
                lp = torch.where(force, eos_lp.to(lp.dtype), lp)
            t[0] += 1
            return tok, lp

        return orig(prefill, step, input_ids, attention_mask, **{**kw, "pick": pick})

    # the captured draw (rollout/graph_loop.py) would bypass the loop: sample outside the graph
    fused_on = cg.fused_sampler_on
    gen.decode_loop, cg.decode_loop = loop, loop
    cg.fused_sampler_on = lambda *a: False
    try:
        yield
    finally:
        gen.decode_loop, cg.decode_loop = orig, orig
        cg.fused_sampler_on = fused_on


def job_config(a: argparse.Namespace, s: Setup, run_dir: str) -> dict[str, Any]:
    """:func:`_ppo_verl.verl_config` (``run_verl``'s config) with ``--spread``'s response
    cap (EOS then not ignored), ``--torch-compile`` and the training processes on
    ``--backend`` (colocated: ``--gpus``; async: one), plus the async keys in ``--mode
    async``."""
    cfg = verl_config(s, run_dir)
    if a.spread is not None:
        cfg["rollout"].update(max_new_tokens=a.spread[1], ignore_eos=False)
    cfg["train"]["torch_compile"] = {"auto": "auto", "on": True, "off": False}[a.torch_compile]
    cfg["comm"] = {"nproc": a.gpus if a.mode == "colocated" else 1, "backend": a.backend}
    if a.mode == "async":
        cfg["rollout"].update(
            mode="async", n_ranks=1, max_staleness=1, sync_wire=a.sync_wire, dtype=a.rollout_dtype
        )
        cfg["algorithm"] = {"policy_loss": "decoupled"}
    return cfg


def _timed_steps(trainer: Any, s: Setup, spread: tuple[int, int] | None) -> list[dict]:
    """``warmup + steps`` train steps, each between device-synchronised points (and, with
    more than one training rank, a barrier before each)."""
    import torch.distributed as dist

    many = dist.is_initialized() and dist.get_world_size() > 1  # colocated on 2 ranks
    out = []
    for step in range(s.warmup + s.steps):
        _sync()
        if many:
            dist.barrier()  # the ranks start each step together (as run_verl)
        t0 = time.perf_counter()
        m = trainer.train_step(step)
        _sync()
        dt = time.perf_counter() - t0
        trainer.step = step + 1
        bad = [k for k, v in m.items() if not math.isfinite(v)]
        if bad:
            raise RuntimeError(f"step {step}: non-finite metrics {bad}")
        if spread is None and m["response/length_mean"] < 0.95 * s.response_len:
            raise RuntimeError(f"step {step}: responses shorter than {s.response_len}")
        keep = ("perf/tokens", "response/length_mean", "response/clip_ratio", "actor/pg_loss")
        row = {k: m[k] for k in keep if k in m}
        row.update({k: v for k, v in m.items() if k.startswith(("timing_s/", "async/"))})
        out.append({"step_s": dt, **row})
    return out


def main(argv: list[str] | None = None) -> int:
    """One rank of one launch (see the module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("colocated", "async"), required=True)
    p.add_argument("--spread", type=int, nargs=2, default=None, metavar=("LO", "HI"))
    p.add_argument("--raw", required=True, help="JSONL file rank 0 appends its result to")
    p.add_argument("--tag", default="{}", help="JSON fields copied into the result")
    p.add_argument("--backend", default="auto")
    p.add_argument("--rollout-dtype", default="bfloat16")
    p.add_argument("--sync-wire", choices=("full", "delta"), default="delta")
    p.add_argument("--torch-compile", choices=("auto", "on", "off"), default="off")
    p.add_argument("--gpus", type=int, default=1, help="colocated: comm.nproc")
    p.add_argument("--probe-bytes", type=int, default=0, help="async: bridge probe size")
    for k, d in (("prompt-len", 256), ("response-len", 256), ("rollout-batch", 128)):
        p.add_argument(f"--{k}", type=int, default=d)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shape", default="qwen05b")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--run-dir", required=True)
    a = p.parse_args(argv)
    s = Setup(
        shape=a.shape, prompt_len=a.prompt_len, response_len=a.response_len,
        rollout_batch=a.rollout_batch, micro_batch=a.micro_batch, warmup=a.warmup,
        steps=a.steps, model_dir=a.model_dir,
    )  # fmt: skip
    cfg = job_config(a, s, a.run_dir)
    tok = load_tokenizer(s.model_dir)
    task = FixedLengthTask(fixed_length_prompts(tok, s.rollout_batch, s.prompt_len, s.seed))
    spread = tuple(a.spread) if a.spread else None
    lengths = forced_lengths(*spread, s.seed) if spread else _nothing()
    probe = probing_join(a.probe_bytes) if a.mode == "async" else _nothing({})
    if a.mode == "async" and int(os.environ["RANK"]) >= 1:  # the rollout rank
        import verl_ppo.asyncrl.rollout_worker as rw
        from verl_ppo.config import build_config

        rw.build_prompt_source = lambda *x, **k: task
        with lengths, probe:
            return rw.run_rollout_rank(build_config(cfg))
    from verl_ppo import PPOTrainer

    trainer = PPOTrainer(cfg)
    with _task_replaced(task):
        with probe as link:
            trainer.setup()
        numerics = check_log_probs_vs_hf(trainer, task, s)  # the plain rollout, no forcing
        with lengths:
            steps = _timed_steps(trainer, s, spread)
    trainer.close()
    timed = steps[s.warmup :]
    res = {
        **json.loads(a.tag),
        "mode": a.mode,
        "gpus": a.gpus,
        "training_ranks": cfg["comm"]["nproc"],
        "sync_wire": a.sync_wire if a.mode == "async" else None,
        "link": link or None,
        "spread": list(spread) if spread else None,
        "tokens": sum(r["perf/tokens"] for r in timed),
        "seconds": sum(r["step_s"] for r in timed),
        "numerics": numerics,
        "steps": steps,
        "fast_path": dict(trainer.job.reasons),
    }
    res["tokens_per_s"] = res["tokens"] / res["seconds"]
    with open(a.raw, "a") as f:
        f.write(json.dumps(res) + "\n")
    print(json.dumps({k: res[k] for k in ("mode", "spread", "tokens_per_s")}), flush=True)
    return 0


@contextmanager
def _nothing(value: Any = None):
    yield value


if __name__ == "__main__":
    sys.exit(main())
