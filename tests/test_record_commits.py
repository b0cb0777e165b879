"""Every benchmark record names a commit of main's history (so its code can be checked
out), except the few old runs listed, with the reason, in benchmarks/results/README.md;
and no record is written twice."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _listed() -> set[str]:
    text = (RESULTS / "README.md").read_text()
    section = text.split("## Records whose commit is not on main", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([^`]+)`", section))


def test_every_record_commit_is_on_main():
    if _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout: record commits cannot be checked")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("shallow clone: the history the records name is not here")
    listed, missing = _listed(), {}
    for f in sorted(RESULTS.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            c = json.loads(line).get("commit") if line.strip() else None
            if not c or c in listed or c in missing:
                continue
            if _git("merge-base", "--is-ancestor", c, "HEAD").returncode != 0:
                missing[c] = f.name
    assert not missing, f"records name commits outside main's history: {missing}"


def test_no_record_is_repeated():
    # A record equal to another of its file apart from its date is a duplicate: a report
    # that appends its ratio each time it is written, a static figure re-appended by each
    # call of one run. Two measurements of a time never agree to the last bit.
    repeated: dict[str, list[int]] = {}
    for f in sorted(RESULTS.glob("*.jsonl")):
        seen: set[str] = set()
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            rec = {k: v for k, v in json.loads(line).items() if k != "date"}
            key = json.dumps(rec, sort_keys=True)
            if key in seen:
                repeated.setdefault(f.name, []).append(i)
            seen.add(key)
    assert not repeated, f"records repeated (file: line numbers): {repeated}"
