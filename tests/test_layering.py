"""The architecture shows in the tree: no module imports a module of a higher layer.

Every module of `maestro_jax/`, `models/` and `meshes/` is parsed with `ast` (nothing is imported):
imports at any depth (module level, inside functions, under `TYPE_CHECKING`), relative imports
(`from . import x`) and `importlib.import_module("constant")`. Each module gets the layer of the
longest prefix in LAYERS; a module may import its own layer and the layers below it. The order is
docs/ARCHITECTURE.md's "Layers" block, which a test below keeps equal to LAYERS.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject.toml's package-dir: models/ is maestro_jax.models)
PACKAGES = {"maestro_jax": "maestro_jax", "models": "maestro_jax.models", "meshes": "maestro_jax.meshes"}

# Bottom to top. Each layer holds the modules under its prefixes (the longest prefix wins);
# "maestro_jax" names the package's own __init__ only (the lazy public API), never a fallback.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("meshes", ("maestro_jax.meshes",)),  # mesh axes and rules, as data: the plan checks read them
    ("core", ("maestro_jax.core",)),
    ("schedule", ("maestro_jax.schedule",)),
    ("planning", ("maestro_jax.planning",)),
    # the typed config, and a Hugging Face folder's config.json read as its fields (JAX-free)
    # and the fast paths' defaults as a table decided by GPU measurement (plain values)
    # and the built-in models' configs, each model's one schema, which the config's models.<name>
    # entries are generated from (models/configs.py and models/schema.py: JAX-free, beside the models)
    (
        "config",
        (
            "maestro_jax.config",
            "maestro_jax.hf_config",
            "maestro_jax.fast_paths",
            "maestro_jax.models.configs",
            "maestro_jax.models.schema",
        ),
    ),
    ("data", ("maestro_jax.data",)),
    ("models", ("maestro_jax.models",)),  # Flax: above the JAX-free half, below everything that runs them
    ("workloads", ("maestro_jax.workloads",)),
    ("runtime", ("maestro_jax.runtime",)),  # builds a config's workload (runtime.build)
    ("tools", ("maestro_jax.tools",)),
    ("training", ("maestro_jax.training",)),  # Trainer.verify/bench/plan/simulate call tools
    ("cli", ("maestro_jax.cli", "maestro_jax")),
)
PLANNING_HALF = ("meshes", "core", "schedule", "planning")  # imports without JAX (tests/test_api.py)
JAX = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")

# Arrows that go up the layers and cannot be removed yet: (importer, imported) -> why. Keep it short;
# every entry must say why, and an entry that no longer matches an import fails the test.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


MODULES = all_modules()


def imports_of(source: str, module: str, is_package: bool, known) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `source`: a module of the tree resolved to the
    module it names (`from pkg import mod` is `pkg.mod`, `from pkg import name` is `pkg`), any
    other import by its top-level name (`jax.numpy` -> `jax`)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []

    def add(line, name, names=()):
        if name.split(".")[0] != "maestro_jax":
            out.append((line, name.split(".")[0]))
            return
        subs = [f"{name}.{n}" for n in names if f"{name}.{n}" in known]
        out.extend((line, s) for s in subs)
        if len(subs) < len(names) or not names:
            out.append((line, name))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            add(node.lineno, name, [a.name for a in node.names if a.name != "*"])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "importlib"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            add(node.lineno, node.args[0].value)
    return out


def graph() -> dict[str, list[tuple[int, str]]]:
    return {m: imports_of(p.read_text(), m, p.name == "__init__.py", MODULES) for m, p in MODULES.items()}


GRAPH = graph()


def layer_of(module: str) -> tuple[int, str] | None:
    best = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            hit = module == p if p == "maestro_jax" else module == p or module.startswith(p + ".")
            if hit and (best is None or len(p) > best[0]):
                best = (len(p), rank, name)
    return best and best[1:]


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, (
        f"modules in no layer of LAYERS (give each package a layer here and in docs/ARCHITECTURE.md): {missing}"
    )
    assert len(MODULES) > 50 and {"maestro_jax.cli", "maestro_jax.models.llm", "maestro_jax.meshes"} <= set(MODULES)


def test_imports_name_modules_that_exist():
    bad = [
        f"{where(m, line)}: {m} imports {t}, which is no module of the tree"
        for m, imports in GRAPH.items()
        for line, t in imports
        if t.split(".")[0] == "maestro_jax" and t not in MODULES
    ]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_higher_layer():
    found, bad = set(), []
    for m, imports in GRAPH.items():
        rank, layer = layer_of(m)
        for line, t in imports:
            if t not in MODULES:
                continue
            t_rank, t_layer = layer_of(t)
            if t_rank <= rank:
                continue
            if (m, t) in ALLOWED:
                found.add((m, t))
                continue
            bad.append(f"{where(m, line)}: {m} (layer {layer}) imports {t} (layer {t_layer}, higher)")
    stale = [f"ALLOWED[{k}] matches no upward import any more; remove it" for k in ALLOWED if k not in found]
    order = " < ".join(name for name, _ in LAYERS)
    assert not bad and not stale, "\n".join([*bad, *stale, f"layers, bottom to top: {order}"])


def import_circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Every set of modules of the tree that import each other round a circle (strongly connected
    components of more than one module, or a module importing itself), each sorted."""
    edges = {m: sorted({t for _, t in imports if t in graph}) for m, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []
    for root in edges:  # Tarjan's algorithm, iterative (no recursion limit on a deep tree)
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(edges[w])))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in edges[v]:
                    circles.append(sorted(comp))
    return circles


