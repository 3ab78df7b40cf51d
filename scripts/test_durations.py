"""The suite's figures for docs/testing.md, read from a run rather than typed by hand.

    python -m pytest -q --junitxml=/tmp/suite.xml            # any tier; CI's command here
    python scripts/test_durations.py /tmp/suite.xml [--top 25] [--tiers]

Prints, as Markdown: the `--top` slowest tests (setup, call and teardown summed, as pytest's
`--durations` counts them) with the first sentence of each test's docstring (what it proves); the
time per test file (what `--dist loadfile` hands one worker at a time), and with `--tiers` each
tier's test count as pytest collects it (`--collect-only`, the tiers' own selections).
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]

# each tier: the pytest arguments that select it (README, docs/testing.md)
TIERS = {
    "CI's command (`python -m pytest -q`)": [],
    'quick (`-m "not slow"`)': ["-m", "not slow"],
    "extended alone (`-m extended`)": ["-m", "extended"],
    "whole suite (`--extended`)": ["--extended"],
}


@dataclasses.dataclass(frozen=True)
class Timed:
    nodeid: str
    seconds: float


def timings(junit: pathlib.Path) -> list[Timed]:
    """Each test case of a JUnit XML report (pytest's `--junitxml`, which sums a test's setup, call
    and teardown into its `time`), as a pytest node id."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        cases.append(Timed(f"{module}.py::{case.get('name')}", float(case.get("time", 0.0))))
    return cases


def purpose(nodeid: str) -> str:
    """The first sentence of the test function's docstring, else its name read as a sentence (the
    names here are written as claims: `test_dry_run_writes_every_section`)."""
    path, _, name = nodeid.partition("::")
    func = name.split("[")[0]
    file = ROOT / path
    for node in ast.walk(ast.parse(file.read_text())) if file.exists() else ():
        if isinstance(node, ast.FunctionDef) and node.name == func:
            doc = " ".join((ast.get_docstring(node) or "").split())
            if not doc:
                break
            first = re.split(r"(?<=\.)\s+(?=[A-Z(`])", doc, maxsplit=1)[0].rstrip(".")
            return first if len(first) <= 160 else first[:157].rsplit(" ", 1)[0] + " ..."
    return func.removeprefix("test_").replace("_", " ")


def tier_counts() -> dict[str, int]:
    """Each tier's collected test count."""
    counts = {}
    for tier, args in TIERS.items():
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", out) or re.search(r"^(\d+) tests?", out, re.M)
        if not m:
            raise SystemExit(f"error: {tier}: pytest --collect-only printed no test count:\n{out[-2000:]}")
        counts[tier] = int(m.group(1))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=pathlib.Path, nargs="+", help="pytest --junitxml reports")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--files", type=int, default=15, help="how many of the slowest files to list")
    p.add_argument("--tiers", action="store_true", help="collect each tier and print its test count")
    args = p.parse_args(argv)
    cases = [t for j in args.junit for t in timings(j)]
    total = sum(t.seconds for t in cases)
    print(f"{len(cases)} tests, {total:.0f} s of test time in all (both workers' summed)\n")
    print("| # | test | s | what it proves |\n| --- | --- | --- | --- |")
    for i, t in enumerate(sorted(cases, key=lambda t: -t.seconds)[: args.top], 1):
        print(f"| {i} | `{t.nodeid}` | {t.seconds:.1f} | {purpose(t.nodeid)} |")
    per_file = collections.Counter()
    for t in cases:
        per_file[t.nodeid.split("::")[0]] += t.seconds
    print("\n| file | s | share |\n| --- | --- | --- |")
    for path, s in per_file.most_common(args.files):
        print(f"| `{path}` | {s:.0f} | {s / total:.0%} |")
    if args.tiers:
        print("\n| tier | tests collected |\n| --- | --- |")
        for tier, n in tier_counts().items():
            print(f"| {tier} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
