"""kmp's module-level imports: no circle, and each sub-package stays in its layer.

The graph is read from the source with `ast` (nothing is imported): an edge
A -> B for each kmp module B that A imports when A itself is imported, that is
outside function bodies. `from kmp.x import y` is an edge to the module
kmp.x.y when that is a module, else to kmp.x. Importing kmp.x.y runs
kmp/x/__init__.py first, so it is an edge to the package kmp.x too, unless A
is inside kmp.x (then kmp.x is already being imported).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KMP = ROOT / "kmp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(KMP.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _top_level(tree: ast.Module):
    """The statements run at import: all but those inside functions (class bodies run)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported(name: str) -> tuple[set[str], set[str]]:
    """(kmp modules, other top-level packages) that module `name` imports at module level."""
    kmp_modules, others = set(), set()
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in _top_level(ast.parse(MODULES[name].read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(above + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for target in targets:
            if target.split(".")[0] != "kmp":
                others.add(target.split(".")[0])
                continue
            parts = target.split(".")
            for end in range(1, len(parts) + 1):  # the module and every package above it
                ancestor = ".".join(parts[:end])
                if ancestor in MODULES and not (name == ancestor or name.startswith(ancestor + ".")):
                    kmp_modules.add(ancestor)
    return kmp_modules, others


GRAPH, OTHERS = {}, {}
for _name in MODULES:
    GRAPH[_name], OTHERS[_name] = _imported(_name)


def _reached(name: str) -> set[str]:
    seen, stack = set(), [name]
    while stack:
        for target in GRAPH[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return seen


def _cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(GRAPH[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(GRAPH):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_kmps_modules():
    # A parse that found no edges would pass every test below.
    assert {"kmp.errors", "kmp.engine.prepare", "kmp.distribute", "kmp.cli.main"} <= MODULES.keys()
    assert "kmp.scaling.optimizer" in GRAPH["kmp.engine.prepare"]
    assert {"kmp.distribute", "kmp.distribute.communication"} <= GRAPH["kmp.scaling.optimizer"]
    assert "kmp.engine" in GRAPH["kmp.scaling.optimizer"]  # a package's __init__ runs before its modules


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_leaves_import_only_errors():
    assert GRAPH["kmp.errors"] == set()
    for name in ("kmp.values", "kmp.seams"):
        assert GRAPH[name] <= {"kmp.errors"}, (name, GRAPH[name])
    # What kmp keeps on a model (kmp.engine.state): read by the engine's modules, so below them all.
    assert GRAPH["kmp.engine.state"] == set() and not OTHERS["kmp.engine.state"] & {"tensorflow", "keras"}


@pytest.mark.parametrize("name", ["kmp", "kmp.config", "kmp.schedules.formulas", "kmp.memory.estimate", "kmp.cli",
                                  "kmp.cli.main", "kmp.cli.config_check", "kmp.cli.launch", "kmp.cli.env"])
def test_fast_modules_import_no_tensorflow_or_keras(name):
    """`import kmp`, reading a config and `kmp --help`/`config check`/`memory`/`launch` start without TensorFlow."""
    reached = {name} | _reached(name)
    if name == "kmp.config":
        reached |= {module for module in MODULES if module.startswith("kmp.config.")}
    heavy = {module: OTHERS[module] & {"tensorflow", "keras"} for module in reached}
    assert {module: found for module, found in heavy.items() if found} == {}


def test_distribute_is_below_scaling_and_engine():
    above = ("kmp.scaling", "kmp.engine", "kmp.callbacks", "kmp.cli", "kmp.memory")
    for name in (module for module in MODULES if module.startswith("kmp.distribute")):
        bad = {module for module in _reached(name) if module.startswith(above)}
        assert bad == set(), f"{name} imports {sorted(bad)}"


def test_only_the_top_imports_callbacks_and_cli():
    for name in MODULES:
        if name.startswith(("kmp.callbacks", "kmp.cli")):
            continue
        bad = {module for module in GRAPH[name] if module.startswith(("kmp.callbacks", "kmp.cli"))}
        assert bad == set(), f"{name} imports {sorted(bad)}"


def test_package_inits_import_nothing_but_their_own_modules():
    for name in (module for module in MODULES if _is_package(module)):
        outside = {module for module in GRAPH[name] if not module.startswith(name + ".")}
        assert outside == set(), f"{name}/__init__.py imports {sorted(outside)}"


def test_a_distribute_module_does_not_import_the_engine_when_run():
    """The lazy names of kmp.distribute stay lazy: the static graph above is what Python does."""
    # (kmp.scaling.optimizer is imported once Keras is, to register it with Keras: kmp/__init__.py.)
    script = ("import sys\nimport kmp.distribute.scatter\n"
              "assert 'kmp.engine.prepare' not in sys.modules, sorted(sys.modules)\n"
              "from kmp.distribute import prepare\nimport kmp\n"
              "assert prepare is kmp.prepare is sys.modules['kmp.engine.prepare'].prepare\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_keras_file_saved_before_the_sub_packages_loads():
    """Keras finds kmp's classes by registered name ("kmp>..."), not by the module path the file names."""
    import json
    import zipfile

    import keras

    import kmp

    path = ROOT / "tests" / "data" / "saved_before_subpackages.keras"
    modules = {m for m in _config_modules(json.loads(zipfile.ZipFile(path).read("config.json"))) if "kmp" in m}
    assert modules == {"kmp.optimizer", "kmp.momentum", "kmp.lr_schedule"}  # the old paths, gone now
    assert not set(MODULES) & modules
    optimizer = keras.saving.load_model(path).optimizer
    assert isinstance(optimizer, kmp.LossScaleOptimizer)
    assert type(optimizer.inner_optimizer).__module__ == "kmp.schedules.momentum"
    assert type(optimizer.inner_optimizer._learning_rate).__module__ == "kmp.schedules.keras"
    assert int(optimizer.iterations.numpy()) == 1  # its state came back too


def _config_modules(config) -> set[str]:
    if isinstance(config, dict):
        found = {config["module"]} if isinstance(config.get("module"), str) else set()
        return found.union(*(_config_modules(v) for v in config.values()))
    if isinstance(config, list):
        return set().union(*(_config_modules(v) for v in config))
    return set()
