"""What `pip install` puts on a user's machine: one package, `maestro_jax`, and no torch for tests.

`models/` and `meshes/` are top-level folders of the repository but install as `maestro_jax.models`
and `maestro_jax.meshes` (pyproject.toml's package-dir), so a user's own `models.py` never shadows
them and nothing generic lands in site-packages.
"""

from __future__ import annotations

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
    extra asks for it, so the default install, the test extra and CI's jax 0.10.2 never meet it,
    and `scripts/gpu_wheels.sh` carries it to a GPU image."""

    def names(reqs):
        return {r.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip().lower() for r in reqs}

    extras = PYPROJECT["project"]["optional-dependencies"]
    assert names(extras["gpu"]) == {"tokamax"}
    assert all("tokamax" not in names(reqs) for name, reqs in extras.items() if name != "gpu")
    assert "tokamax" not in names(PYPROJECT["project"]["dependencies"])
    assert "tokamax==" in (ROOT / "scripts/gpu_wheels.sh").read_text()
