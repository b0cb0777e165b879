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


def test_export_lines_run_on_the_default_job():
    """Each ``verl-ppo export`` line of the README parses, names a step the default job
    keeps a checkpoint of, and asks for a critic only if the default job has one."""
    import shlex

    from verl_ppo.config import load_config
    from verl_ppo.run.export import build_parser

    cfg = load_config(ROOT / "configs" / "default.yaml")
    t = cfg.train
    saved = {s for s in range(1, t.num_steps + 1) if t.save_interval and s % t.save_interval == 0}
    kept = sorted(saved | {t.num_steps})[-t.keep_last_checkpoints :]
    lines = [
        x.split("#")[0].strip()
        for x in (ROOT / "README.md").read_text().splitlines()
        if x.startswith("verl-ppo export")
    ]
    assert lines
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[2:])
        assert args.run_dir.rstrip("/") == cfg.run_dir, line
        assert args.step is None or args.step in kept, (line, kept)
        assert not args.critic or cfg.algorithm.adv_estimator == "gae", line


def test_setup_asks_for_the_cpu_torch_build_and_the_readme_says_so():
    """Not this machine's pip configuration: .ci/setup names the CPU build and PyTorch's CPU
    index itself; the README says what a plain install gets and names the first-launch
    DeepSpeed op build in the Quick start time."""
    setup = (ROOT / ".ci" / "setup").read_text()
    assert "torch==2.13.0+cpu" in setup and "https://download.pytorch.org/whl/cpu" in setup
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in quick
    assert "CUDA build" in quick and "DeepSpeed's shared-memory" in quick
