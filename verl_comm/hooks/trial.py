"""Trial steps of ``policy: auto`` on CPU hosts: the model's plan timed against the others.

:func:`~verl_comm.compression.policy.choose_method` predicts each bucket's path from an
alpha-beta link model and the compressor's compute timed alone. On a CPU host the compute
shares the cores with backward and with the other ranks of the host, which the model does
not see: on the shaped 1 Gbit/s veth with 4 gloo ranks on 2 cores
(``WORLD=4 benchmarks/slow_link_hooks.sh``, run ``c0983a2726d6`` in
``benchmarks/results/comm_hooks.md``) it predicted int8 to end bucket 1's chain 103 ms
before bf16's, and the plan it took (plain, int8, int8) ran 1282 ms a step against 1218 ms
for bf16 on every bucket.

So after the decision step the hooks run ``config.auto_trial_steps`` steps of each
candidate plan, one after the other: the model's plan first, then each path applied to
every bucket that may take it (plain included; duplicates dropped). A step's time is taken
where the step ends for the hooks (the last bucket's chain done, :meth:`CommHookState.
end_step`) from the previous step's end: optimizer, forward, backward and this step's
reductions, all under the plan of this step. Each candidate's time is the median of its
steps, the slowest rank's (one MAX all-reduce of the medians), and the fastest candidate
is kept from then on (a candidate within ``MARGIN`` of it wins if it comes earlier: the
model's plan first). What was measured and kept is logged (logger ``verl_comm.hooks``).

Error feedback stays correct across plan changes: a bucket's residual is the error not yet
sent, kept in its state while other paths run, and added when its path runs again. Once a
plan is kept, the state of the paths a bucket no longer takes is freed (the EF state stays
what the kept path holds; the error it carried, at most one step's, is not sent).
The agreement runs in the first hook call of the step after the trials, in the caller's
thread, when the worker is drained (nothing else is in flight on the group). Every input
of the schedule is the iteration and the decisions, the same on every rank.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

from verl_comm.compression.collective import Collective
from verl_comm.compression.lowrank import LowRankBucketState

logger = logging.getLogger("verl_comm.hooks")

MARGIN = 0.02
"""A candidate within this fraction of the fastest one's time counts as as fast (the
earlier one wins: the model's plan, then the uniform plans from most to least precise)."""


