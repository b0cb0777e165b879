"""Profiler that finds the bottleneck of a training step and says what to do.

- :class:`VerlProfiler` (:mod:`~verl_comm.profiler.core`): phases, steps, communication,
  memory, built on ``torch.profiler``; writes ``profile_rank{r}.json`` + Chrome trace.
- :mod:`~verl_comm.profiler.phases`: the one phase timer (:class:`PhaseTimer`, per-step
  ``timing_s/<phase>``; records into the profiler while it profiles, one measurement per
  block); :mod:`~verl_comm.profiler.torch_events`: events read back from the Chrome trace.
- :mod:`~verl_comm.profiler.analysis`: metrics of a run; :mod:`~verl_comm.profiler.diagnose`:
  the four symptoms with evidence and remedy; :mod:`~verl_comm.profiler.render`: text, PNG;
  :mod:`~verl_comm.profiler.cli`: ``verl-comm profile report DIR``.
"""

from verl_comm.profiler.core import VerlProfiler
from verl_comm.profiler.diagnose import Thresholds, diagnose
from verl_comm.profiler.phases import PhaseTimer

__all__ = ["PhaseTimer", "VerlProfiler", "Thresholds", "diagnose"]