def test_no_import_circle():
    """Imports at any depth count (a function-level or `TYPE_CHECKING` import closes a circle as
    surely as a module-level one: it only hides it from the interpreter)."""
    circles = import_circles(GRAPH)
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": [(1, "b")], "b": [(1, "c")], "c": []}, []),
        ({"a": [(1, "b")], "b": [(9, "a")], "c": [(1, "a")]}, [["a", "b"]]),
        ({"a": [(1, "b")], "b": [(1, "c")], "c": [(1, "a")], "d": [(1, "d")]}, [["a", "b", "c"], ["d"]]),
    ],
)
def test_import_circles_are_found(graph, expected):
    assert sorted(import_circles(graph)) == expected


def test_planning_half_imports_no_jax():
    bad = [
        f"{where(m, line)}: {m} (layer {layer_of(m)[1]}) imports {t}"
        for m, imports in GRAPH.items()
        if layer_of(m)[1] in PLANNING_HALF
        for line, t in imports
        if t in JAX
    ]
    assert not bad, "the planning half (and the meshes it reads) must import without JAX:\n" + "\n".join(bad)


def test_models_and_meshes_import_nothing_from_maestro_jax():
    """...but two plain-value modules the config reads too, so they cannot sit in models/:
    `hf_config`, a Hugging Face folder's config.json read as fields (JSON only; `models.<s>: {hf:
    DIR}`), and `fast_paths`, the fast paths' defaults (the attention chooser's and the MoE's, and
    `compile.*` defaults); and the models' own configs (`models/configs.py`, `models/schema.py`),
    which sit in models/ beside the modules but in the config's layer, JAX-free, because the
    config's `models.<name>` entries are generated from them."""
    may_import = {"meshes": {"meshes"}, "models": {"meshes", "models"}}
    modules = {
        "models": {
            "maestro_jax.hf_config",
            "maestro_jax.fast_paths",
            "maestro_jax.models.configs",
            "maestro_jax.models.schema",
        }
    }
    bad = [
        f"{where(m, line)}: {m} imports {t}"
        for m, imports in GRAPH.items()
        if layer_of(m)[1] in may_import
        for line, t in imports
        if t in MODULES
        and layer_of(t)[1] not in may_import[layer_of(m)[1]]
        and t not in modules.get(layer_of(m)[1], ())
    ]
    assert not bad, "models/ and meshes/ stand alone (meshes is data):\n" + "\n".join(bad)


def test_workloads_are_plugins():
    """A workload (built-in or a user's) needs no runtime, training or tools module: the runtime
    hands a Hugging Face loader its states and programs, and HF mapping lives in models/."""
    bad = [
        f"{where(m, line)}: {m} imports {t}"
        for m, imports in GRAPH.items()
        if layer_of(m)[1] == "workloads"
        for line, t in imports
        if t in MODULES and layer_of(t)[1] in ("runtime", "training", "tools", "cli")
    ]
    assert not bad, "\n".join(bad)


def test_docs_list_the_same_layers():
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    block = re.search(r"^## Layers\n.*?^```\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert block, "docs/ARCHITECTURE.md has a '## Layers' section with the order in a code block"
    rows = [line.split(None, 1) for line in block.group(1).splitlines() if line.strip()]
    documented = [(name, tuple(p.strip() for p in rest.split("(")[0].split(","))) for name, rest in rows]
    assert documented == list(reversed(LAYERS)), "docs/ARCHITECTURE.md's layers (top first) differ from LAYERS"


@pytest.mark.parametrize(
    "source,module,is_package,expected",
    [
        ("import jax.numpy as jnp", "maestro_jax.core.plan", False, ["jax"]),
        (
            "def f():\n    from maestro_jax.runtime import build",
            "maestro_jax.core.plan",
            False,
            ["maestro_jax.runtime.build"],
        ),
        ("from maestro_jax.runtime.sharding import param_infos", "x", False, ["maestro_jax.runtime.sharding"]),
        ("from . import rows", "maestro_jax.workloads", True, ["maestro_jax.workloads.rows"]),
        ("from . import rows", "maestro_jax.workloads.vlm", False, ["maestro_jax.workloads.rows"]),
        ("from .. import config", "maestro_jax.workloads.vlm", False, ["maestro_jax.config"]),
        ("from ..tools.hf import save_llm", "maestro_jax.workloads.vlm", False, ["maestro_jax.tools.hf"]),
        (
            "from maestro_jax import workloads, __version__",
            "maestro_jax.tools.plan",
            False,
            ["maestro_jax.workloads", "maestro_jax"],
        ),
        ("if TYPE_CHECKING:\n    import maestro_jax.training.loop", "m", False, ["maestro_jax.training.loop"]),
        ("importlib.import_module('maestro_jax.tools.bench')", "m", False, ["maestro_jax.tools.bench"]),
    ],
)
def test_every_kind_of_import_is_seen(source, module, is_package, expected):
    assert [t for _, t in imports_of(source, module, is_package, MODULES)] == expected
