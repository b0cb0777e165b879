"""Where a PPO step's time outside its phases goes: a stack sampler on the host.

The step's phases (``timing_s/<phase>``) are synchronised at both ends; the rest of the step
(prompts, tokenization, building the experience, metrics) is host work between them. This
runs ours as ``benchmarks/ppo_throughput.py`` does (same workload, same options, one
process), samples the main thread's Python stack every ``--interval-ms`` from a second
thread (``sys._current_frames``) during the timed steps, and attributes each sample
inside ``PPOTrainer.train_step`` either to a phase or to the function the step was in
(the caller of the innermost frame that is not a phase). Prints milliseconds per step by
place, largest first, next to the measured step and phase times. Samples are taken when
the sampler thread gets the GIL, so they lean towards calls that release it; the step's
own functions between phases (:data:`TIMED`) and each phase's wait at entry for device work
queued before it are also timed exactly, by wrapping them.

    python benchmarks/gpu/profile_step_host.py --model-dir .whl/tok [workload options]

A diagnostic: its samples cost the main thread a little GIL time, so its step times are
not records.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

import ppo_throughput as pt  # noqa: E402
from _ppo_verl import run_verl  # noqa: E402
from _ppo_workload import Setup  # noqa: E402

# Callees of PPOStep.train_step / ExperienceMaker.make_experience that run inside a phase.
PHASE_CALLEES = {
    "_score_tokens": "ref/values",
    "_advantages": "adv",
    "_update": "update",
    "_generate": "gen",
    "wait": "reward",
    "score": "reward",
}
OWNERS = ("train_step", "make_experience")
# (module, class or None, function) timed exactly: the step's work outside its phases.
# step_prompts is the step's own prompt work: taking its prefetched tokens and drawing the
# next step's texts (prompts, on this thread); _tokenize runs on the prefetch thread
# (verl_ppo/step/prompt_prefetch.py), overlapped with the step.
TIMED = (
    ("verl_ppo.step.experience_maker", "ExperienceMaker", "step_prompts"),
    ("verl_ppo.step.experience_maker", "ExperienceMaker", "prompts"),
    ("verl_ppo.step.experience_maker", "ExperienceMaker", "_tokenize"),
    ("verl_ppo.step.experience_maker", "ExperienceMaker", "_response_mask"),
    ("verl_ppo.step.ppo_step", None, "rollout_metrics"),
    ("verl_ppo.step.ppo_step", "PPOStep", "_perf_metrics"),
    ("verl_ppo.step.ppo_step", "PPOStep", "_comm_metrics"),
    ("verl_ppo.step.ppo_step", "PPOStep", "_reduce_metrics"),
)


def wrap_timed(acc: collections.Counter, on: threading.Event) -> None:
    """Wrap :data:`TIMED` and ``Phase.__enter__``'s device wait; seconds into ``acc``."""
    import importlib

    import torch

    from verl_comm.profiler import phases

    def timed(name: str, fn: Any) -> Any:
        def inner(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if on.is_set():
                    acc[name] += time.perf_counter() - t0

        return inner

    for mod, cls, fn in TIMED:
        owner = importlib.import_module(mod)
        owner = getattr(owner, cls) if cls else owner
        if hasattr(owner, fn):  # an older tree may lack one
            setattr(owner, fn, timed(fn, getattr(owner, fn)))
    enter = phases.Phase.__enter__

    def entered(self: Any) -> Any:
        if self.sync and on.is_set():
            t0 = time.perf_counter()
            torch.cuda.synchronize()
            acc["sync at phase entry: " + self.name] += time.perf_counter() - t0
        return enter(self)

    phases.Phase.__enter__ = entered


def classify(frame: Any) -> str | None:
    """The place of one sample: ``phase:<name>``, ``gap:<owner>.<callee>`` or
    ``gap:<owner>:<line>`` (work in the owner itself, e.g. a torch call), or None when the
    stack holds no step."""
    chain = []
    f = frame
    while f is not None:
        chain.append(f)
        f = f.f_back
    chain.reverse()  # outermost first
    for i in range(len(chain) - 1, -1, -1):
        code = chain[i].f_code
        if code.co_name in OWNERS:
            if i + 1 == len(chain):
                return f"gap:{code.co_name}:{chain[i].f_lineno}"
            j = i + 1
            while j + 1 < len(chain) and chain[j].f_code.co_name == "inner":  # wrap_timed
                j += 1
            callee = chain[j].f_code.co_name
            if callee in PHASE_CALLEES:
                return f"phase:{PHASE_CALLEES[callee]}"
            if callee == "make_experience":
                continue
            return f"gap:{code.co_name}.{callee}"
    return None


class Sampler(threading.Thread):
    """Samples ``main``'s stack every ``interval`` seconds while :attr:`on` is set."""

    def __init__(self, main: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.main, self.interval = main, interval
        self.on = threading.Event()
        self.stop = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples = 0

    def run(self) -> None:
        while not self.stop.is_set():
            if self.on.is_set():
                place = classify(sys._current_frames().get(self.main))
                if place is not None:
                    self.counts[place] += 1
                self.samples += 1
            time.sleep(self.interval)


def main(argv: list[str] | None = None) -> int:
    """Run ``--warmup`` + ``--steps`` steps of ours on the workload of
    ``benchmarks/ppo_throughput.py`` (its workload options, ``--set`` overrides), sampling
    the timed steps; prints per-step milliseconds (see the module docstring) and returns 0.

    Raises:
        RuntimeError: from :func:`run_verl` (non-finite metrics, wrong lengths).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pt.add_workload_args(p)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--interval-ms", type=float, default=1.0)
    a = p.parse_args(argv)
    a.run_id, a.variant, a.torch_profile = "host", None, None
    a.trl_micro_batch, a.trl_compile = None, False
    s = Setup.from_args(a)
    import verl_ppo.step.ppo_step as ps
    from verl_ppo.config import parse_overrides

    s.overrides = pt._flatten(parse_overrides(a.set)) if a.set else {}

    sampler = Sampler(threading.get_ident(), a.interval_ms / 1e3)
    sampler.start()
    exact: collections.Counter[str] = collections.Counter()
    wrap_timed(exact, sampler.on)
    orig = ps.PPOStep.train_step
    walls: list[float] = []

    def timed(self: Any, step: int) -> dict[str, float]:
        on = step >= a.warmup
        if on:
            sampler.on.set()
        t0 = time.perf_counter()
        try:
            return orig(self, step)
        finally:
            if on:
                walls.append(time.perf_counter() - t0)
            sampler.on.clear()

    ps.PPOStep.train_step = timed
    with tempfile.TemporaryDirectory() as tmp:
        steps = run_verl(s, tmp)
    sampler.stop.set()
    n = max(len(walls), 1)
    per = sum(walls) / n
    total = sum(sampler.counts.values()) or 1
    print(f"timed steps {n}, train_step {per * 1e3:.1f} ms each, {sampler.samples} samples")
    last = steps[-1]
    phases = last["phases"]
    print("phases of the last step (ms):", {k: round(v * 1e3, 1) for k, v in phases.items()})
    print(f"outside the phases (last step): {(last['step_s'] - sum(phases.values())) * 1e3:.1f} ms")
    print("samples by place (ms per step, scaled to train_step's wall time):")
    for place, c in sampler.counts.most_common(25):
        print(f"  {c / total * per * 1e3:8.2f}  {place}")
    print("timed exactly (ms per step):")
    for name, sec in exact.most_common():
        print(f"  {sec / n * 1e3:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
