"""``verl-ppo`` command line: ``train`` (the main job), ``export``, ``eval``, ``generate``,
``reward-server``, ``data export``."""

from __future__ import annotations

import sys

from verl_comm.extras import install_hint


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``verl-ppo <command> ...``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: verl-ppo train --config FILE [dotted.key=value ...]\n"
        "       verl-ppo export RUN_DIR [--step N] OUT_DIR [--critic]\n"
        "       verl-ppo eval --model RUN_DIR|HF_FOLDER|HF_ID [--task T] [--n 64]\n"
        "       verl-ppo generate --model RUN_DIR|HF_FOLDER|HF_ID --prompt TEXT\n"
        "       verl-ppo reward-server [--host H] [--port P] [--model SPEC]\n"
        "       verl-ppo data export --task NAME --n N --out FILE.parquet|FILE.jsonl"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if argv[0] in ("-V", "--version"):
        from verl_ppo import __version__

        print(__version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in ("train", "export", "eval", "generate", "reward-server", "data"):
        print(f"verl-ppo: unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    try:
        if cmd == "train":
            from verl_ppo.train import main as train_main

            return train_main(rest)
        if cmd == "export":
            from verl_ppo.run.export import main as export_main

            return export_main(rest)
        if cmd == "data":
            from verl_ppo.data.export_cli import main as data_main

            return data_main(rest)
        if cmd in ("eval", "generate"):
            from verl_ppo.step.evaluate import eval_main, generate_main

            return (eval_main if cmd == "eval" else generate_main)(rest)
        from verl_ppo.reward.server import main as server_main

        return int(server_main(rest) or 0)
    except KeyboardInterrupt:
        print(f"verl-ppo {cmd}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:  # verl_ppo's dependencies are the 'ppo' extra
        hint = install_hint(exc)
        if hint is None:
            raise
        print(f"verl-ppo: {hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
