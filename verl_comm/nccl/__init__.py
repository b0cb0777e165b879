"""NCCL environment: variable registry, linter, presets and topology (runtime: applied and
checked before ``init_process_group``). The tools on top live elsewhere: ``verl-comm nccl``
in :mod:`verl_comm.cli.nccl`, the preset autotune in :mod:`verl_comm.bench.autotune`.

Typical use, before ``init_process_group``::

    from verl_comm.nccl import apply_preset, lint
    effective_env = apply_preset("cloud-tcp")      # never overrides the user's own variables
    for finding in lint(os.environ):
        print(finding.severity, finding.variable, finding.message, finding.fix)
"""

from verl_comm.nccl.lint import Finding, has_errors, lint
from verl_comm.nccl.presets import PRESETS, Preset, PresetEntry, apply_preset, get_preset
from verl_comm.nccl.registry import REGISTRY, EnvVar, lookup, nccl_names, strtoll0
from verl_comm.nccl.topology import HostInfo, TopoMatrix, detect_host, parse_topo_matrix

__all__ = [
    "PRESETS",
    "REGISTRY",
    "EnvVar",
    "Finding",
    "HostInfo",
    "Preset",
    "PresetEntry",
    "TopoMatrix",
    "apply_preset",
    "detect_host",
    "get_preset",
    "has_errors",
    "lint",
    "lookup",
    "nccl_names",
    "parse_topo_matrix",
    "strtoll0",
]
