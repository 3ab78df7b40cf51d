"""What `pip install` puts on a user's machine: one package, `maestro_jax`, and no torch for tests.

`models/` and `meshes/` are top-level folders of the repository but install as `maestro_jax.models`
and `maestro_jax.meshes` (pyproject.toml's package-dir), so a user's own `models.py` never shadows
them and nothing generic lands in site-packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_installed_under_maestro_jax():
    tool = PYPROJECT["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {
        "maestro_jax." + ".".join(p.parent.relative_to(ROOT / "maestro_jax").parts)
        for p in (ROOT / "maestro_jax").rglob("__init__.py")
    }
    folders = {f.rstrip(".") for f in folders}
    mapped = {f"maestro_jax.{d}" for d in ("models", "meshes")}
    assert listed == folders | mapped, (
        f"pyproject.toml's packages differ from the tree: {sorted(listed ^ (folders | mapped))}"
    )
    assert tool["package-dir"] == {"maestro_jax.models": "models", "maestro_jax.meshes": "meshes"}
    assert all(p.startswith("maestro_jax") for p in listed)


def test_the_installed_package_leaves_no_generic_top_level_names(tmp_path):
    """From a folder holding a user's own `models.py`, the framework still imports its own models
    (the error this replaced: "No module named 'models.layers'; 'models' is not a package")."""
    (tmp_path / "models.py").write_text("USER = True\n")
    (tmp_path / "meshes.py").write_text("USER = True\n")
    probe = (
        "import importlib.util, sys\n"
        "sys.path.remove('') if '' in sys.path else None\n"
        "assert importlib.util.find_spec('models') is None, 'a top-level models is installed'\n"
        "assert importlib.util.find_spec('meshes') is None, 'a top-level meshes is installed'\n"
        "sys.path.insert(0, '')\n"
        "import models, meshes\n"
        "assert models.USER and meshes.USER\n"
        "import maestro_jax.models.llm, maestro_jax.meshes\n"
        "print(maestro_jax.models.llm.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "models" / "llm.py"


def test_the_test_extra_needs_no_torch():
    names = {
        r.split(">")[0].split("=")[0].split("[")[0].strip().lower()
        for r in PYPROJECT["project"]["optional-dependencies"]["dev"]
    }
    assert "pytest" in names
    assert not names & {"torch", "transformers", "jax[cuda12]", "jax[cuda13]"}, names


def test_the_gpu_kernels_are_an_extra_of_their_own():
    """tokamax (the grouped GEMM of `moe_dispatch: grouped`) needs jax >= 0.11.1: only the `gpu`
    extra asks for it, so the default install, the test extra and jax 0.10.2 never meet it (CI's
    Python 3.12 run installs the extra to test the grouped dispatch), and `scripts/gpu_wheels.sh`
    carries it to a GPU image."""

    def names(reqs):
        return {r.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().lower() for r in reqs}

    extras = PYPROJECT["project"]["optional-dependencies"]
    assert names(extras["gpu"]) == {"tokamax"}
    assert all("tokamax" not in names(reqs) for name, reqs in extras.items() if name != "gpu")
    assert "tokamax" not in names(PYPROJECT["project"]["dependencies"])
    assert "tokamax==" in (ROOT / "scripts/gpu_wheels.sh").read_text()


REFERENCE_PACKAGES = ("torch", "transformers")


def _reaches_the_reference(node: ast.AST) -> bool:
    """Whether this code imports, skips on or looks up torch or transformers itself."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import) and any(a.name.split(".")[0] in REFERENCE_PACKAGES for a in sub.names):
            return True
        if isinstance(sub, ast.ImportFrom) and (sub.module or "").split(".")[0] in REFERENCE_PACKAGES:
            return True
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in ("importorskip", "find_spec")
            and sub.args
            and isinstance(sub.args[0], ast.Constant)
            and sub.args[0].value in REFERENCE_PACKAGES
        ):
            return True
    return False


def _tests_reaching_the_reference(tree: ast.Module) -> dict[str, bool]:
    """Each test function of a module: whether it, or a module function it calls (at any depth),
    reaches the live reference, and whether it carries `@pytest.mark.reference`."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    calls = {
        name: {c.func.id for c in ast.walk(f) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        & set(functions)
        for name, f in functions.items()
    }
    reaches = {name: _reaches_the_reference(f) for name, f in functions.items()}
    changed = True
    while changed:
        changed = False
        for name in functions:
            if not reaches[name] and any(reaches[c] for c in calls[name]):
                reaches[name] = changed = True
    return {
        name: "pytest.mark.reference" in {ast.unparse(d).split("(")[0] for d in f.decorator_list}
        for name, f in functions.items()
        if name.startswith("test_") and reaches[name]
    }


def test_every_test_of_the_live_reference_is_marked_so_ci_runs_it_where_torch_is():
    """CI runs the whole suite on Python 3.12, where torch's CPU wheel is missing and these tests
    skip, and `-m "(not slow or reference) and not extended"` on Python 3.11 with torch (.ci/run):
    a test that reaches torch or transformers without the `reference` mark would run nowhere with
    the reference."""
    unmarked, marked = [], 0
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for name, has_mark in _tests_reaching_the_reference(ast.parse(path.read_text())).items():
            marked += has_mark
            if not has_mark and path.name != "test_packaging.py":
                unmarked.append(f"{path.name}::{name}")
    assert not unmarked, f"reach torch or transformers without @pytest.mark.reference: {unmarked}"
    assert marked >= 15  # the exports' round trips, check-hf and the processors' conversations


def test_the_reference_search_sees_a_helper_two_calls_away():
    tree = ast.parse(
        "def inner():\n    import transformers\n"
        "def middle():\n    inner()\n"
        "def test_a():\n    middle()\n"
        "@pytest.mark.reference\ndef test_b():\n    pytest.importorskip('torch')\n"
        "def test_c():\n    pass\n"
    )
    assert _tests_reaching_the_reference(tree) == {"test_a": False, "test_b": True}


def test_the_package_version_is_the_changelogs_newest_release():
    """CHANGELOG.md's newest released entry (`## [x.y.z] - YYYY-MM-DD`, below `## [Unreleased]`)
    names the version pyproject.toml and `maestro_jax.__version__` carry, and the installed
    distribution's metadata agrees: a release bumps all of them together."""
    import importlib.metadata
    import re

    import maestro_jax

    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == ("Unreleased", ""), "the newest heading is [Unreleased]"
    newest, date = headings[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+", newest) and date, headings[1]
    assert newest == PYPROJECT["project"]["version"] == maestro_jax.__version__
    installed = importlib.metadata.version("maestro_jax")
    assert installed == newest, f"installed metadata says {installed}: reinstall (pip install -e .) after a bump"
    released = [v for v, _ in headings[1:]]
    as_tuples = [tuple(map(int, v.split("."))) for v in released]
    assert as_tuples == sorted(as_tuples, reverse=True), f"releases newest first: {released}"
