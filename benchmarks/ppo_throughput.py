"""PPO throughput, ours (verl_ppo) vs TRL's PPO trainer, same model, lengths and batch.

Protocol (issue 8, "GPU throughput, side by side"):

* Model: a Qwen2.5-0.5B-shaped ``Qwen2ForCausalLM`` with random weights (``--shape qwen05b``:
  hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864, vocab 151936, tied embeddings),
  SmolLM2's tokenizer (vocab 49152 fits the 151936 embedding). Critic / value model: the same
  backbone with a scalar head in both systems.
* Prompts: ``--prompt-len`` (256) real tokens each, no padding: common English words whose
  tokenization is checked to be exactly that long. Both systems get the same prompt texts.
* Responses: exactly ``--response-len`` (256) sampled tokens (ours: ``rollout.ignore_eos``;
  TRL: no stop token). Checked after every step (fail loudly otherwise).
* Batch: ``--rollout-batch`` sequences per step, global (128 = 64 per GPU on 2 GPUs), one
  optimizer step per PPO step for actor and critic (mini-batch = rollout batch, 1 epoch),
  ``--micro-batch`` sequences per forward/backward per rank. TRL: ``per_device_train_batch_size
  = micro``, ``gradient_accumulation_steps = local batch / micro``, ``num_mini_batches = 1``,
  ``local_rollout_forward_batch_size = local batch``; gradient checkpointing off in both.
* dtype: bf16 on GPU in both (ours: DeepSpeed bf16; TRL: bf16 weights + ``bf16=True``).
* Reward: ours a rule (string match, CPU); TRL needs a reward *model*: a 1-layer model of
  the same width, so that its reward costs little, like ours.
* Timing: ``--warmup`` steps untimed, then ``--steps`` steps; each step's wall time is taken
  between CUDA-synchronized points and the max over ranks is kept; the median over steps is
  reported. tokens/s/GPU = rollout batch x (prompt + response) / median step time / GPUs.
  Phase breakdown: ours from the trainer's ``timing_s/*`` (CUDA-synchronized phases); TRL
  from wrappers (synchronized) around its module functions ``batch_generation`` (gen),
  ``forward`` without grad (ref) and ``get_reward`` (values + reward);
  ``update_and_other`` = step minus those (log-probs from the generation scores, GAE, the
  PPO update of policy and value, TRL's logging and cache emptying). TRL computes the old
  log-probs from its generation logits; ours runs a separate ``old_log_prob`` forward.
* Each system runs in its own launch (``torchrun --nproc_per_node=2``): separate processes
  so that neither inherits the other's allocator state or process group.

The fixed-length prompts are not a reasoning-gym task (and reasoning-gym is not installed
on the GPU machine), so the benchmark hands the trainer a :class:`FixedLengthTask` in place
of ``verl_ppo.trainer.build_prompt_source`` for the duration of the run (same ``sample``/``score``
interface). TRL 1.12.0 (the last release with ``trl.experimental.ppo``) imports pandas,
datasets and pyarrow at module level although its PPO training loop never calls them; where
they are not installed (the GPU machine; pyarrow + pandas would exceed the 64 MiB carried
there), :func:`install_import_stand_ins` serves import-time stand-ins whose classes raise on
use. Records say which (``trl_stand_ins``).

This file is the command line; the rest lives in sibling modules, one idea each:
``_ppo_workload.py`` (shapes, :class:`Setup`, prompts, task, tokenizer), ``_ppo_env.py``
(rank/world, versions, device, commit), ``_ppo_verl.py`` (ours, numerics check),
``_ppo_trl.py`` (TRL) and ``_ppo_records.py`` (records, floor, markdown report).

Usage::

    python benchmarks/ppo_throughput.py --smoke --out /tmp/ppo     # CPU, tiny model, < 90 s
    python benchmarks/ppo_throughput.py --export-tokenizer .whl/tok  # tokenizer folder for GPU
    torchrun --nproc_per_node=2 benchmarks/ppo_throughput.py --system verl_ppo \
        --model-dir .whl/tok --out OUT
    torchrun --nproc_per_node=2 benchmarks/ppo_throughput.py --system trl_ppo \
        --model-dir .whl/tok --out OUT
    torchrun --nproc_per_node=2 benchmarks/ppo_throughput.py --system trl_ppo \
        --variant tuned --trl-micro-batch 32 --trl-compile --model-dir .whl/tok --out OUT
    python benchmarks/ppo_throughput.py --report --out OUT           # markdown + speedup
    (against TRL "tuned" when the run has it, else TRL as configured by default; records
    state each system's effective micro-batch, its tokens and ours' token budget)
    (benchmarks/gpu_ppo_throughput.sh OUTDIR does all of that on 2 x H200)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling helper modules
# _commit, _device, _versions: also used as pt._* by benchmarks/profile_ppo.py
from _ppo_env import REPO, _commit, _device, _rank_world, _versions  # noqa: E402, F401
from _ppo_records import (  # noqa: E402
    BENCH,
    TARGET_MFU,
    TARGET_SPEEDUP,
    _skip_record,
    append_records,
    floor_record,
    summarize,
    write_report,
)
from _ppo_trl import run_trl  # noqa: E402
from _ppo_verl import check_log_probs_vs_hf, run_verl  # noqa: E402
from _ppo_workload import (  # noqa: E402
    SHAPES,
    FixedLengthTask,
    Setup,
    export_tokenizer,
    fixed_length_prompts,
)
from import_stand_ins import install_import_stand_ins  # noqa: E402


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload's options (model folder and shape, lengths, batch sizes); shared with
    ``benchmarks/profile_ppo.py``."""
    p.add_argument("--model-dir", default=None, help="config.json + tokenizer folder")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's depth")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--rollout-batch", type=int, default=128, help="sequences per step, global")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per fwd/bwd per rank")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="verl_ppo config override, e.g. gradient_compression=int8 (repeatable)",
    )  # fmt: skip


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 1+1 steps, for CI")
    p.add_argument("--system", choices=("verl_ppo", "trl_ppo", "both"), default="both")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output folder")
    add_workload_args(p)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--report", action="store_true", help="only write the markdown report")
    p.add_argument(
        "--run-id", default=os.environ.get("VERL_RUN_ID"),
        help="id shared by every record of one device call (default: $VERL_RUN_ID, else new)",
    )  # fmt: skip
    p.add_argument("--variant", default=None, help="name of this run's --set overrides")
    p.add_argument(
        "--trl-micro-batch", type=int, default=None,
        help="TRL: per_device_train_batch_size (default --micro-batch); the tuned baseline "
        "uses the largest that fits (--variant tuned)",
    )  # fmt: skip
    p.add_argument("--trl-compile", action="store_true", help="TRL: torch_compile=True")
    p.add_argument(
        "--torch-profile", default=None, metavar="DIR",
        help="ours: profile the last timed step with torch.profiler; rank 0 writes "
        "DIR/kernels_<variant>.txt (device time per op and per phase, top 40)",
    )  # fmt: skip
    p.add_argument("--export-tokenizer", metavar="DIR", help="write the tokenizer folder, exit")
    a = p.parse_args(argv)
    if not a.run_id and not a.report:
        a.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if a.smoke:
        a.shape, a.prompt_len, a.response_len = "tiny", 16, 8
        a.rollout_batch, a.micro_batch, a.warmup, a.steps = 4, 2, 1, 1
    return a


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 = all requested systems measured)."""
    a = _args(argv)
    out = Path(a.out)
    if a.export_tokenizer:
        print(export_tokenizer(a.export_tokenizer, a.shape))
        return 0
    if a.report:
        print(write_report(out, a.run_id))
        return 0
    from verl_ppo.config import parse_overrides

    s = Setup.from_args(a)
    systems = ["verl_ppo", "trl_ppo"] if a.system == "both" else [a.system]
    status = 0
    for system in systems:
        with tempfile.TemporaryDirectory(prefix=f"{system}_") as tmp:
            if system == "verl_ppo":
                s.overrides = _flatten(parse_overrides(a.set))
                env = dict(os.environ)
                steps = run_verl(s, tmp)
                extra: dict[str, Any] = {}
                # Outside torchrun the trainer sets RANK/MASTER_PORT/... for its own one-rank
                # group (destroyed by close()); TRL must not try to join that one.
                for k in set(os.environ) - set(env):
                    del os.environ[k]
            else:
                s.overrides = {}
                if importlib.util.find_spec("trl") is None:
                    reason = "trl is not installed (pip install trl==1.12.0 accelerate)"
                    print(f"# {system} skipped: {reason}")
                    if _rank_world()[0] == 0:
                        append_records(out, [_skip_record(system, reason, s.run_id)])
                    continue
                steps, stand_ins = run_trl(s, tmp)
                extra = {"trl_stand_ins": stand_ins, "trl_reward_model_layers": 1}
        rank, world = _rank_world()
        recs = summarize(system, s, steps, world, extra)
        if system == "verl_ppo":
            fl = floor_record(s, world, recs[0])
            recs += [fl] if fl else []
        if rank == 0:
            append_records(out, recs)
            print(json.dumps({"system": system, "tokens_per_s_per_gpu": recs[0]["value"]}))
    if _rank_world()[0] == 0 and (a.smoke or a.system == "both"):
        write_report(out, s.run_id)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return status


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BENCH",
    "REPO",
    "SHAPES",
    "TARGET_MFU",
    "TARGET_SPEEDUP",
    "FixedLengthTask",
    "Setup",
    "add_workload_args",
    "append_records",
    "check_log_probs_vs_hf",
    "export_tokenizer",
    "fixed_length_prompts",
    "floor_record",
    "install_import_stand_ins",
    "main",
    "run_trl",
    "run_verl",
    "summarize",
    "write_report",
]
