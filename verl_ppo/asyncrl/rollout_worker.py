"""A rollout rank of the async mode: generate, score and ship batches; switch weights
between batches.

Rollout rank ``i`` makes the batches of training ranks ``i, i + R, ...``
(:meth:`~verl_ppo.asyncrl.world.AsyncWorld.served_by`), each with the colocated mode's own
:class:`~verl_ppo.step.experience_maker.ExperienceMaker` for that training rank (same
prompts, same sampling seeds, same reward), on the HF policy whose parameters are the
synced weights (:class:`~verl_ppo.asyncrl.weights.RolloutWeights`), or at
``rollout.tensor_model_parallel_size > 1`` on the TP model over the synced shards
(:mod:`~verl_ppo.asyncrl.tp_rollout`; the TP group generates its members' batches
together). Batch ``k`` is generated
with weights version ``max(k - rollout.max_staleness, first step)``: the schedule is fixed,
so a run is reproducible, and with ``max_staleness: 1`` batch ``k + 1`` is generated while
the training ranks train on batch ``k`` (version ``k`` arrives while batch ``k`` is being
sent). The next version is received in the background while generating; the switch waits
only for what is left of it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from verl_ppo.asyncrl.channel import ExperienceChannel
from verl_ppo.asyncrl.tp_rollout import NoStrategy, SyncedRollout, tp_rollout_model
from verl_ppo.asyncrl.weights import DTYPES, RolloutWeights, sync_plan
from verl_ppo.asyncrl.world import AsyncWorld
from verl_ppo.data.file_source import build_prompt_source
from verl_ppo.job.fast_path import ModelFacts, model_config_of, resolve
from verl_ppo.observe.metrics import PhaseTimer, get_logger
from verl_ppo.step.experience_maker import ExperienceMaker
from verl_ppo.workers.build import build_reward
from verl_ppo.workers.models import build_policy, load_tokenizer


class _Policy:
    """What :class:`ExperienceMaker` reads of an actor: the HF module it generates with
    (and, with a TP rollout model, the strategy it asks for training weights)."""

    def __init__(self, module: torch.nn.Module, strategy: Any = None) -> None:
        self.module, self.strategy = module, strategy


class RolloutWorker:
    """One rollout rank (see the module docstring).

    Args:
        cfg: the config (``rollout.mode: async``).
        world: the async world (this process a rollout rank).

    Raises:
        ValueError: the sync plan cannot serve the model or the layouts.
    """

    def __init__(self, cfg: Any, world: AsyncWorld) -> None:
        self.cfg, self.world = cfg, world
        cuda = torch.cuda.is_available() and world.cuda
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        model_config = model_config_of(cfg)
        job = resolve(cfg, cuda, ModelFacts.of_config(model_config))
        self.log = get_logger(world.rank)
        tokenizer = load_tokenizer(cfg.model)
        task = build_prompt_source(cfg, tokenizer, None)  # the training ranks log its counts
        plan = sync_plan(cfg, model_config, job.actor_zero_stage)
        r, hybrid = cfg.rollout, None
        if r.tensor_model_parallel_size == 1:  # the HF forward, as the colocated mode
            policy = build_policy(cfg.model, tokenizer, DTYPES[r.dtype], cfg.seed)
            self.weights = RolloutWeights(
                plan, world, cfg, policy.to(self.device).eval(), self.device
            )
            holder = _Policy(policy)
        else:  # TP x DP: the TP model on the synced shards
            self.weights = RolloutWeights(plan, world, cfg, None, self.device)
            hybrid = SyncedRollout(
                tp_rollout_model(
                    model_config, self.weights.receiver.live, r.n_ranks,
                    r.tensor_model_parallel_size, world.timeout_s,
                )
            )  # fmt: skip
            holder = _Policy(torch.nn.Module(), NoStrategy())
        reward = build_reward(cfg, task, self.device, world.timeout_s)
        d = cfg.derived(world.n_train)
        self.served = world.served_by(world.rank)
        self.makers = [
            ExperienceMaker(
                cfg,
                d,
                tokenizer,
                task,
                holder,
                reward,
                rank=t,
                world_size=world.n_train,
                device=self.device,
                timeout_s=world.timeout_s,
                hybrid=hybrid,
                use_cuda_graph=job.use_cuda_graph,
            )  # fmt: skip
            for t in self.served
        ]
        self.channel = ExperienceChannel(
            world.experience, world.rank, world.wire_device, world.timeout_s
        )

    def run(self) -> None:
        """Make every batch of the run's steps, then take the remaining weight versions.

        Raises:
            WeightSyncError, RolloutLinkError: a dead or late training rank (named).
        """
        first, total = self.world.start_step(), self.cfg.train.num_steps
        if first >= total:
            return
        last = total - 1  # the last version the training ranks publish
        self.weights.start()
        for k in range(first, total):
            while self.weights.version is None or self.weights.version < max(
                k - self.cfg.rollout.max_staleness, first
            ):
                self.weights.switch(first, last)
            for t, maker in zip(self.served, self.makers):
                timer = PhaseTimer()
                with torch.no_grad():
                    exp, _ = maker.make_experience(k, timer)
                stats = {**self.weights.last, "async/rollout_gen_s": timer.times["gen"]}
                self.channel.send(t, k, self.weights.version, exp, stats)
        while self.weights.version < last:
            self.weights.switch(first, last)
        self.channel.finish()

    def close(self) -> None:
        """Stop the reward threads."""
        for m in self.makers:
            m.close()


def run_rollout_rank(cfg: Any) -> int:
    """Body of a rollout rank (joins the async world first); returns its exit code.

    SIGINT/SIGTERM (forwarded by the launcher, or Ctrl-C under torchrun) do not stop a
    rollout rank by themselves: the training ranks finish the current step, save its
    checkpoint and exit, which ends the rollout rank's next wait on them; that end, after a
    signal, is the stop (exit ``128 + signal``, one line from the first rollout rank), not
    a failure.

    Raises:
        WeightSyncError, RolloutLinkError: a dead or late training rank without a signal.
    """
    from verl_ppo.asyncrl.channel import RolloutLinkError
    from verl_ppo.asyncrl.world import join_world
    from verl_ppo.reshard.group_sync import WeightSyncError
    from verl_ppo.run.folder import StopRequest

    world = join_world(cfg)
    logging.getLogger(__name__).debug(
        "rollout rank %d serves %s", world.rank, world.served_by(world.rank)
    )
    worker = RolloutWorker(cfg, world)
    stop = StopRequest().install()
    try:
        worker.run()
    except (WeightSyncError, RolloutLinkError):
        if not stop.signum:
            raise
        if world.rank == world.n_train:  # every rollout rank got it: say it once
            print(
                f"verl-ppo [rank {world.rank}]: signal {stop.signum}: the rollout ranks "
                "stopped with the training ranks (they saved the checkpoint of their last "
                "step)",
                file=sys.stderr,
            )
        return 128 + stop.signum
    finally:
        stop.restore()
        worker.close()
    return 0