@dataclass
class Trial:
    """Trial schedule and measurements of one decision round (one ``_measure_at``).

    Attributes:
        measure_at: the state's measurement step this round belongs to.
        start: first trial iteration; candidate ``k`` runs iterations ``start + k * steps``
            to ``start + (k + 1) * steps - 1``.
        steps: steps per candidate.
        names: ``"model"`` and ``"all <path>"`` per candidate. plans: bucket index -> path.
        ends: ``perf_counter`` at each trial iteration's end (and the step before).
        chosen: the kept candidate's index once agreed, else None.
    """

    measure_at: int
    start: int
    steps: int
    names: list[str]
    plans: list[dict[int, str]]
    ends: dict[int, float] = field(default_factory=dict)
    chosen: int | None = None
    times_s: list[float] = field(default_factory=list)

    @property
    def stop(self) -> int:
        """First iteration after the trials."""
        return self.start + self.steps * len(self.plans)

    def plan_at(self, iteration: int) -> dict[int, str] | None:
        """The plan of ``iteration``: the kept one once agreed, a candidate's during the
        trials, else None (the decisions')."""
        if self.chosen is not None:
            return self.plans[self.chosen]
        if self.start <= iteration < self.stop:
            return self.plans[(iteration - self.start) // self.steps]
        return None

    def path(self, index: int, iteration: int) -> str | None:
        """The path bucket ``index`` takes at ``iteration`` (None: the decision's)."""
        plan = self.plan_at(iteration)
        return None if plan is None else plan.get(index)

    def step_times(self) -> list[float]:
        """Median seconds per step of each candidate (inf where no step was timed)."""
        out = []
        for k in range(len(self.plans)):
            its = range(self.start + k * self.steps, self.start + (k + 1) * self.steps)
            ts = [
                self.ends[i] - self.ends[i - 1]
                for i in its
                if i in self.ends and i - 1 in self.ends
            ]
            out.append(statistics.median(ts) if ts else float("inf"))
        return out


def refuse_explicit(config, device: torch.device) -> None:
    """Trials run on CPU hosts only (the gloo worker): refuse ``auto_trial_steps`` set by
    the user where they cannot apply.

    Raises:
        ValueError: ``auto_trial_steps`` > 0 was set explicitly and the buckets are on
            ``device`` without the gloo worker (CUDA, or in-process collectives).
    """
    if "auto_trial_steps" in config.model_fields_set and config.auto_trial_steps > 0:
        raise ValueError(
            f"auto_trial_steps={config.auto_trial_steps}: trial steps run on CPU hosts with "
            f"a gloo group of W > 1 only, and these buckets are on {device} (the model's "
            "plan is kept there); remove auto_trial_steps or set it to 0"
        )


def path_of(state, index: int, decided: str) -> str:
    """The path bucket ``index`` takes at the state's current iteration: its trial plan's
    while trials run or once one is kept, else ``decided`` (the model's)."""
    t = state._trial
    if t is None or t.measure_at != state._measure_at:
        return decided
    p = t.path(index, state.iteration)
    return decided if p is None else p


def cast_plan(state) -> dict[int, str] | None:
    """Under policy ``auto`` on the gloo worker, the current step's plan when it casts
    every bucket (fp16 / bf16 only): those steps take torch's order
    (:mod:`verl_comm.hooks.direct`) instead of the worker; None otherwise. The same on
    every rank: it reads the iteration, the decisions and the agreed trial only."""
    if state.config.policy != "auto" or state.iteration < state._measure_at + 2:
        return None
    t = state._trial
    if t is not None and t.measure_at == state._measure_at:
        plan = t.plan_at(state.iteration)  # None only on the agreeing step: the worker path
    else:
        plan = {i: b.decision.path for i, b in state.buckets.items() if b.decision is not None}
        if len(plan) != len(state.buckets):
            return None
    return plan if plan and all(p in ("fp16", "bf16") for p in plan.values()) else None


def _build(state) -> Trial | None:
    decisions = {i: b.decision for i, b in state.buckets.items() if b.decision is not None}
    steps = state.config.auto_trial_steps
    if steps <= 0 or not decisions:
        return None
    model = {i: d.path for i, d in sorted(decisions.items())}
    names, plans = ["model"], [model]
    paths: list[str] = []
    for d in decisions.values():
        paths += [m for m in (d.options or {}) if m not in paths]
    for m in paths:
        plan = {
            i: (m if m in (d.options or {}) else model[i]) for i, d in sorted(decisions.items())
        }
        if plan not in plans:
            names.append(f"all {m}")
            plans.append(plan)
    if len(plans) < 2:
        return None
    t = Trial(state._measure_at, state.iteration, steps, names, plans)
    if state._last_end_s is not None:
        t.ends[state.iteration - 1] = state._last_end_s
    logger.info(
        "policy auto: %d steps of each plan from iteration %d: %s",
        steps,
        t.start,
        "; ".join(
            f"{n}: " + ", ".join(f"{i} {p}" for i, p in pl.items()) for n, pl in zip(names, plans)
        ),
    )
    return t


def on_step_end(state, iteration: int) -> None:
    """Record the end of ``iteration`` (worker or caller thread; called by ``end_step``)."""
    now = time.perf_counter()
    state._last_end_s = now
    t = state._trial
    if t is not None and t.chosen is None and t.start <= iteration < t.stop:
        t.ends[iteration] = now


def at_step_start(state, coll: Collective, device: torch.device) -> None:
    """First hook call of a step (every rank, the caller's thread, the worker drained:
    nothing of ours in flight). Right after the decision step, start the trials (every
    bucket has decided); at the end of the trials, agree the candidates' times (MAX over
    ranks) and keep the fastest."""
    t = state._trial
    if t is not None and t.measure_at != state._measure_at:  # recalibrated or loaded
        t = state._trial = None
    if t is None:
        if state.iteration == state._measure_at + 2 and state._trial_round != state._measure_at:
            state._trial_round = state._measure_at
            state._trial = _build(state)
        return
    if t.chosen is not None or state.iteration < t.stop:
        return
    local = t.step_times()
    agreed = torch.tensor([min(v, 1e9) for v in local], dtype=torch.float64, device=device)
    coll.all_reduce_max(agreed)
    t.times_s = [float(v) for v in agreed.tolist()]
    best = min(t.times_s)
    t.chosen = next(k for k, v in enumerate(t.times_s) if v <= best * (1 + MARGIN))
    _drop_unkept_state(state, t.plans[t.chosen])
    logger.info(
        "policy auto: trial steps (%d per plan, ms per step, slowest rank's median): %s; "
        "kept %s: %s",
        t.steps,
        ", ".join(f"{n} {v * 1e3:.0f}" for n, v in zip(t.names, t.times_s)),
        t.names[t.chosen],
        ", ".join(f"bucket {i} {p}" for i, p in t.plans[t.chosen].items()),
    )


def _drop_unkept_state(state, plan: dict[int, str]) -> None:
    """Free the error-feedback state of the paths a bucket no longer takes (an int8
    residual, low-rank residuals and Q factors), so the state stays what the kept path
    holds. The error those residuals carried is not sent: at most one step's compression
    error of that path, once."""
    for i, bs in state.buckets.items():
        path = plan.get(i)
        if path is None:
            continue
        if path != "int8":
            bs.residual = None
        if path != "lowrank_int8":
            bs.lowrank = LowRankBucketState()


def saved(t: Trial | None) -> dict | None:
    """The kept plan of a finished trial, for ``state_dict`` (None otherwise: a trial cut
    short by a save runs again after the load)."""
    if t is None or t.chosen is None:
        return None
    return {"names": t.names, "plans": t.plans, "times_s": t.times_s, "chosen": t.chosen,
            "steps": t.steps}  # fmt: skip


def restored(d: dict | None, measure_at: int) -> Trial | None:
    """A finished trial from :func:`saved`, attached to the loaded state's ``measure_at``."""
    if d is None:
        return None
    plans = [{int(i): p for i, p in plan.items()} for plan in d["plans"]]
    return Trial(measure_at, 0, int(d["steps"]), list(d["names"]), plans,
                 chosen=int(d["chosen"]), times_s=list(d["times_s"]))  # fmt: skip


def settling(state) -> bool:
    """:attr:`CommHookState.auto_settling` (see there)."""
    if state.config.policy != "auto" or state.iteration < state._measure_at + 3:
        return state.config.policy == "auto"
    t = state._trial
    return t is not None and t.measure_at == state._measure_at and t.chosen is None


def describe(t: Trial | None) -> str | None:
    """One line on the trial for the step log (None when there was none)."""
    if t is None:
        return None
    if t.chosen is None:
        return f"trial of {len(t.plans)} plans, iterations {t.start}-{t.stop - 1}"
    times = ", ".join(f"{n} {v * 1e3:.0f}" for n, v in zip(t.names, t.times_s))
    return f"trial ms/step: {times}; kept {t.names[t.chosen]}"
