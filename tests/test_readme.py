"""The README's two Quick start commands are the ones CI runs and they name real files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, re.DOTALL)


def test_exactly_two_quick_start_commands():
    cmds = _quick_start_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds)


def test_ci_runs_the_readme_test_command():
    train_cmd, test_cmd = _quick_start_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, "the README test command must appear verbatim in .ci/run"
    assert "pytest" in test_cmd and "verl-ppo train" in train_cmd


def test_commands_reference_existing_files():
    train_cmd, _ = _quick_start_commands()
    cfg = re.search(r"--config (\S+)", train_cmd).group(1)
    assert (ROOT / cfg).is_file()
    assert (ROOT / ".ci" / "setup").is_file()
