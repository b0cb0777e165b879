"""``verl-comm`` command line: dispatches to the subcommand modules.

Subcommands (each owned by its module, imported lazily so ``--help`` is fast):
  nccl lint|show|autotune   -> verl_comm.cli.nccl
  doctor                    -> verl_comm.doctor
  bench allreduce           -> verl_comm.bench.cli
  profile report DIR        -> verl_comm.profiler.cli
"""

from __future__ import annotations

import importlib
import sys

_SUBCOMMANDS = {
    "nccl": ("verl_comm.cli.nccl", "NCCL environment: lint, show a preset, autotune"),
    "doctor": ("verl_comm.doctor", "check versions, kernels, env, topology and collectives"),
    "bench": ("verl_comm.bench.cli", "collective benchmarks (nccl-tests style)"),
    "profile": ("verl_comm.profiler.cli", "profile reports and diagnosis"),
}


def _usage() -> str:
    lines = ["usage: verl-comm <command> [args]", "", "commands:"]
    lines += [f"  {name:<9} {desc}" for name, (_, desc) in _SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``verl-comm``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from verl_comm import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _SUBCOMMANDS:
        print(f"verl-comm: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)
