"""A slow custom reward function for ``benchmarks/user_data.py``: sleeps ``SLEEP_S`` per call
(a stand-in for a Python scorer that parses, runs a checker, or calls a tool), then scores
with ``examples/arithmetic_reward.py``'s rule."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

SLEEP_S = float(os.environ.get("USER_DATA_SLEEP_S", "0.05"))
_spec = importlib.util.spec_from_file_location(
    "arithmetic_reward", Path(__file__).resolve().parents[1] / "examples" / "arithmetic_reward.py"
)
_rule = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rule)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """``examples/arithmetic_reward.py``'s score after sleeping ``SLEEP_S`` seconds."""
    time.sleep(SLEEP_S)
    return _rule.compute_score(data_source, solution_str, ground_truth, extra_info)
