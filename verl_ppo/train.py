"""Train a policy with PPO: the main job.

Single host, CPU (launches ``comm.nproc`` gloo processes itself)::

    verl-ppo train --config configs/default.yaml
    python -m verl_ppo.train --config configs/default.yaml train.num_steps=4

GPUs, one node (NCCL)::

    torchrun --nproc_per_node=8 -m verl_ppo.train --config configs/default.yaml

With ``rollout.mode=async`` the job has ``comm.nproc`` training ranks plus
``rollout.n_ranks`` rollout ranks (ranks ``comm.nproc ..``); torchrun starts all of them.

Several nodes: the same torchrun line with ``--nnodes=N --node_rank=i
--rdzv_endpoint=HOST:PORT`` on every node.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``verl-ppo train``."""
    p = argparse.ArgumentParser(prog="verl-ppo train", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    return p


def run_rank(config_path: str | None, overrides: list[str]) -> int:
    """Body of one rank: build the trainer, run it, tear down; returns an exit code."""
    from verl_ppo.config import load_config
    from verl_ppo.trainer import PPOTrainer

    cfg = load_config(config_path, overrides)
    if cfg.rollout.mode == "async" and int(os.environ.get("RANK", "0")) >= cfg.comm.nproc:
        from verl_ppo.asyncrl.rollout_worker import run_rollout_rank

        return run_rollout_rank(cfg)  # ranks comm.nproc.. are the rollout ranks
    trainer = PPOTrainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    return 128 + trainer.stopped_by if trainer.stopped_by else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: validate the config, then run this rank or launch the ranks. Ctrl-C
    before the ranks start (imports, checks) ends with a message and exit code 130."""
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        print(
            "verl-ppo: interrupted (Ctrl-C) during start-up, before any rank started: "
            "nothing was trained or saved",
            file=sys.stderr,
        )
        return 130


def _main(args: argparse.Namespace) -> int:
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if not under_launcher:  # a busy or unusable run_dir is refused before torch is imported
        from verl_ppo.run.folder import early_lock_check

        problem = early_lock_check(args.config, args.overrides)
        if problem:
            print(f"verl-ppo: {problem}", file=sys.stderr)
            return 2
    from verl_ppo.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"verl-ppo: {exc}", file=sys.stderr)
        return 2
    if under_launcher:
        from verl_ppo.launch import rank_main

        if not os.environ.get("VERL_PPO_LAUNCHED"):  # torchrun: no parent checked the config
            from verl_ppo.job.preflight import PreflightError, preflight

            try:
                async_ = cfg.rollout.mode == "async"  # WORLD_SIZE counts the rollout ranks
                n = cfg.comm.nproc if async_ else int(os.environ["WORLD_SIZE"])
                preflight(cfg, n, check_port=False)
            except PreflightError as exc:
                if os.environ["RANK"] == "0":  # every rank fails alike: say it once
                    print(f"verl-ppo: {exc}", file=sys.stderr)
                return 2
        os.environ.setdefault("VERL_PPO_RUN_DIR", str(cfg.run_dir))  # tracebacks go there

        return rank_main(lambda: run_rank(args.config, args.overrides))
    from verl_ppo.launch import launch

    return launch(cfg, args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
