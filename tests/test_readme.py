"""The README's "Your own compound model" example runs as written and does what it says; every command
of its table runs as written and has the synopsis `docs/commands.md` gives it; and every relative
link of the README and docs/ resolves."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow
def test_own_model_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own compound model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "own_model.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = dict(re.findall(r"^(\S+)\s+L2-relative difference (\S+)$", proc.stdout, re.M))
    assert set(diffs) == {
        "loss",
        "grad_norm",
        "adapter/grads",
        "adapter/params_after_update",
        "decoder/grads",
        "decoder/params_after_update",
    }
    assert all(float(v) < 1e-5 for v in diffs.values()), diffs
    first, last = map(float, re.search(r"^loss (\S+) -> (\S+)$", proc.stdout, re.M).groups())
    assert last < first


# Each command of the README's command table, as its synopsis writes it, on a shipped config:
# FILE a tiny config (shrunk by overrides, which every synopsis takes), DIR the run's output_dir
KD = "configs/kd_tiny.yaml"


def _command_lines(tmp_path) -> dict[str, list[str]]:
    run, tiny = tmp_path / "run", ["global_batch=8", "models.teacher.depth=1", "models.student.depth=1"]
    return {
        "train": ["--config", KD, *tiny, "steps=2", f"output_dir={run}"],
        "verify": ["--config", KD, "--json", str(tmp_path / "verify.json"), *tiny],
        "eval": ["--config", KD, *tiny, f"output_dir={run}", "--step", "2"],
        "bench": ["--config", KD, "--reps", "1", "--batches", "1", "--json", str(tmp_path / "bench.json"), *tiny],
        "plan": ["--config", KD, "--devices", "8", "--memory-gb", "1", "--top", "2", *tiny],
        "check-hf": ["--hf", str(ROOT / "tests/fixtures/hf/llama_untied")],
        "export": ["--config", KD, *tiny, f"output_dir={run}", "--section", "student", "--out", str(tmp_path / "hf")],
        "simulate": ["--config", KD, "--json", str(tmp_path / "simulate.json")],
        "teacher-cache": ["--config", KD, "--out", str(tmp_path / "tc"), "--top-k", "8", *tiny, "data.num_samples=16"],
    }


def _table_rows() -> dict[str, str]:
    """The README's command table: each command's synopsis."""
    return dict(re.findall(r"^\| `maestro-jax (\S+) ([^`]*)` \|", (ROOT / "README.md").read_text(), re.M))


def _runs_as_written(command: str, args: list[str], synopsis: str, capsys) -> None:
    """Each option the line passes is in the row's synopsis, and the line runs to status 0.

    In this process (`cli.main`, what the `maestro-jax` console script calls, from the repository
    root as the README's lines are written): the process boundary is not what the row promises,
    and the programs the suite compiled before load from its cache; `tests/test_cli.py` and the
    multi-process tests start the command as a process."""
    options = [a for a in args if a.startswith("--")]
    assert all(o in synopsis for o in options), (command, options, synopsis)
    from maestro_jax import cli

    status = cli.main([command, *args])
    out = capsys.readouterr()
    assert status == 0, (command, out.out[-2000:], out.err[-2000:])


@pytest.mark.slow
def test_every_command_of_the_readme_table_runs_as_written(tmp_path, monkeypatch, capsys):
    """Every row of the command table: its command and each option the line passes are in the
    row's synopsis, and the line runs to status 0 on a shipped config (train first: eval and
    export read its checkpoints; check-hf, which needs the `reference` extra, is the test below)."""
    rows, lines = _table_rows(), _command_lines(tmp_path)
    assert set(rows) == set(lines), "a documented command without a line here, or one no longer documented"
    monkeypatch.chdir(ROOT)
    for command, args in lines.items():
        if command != "check-hf":
            _runs_as_written(command, args, rows[command], capsys)


@pytest.mark.reference
def test_the_readme_tables_check_hf_line_runs_as_written(tmp_path, monkeypatch, capsys):
    """The table's check-hf row, as the test above runs the others (transformers' reference needs
    torch: the `reference` extra)."""
    pytest.importorskip("torch", reason="check-hf runs transformers (the reference extra)")
    monkeypatch.chdir(ROOT)
    _runs_as_written("check-hf", _command_lines(tmp_path)["check-hf"], _table_rows()["check-hf"], capsys)


def test_the_readme_table_names_each_command_as_docs_commands_does():
    """The README's short command table and `docs/commands.md`'s full one give every command the
    same synopsis, so the two cannot drift apart."""
    row = re.compile(r"^\| `maestro-jax (\S+) ([^`]*)` \|", re.M)
    readme = row.findall((ROOT / "README.md").read_text())
    full = row.findall((ROOT / "docs/commands.md").read_text())
    assert readme and readme == full


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(text: str) -> str:
    """The markdown text without its fenced blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def test_every_relative_link_of_the_readme_and_docs_resolves():
    """Each relative link in README.md and docs/*.md names a file of the repository, and an anchor
    into a markdown file names one of its headings."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", _outside_code(file.read_text()), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_model_table_names_every_model_type_that_loads_and_existing_tests():
    """The README's "Hugging Face models" table: every `model_type` in its first column is one a
    folder may hold (`hf_config`), every one that loads is named there, and each row's tests exist."""
    from maestro_jax.hf_config import ARCHITECTURES, MULTI_MODEL, MULTIMODAL, QWEN_VL, VISION_TOWERS

    section = (ROOT / "README.md").read_text().split("## Hugging Face models", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")][1:]  # past the header
    named = {t for row in rows for t in re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", row[0]))}  # not in brackets
    loads = {*ARCHITECTURES, *MULTIMODAL, *QWEN_VL, *VISION_TOWERS, *MULTI_MODEL, "whisper"}
    assert named == loads, (sorted(loads - named), sorted(named - loads))
    for row in rows:
        for test in re.findall(r"`(tests/\S+\.py)`", row[-1]):
            assert (ROOT / test).is_file(), test


def test_results_headline_rows_hold_the_figures_of_the_json_they_link():
    """benchmarks/RESULTS.md opens with its headline table, and each CPU bench row's figures are
    those of the JSON it links (wavefront vs the fair monolithic, vs Megatron's order, rounded
    to 3 decimals as written): a rerun that rewrites the JSON shows the row stale."""
    import json
    import re

    text = (ROOT / "benchmarks/RESULTS.md").read_text()
    headline = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^## (.+)$", text, re.M)[0] == "Headline", "the page opens with its headline table"
    rows = [r for r in headline.splitlines() if r.startswith("| measured on CPU")]
    assert len(rows) == 2, rows
    for row in rows:
        (name,) = re.findall(r"\]\((\w+_bench\.json)\)", row)
        ratios = json.loads((ROOT / "benchmarks" / name).read_text())["ratios"]
        want = f"**{ratios['wavefront_vs_monolithic']:.3f}** and {ratios['wavefront_vs_round_robin']:.3f}"
        assert want in row, (name, want, row)


def test_the_readme_opens_as_a_front_door_and_its_results_are_results_figures():
    """Within its first 60 lines the README says what it is and holds the two commands, the
    workloads/models table and the results table; it states no test timing (docs/testing.md
    holds those); each figure of its results table is one benchmarks/RESULTS.md states."""
    import re

    text = (ROOT / "README.md").read_text()
    first = "\n".join(text.splitlines()[:60])
    for part in ("## Quick start", "## Workloads and models", "## Results", "| `kd` |", "| `vlm` |"):
        assert part in first, part
    assert "maestro-jax train --config configs/vlm_tiny.yaml" in first
    assert 'pip install -e ".[dev]" && python -m pytest -q' in first
    assert not re.search(r"\d+ passed|\d+ min \d+ s|\btests? in \d", text), "a test timing in the README"
    results = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"\b\d+\.\d{3}x?", results)
    assert len(figures) >= 10, figures
    page = (ROOT / "benchmarks/RESULTS.md").read_text()
    assert all(f.rstrip("x") in page for f in figures), [f for f in figures if f.rstrip("x") not in page]
