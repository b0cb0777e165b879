"""Records say whether a run was made from uncommitted changes (verl_comm.bench.env.dirty)."""

import subprocess

from verl_comm.bench.env import dirty


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_dirty_from_git_status(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_DIRTY", raising=False)
    assert dirty(tmp_path) is None  # not a git tree: unknown, not "clean"
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "b.jsonl").write_text("{}\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    assert dirty(tmp_path) is False
    # the records a benchmark appends do not count
    (tmp_path / "benchmarks" / "results" / "b.jsonl").write_text("{}\n{}\n")
    assert dirty(tmp_path) is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert dirty(tmp_path) is True
    _git(tmp_path, "checkout", "code.py")
    (tmp_path / "new.py").write_text("")  # untracked code counts
    assert dirty(tmp_path) is True


def test_dirty_passed_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_DIRTY", "1")  # a tree copied without .git, checked before
    assert dirty(tmp_path) is True
    monkeypatch.setenv("VERL_DIRTY", "0")
    assert dirty(tmp_path) is False
