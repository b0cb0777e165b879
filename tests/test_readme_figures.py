"""Every measured figure quoted in README.md and benchmarks/results/README.md has a committed
record behind it.

A figure is a number with a unit or an ``x`` ratio (``7.14x``, ``31.8 ms``, ``37.9%``,
``1.61 GB``). The evidence of a paragraph (or list item) is the results named in it
(``comm_hooks.*``, ``benchmarks/results/default_job.md``, ``profile/``...: every file of
that stem), or all of ``benchmarks/results/`` when it names none. A figure is backed when
a value of a record of that evidence (``*.jsonl`` / ``*.json``, nested fields included),
read in the figure's unit and rounded to the figure's decimals, equals it, or when the
number appears in a report generated from those records (``*.md`` / ``*.txt``, the READMEs
aside: their tables hold the ratios and medians the reports compute). An ``x`` or ``%``
figure is also backed when it is the ratio (or the relative difference, for ``%``) of two
backed numbers of the same paragraph (``23968 vs 18577 tokens/s/GPU (1.29x)``). Targets and settings (a number after
"target", ">=", "<=", "at most" ...) are not measurements; the few other unmeasured
numbers are listed in ``NOT_MEASURED`` with the reason. Code blocks are skipped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FILES = ("README.md", "benchmarks/results/README.md")

# unit -> factors that turn a record value (in the records' own units) into the figure's
SCALES: dict[str, tuple[float, ...]] = {
    "x": (1.0,),
    "%": (100.0, 1.0),
    "s": (1.0,),
    "ms": (1e3, 1.0, 1e-3),
    "us": (1e6, 1.0),
    "GB/s": (1.0, 1e-9),
    "TB/s": (1e-12, 1e-3, 1.0),
    "GB": (1e-9, 2**-30, 1.0),
    "MB": (1e-6, 2**-20, 1.0),
    "KB": (1e-3, 2**-10, 1.0),
    "bytes": (1.0,),
    "tokens/s/GPU": (1.0,),
}
_UNITS = "|".join(re.escape(u) for u in sorted(SCALES, key=len, reverse=True))
FIGURE = re.compile(
    rf"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?)(?:-\d[\d,]*(?:\.\d+)?)?(\s?)({_UNITS})(?![\w/])"
)
# a number right after one of these is a target or a setting, not a measurement
NOT_A_MEASUREMENT = re.compile(
    r"(target|>=|<=|at most|at least|cap|budget|limit|every|bound|shaped to|over a|"
    r"default|per_device|up to|timeout)\s*[\w\s.(`=]{0,12}$",
    re.IGNORECASE,
)
NOT_MEASURED = {
    # figure as quoted -> why it needs no record of its own
    "20%": "the regression guard's threshold (verl-comm bench compare), a setting",
    "900 s": "the benchmark runner's time limit, a setting",
    "0.02%": "derived: checkpoint_bytes.md's whole checkpoint over its floor bytes, both there",
}
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?![\d])")


def _prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def _numbers(obj, out: list[float]) -> None:
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        out.append(float(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            _numbers(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _numbers(v, out)


def _evidence_files(stems: set[str]) -> list[Path]:
    """Files of ``benchmarks/results`` whose stem (or folder) is in ``stems``; all if empty."""
    files = [p for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"]
    if not stems:
        return files
    return [
        p
        for p in files
        if p.name.split(".")[0] in stems
        or p.name.rsplit(".", 1)[0] in stems
        or any(part in stems for part in p.relative_to(RESULTS).parts[:-1])
    ]


def _stems_named(block: str) -> set[str]:
    """Result stems a paragraph names: ``comm_hooks.*``, ``reshard.cpu.md``, ``profile/``."""
    known = {p.name.split(".")[0] for p in RESULTS.iterdir()} | {
        p.name.rsplit(".", 1)[0] for p in RESULTS.iterdir()
    }
    found = set(
        re.findall(
            r"([a-z][a-z0-9_]*(?:\.cpu|\.smoke)?)(?:\.\*|\*|\.jsonl|\.md|\.txt|\.png|/)", block
        )
    )
    return found & known


def _blocks(text: str) -> list[str]:
    """Paragraphs and list items of the prose (code blocks removed)."""
    out = []
    for para in re.split(r"\n\s*\n", _prose(text)):
        out += [b for b in re.split(r"\n(?=- |\| )", para) if b.strip()]
    return out


def _record_values(files: list[Path]) -> list[float]:
    vals: list[float] = []
    for p in files:
        if p.suffix == ".jsonl":
            for line in p.read_text().splitlines():
                if line.strip():
                    _numbers(json.loads(line), vals)
        elif p.suffix == ".json":
            try:
                _numbers(json.loads(p.read_text()), vals)
            except json.JSONDecodeError:
                continue
    return vals


def _generated_text(files: list[Path]) -> str:
    return "\n".join(p.read_text(errors="replace") for p in files if p.suffix in (".md", ".txt"))


def figures(text: str) -> list[tuple[str, str, str]]:
    """``(quoted figure, number, unit)`` of every measurement-like figure in ``text``."""
    out = []
    prose = _prose(text)
    for m in FIGURE.finditer(prose):
        if NOT_A_MEASUREMENT.search(prose[max(0, m.start() - 40) : m.start()]):
            continue
        numbers = re.findall(r"\d[\d,]*(?:\.\d+)?", m.group(0))
        for n in numbers:  # both ends of a range like 1.36-1.56x
            out.append((m.group(0), n.replace(",", ""), m.group(3)))
    return out


def backed(number: str, unit: str, values: list[float], generated: str) -> bool:
    """True when a record value in ``unit`` rounds to ``number``, or ``number`` appears in a
    generated report (see the module docstring)."""
    digits = len(number.split(".")[1]) if "." in number else 0
    want = float(number)
    for v in values:
        for f in SCALES[unit]:
            if round(v * f, digits) == want:  # both rounded at the quoted precision
                return True
    for g in NUMBER.findall(generated):  # a report's figure, in its unit, rounded when quoted
        for f in SCALES[unit]:
            if round(float(g.replace(",", "")) * f, digits) == want:
                return True
    return False


def unbacked(text: str) -> list[str]:
    """The figures of ``text`` with no record behind them (see the module docstring)."""
    cache: dict[frozenset, tuple[list[float], str]] = {}
    missing = set()
    for block in _blocks(text):
        stems = frozenset(_stems_named(block))
        if stems not in cache:
            files = _evidence_files(set(stems))
            cache[stems] = (_record_values(files), _generated_text(files))
        values, generated = cache[stems]
        known = None  # the block's backed numbers, for ratios; computed when needed
        for fig, number, unit in figures(block):
            if fig in NOT_MEASURED or backed(number, unit, values, generated):
                continue
            if unit in ("x", "%"):
                if known is None:
                    tokens = {n.replace(",", "") for n in NUMBER.findall(block)}
                    in_figures = {n for _, n, _ in figures(block)}
                    known = [  # figures and counts, not small integers such as "2 ranks"
                        float(n)
                        for n in tokens
                        if ("." in n or float(n) >= 100 or n in in_figures)
                        and any(backed(n, u, values, generated) for u in SCALES)
                    ]
                if _is_ratio(number, unit, known):
                    continue
            missing.add(fig)
    return sorted(missing)


def _is_ratio(number: str, unit: str, known: list[float]) -> bool:
    """``number`` is a / b (``x``) or 100 (a / b - 1) (``%``) of two of ``known``, rounded
    to its decimals."""
    digits = len(number.split(".")[1]) if "." in number else 0
    want = float(number)
    for a in known:
        for b in known:
            if a == b or b == 0:
                continue
            r = a / b if unit == "x" else 100 * abs(a / b - 1)
            if round(r, digits) == want:
                return True
    return False


@pytest.mark.parametrize("name", FILES)
def test_every_quoted_figure_has_a_record(name):
    missing = unbacked((ROOT / name).read_text())
    assert not missing, f"{name}: figures with no record behind them: {missing}"


def test_the_check_fails_on_a_figure_without_a_record():
    files = _evidence_files(set())
    values, generated = _record_values(files), _generated_text(files)
    (fig, number, unit) = figures("the step took 987654.321 ms on the quiet machine")[0]
    assert fig == "987654.321 ms" and not backed(number, unit, values, generated)
    # a target is not a measurement
    assert figures("(target 3x: met)") == []
    # a figure is looked up in the results its paragraph names, not anywhere
    assert unbacked("`reshard.*`: 7.14x") == ["7.14x"]
    assert unbacked("`ppo_throughput.*`: 7.14x") == []
