"""The package's layout: the imports run one way, no module imports another that imports it back,
and every module path that moved in 0.4.0 still imports (docs/architecture.md is the picture)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

import jaxdist
from jaxdist import _compat
from tests.conftest import REPO

PKG = os.path.join(REPO, "jaxdist")
RULES = "\n(the rule and how to meet it: CONTRIBUTING.md, 'The layout rules'; docs/architecture.md)"

# What each top-level package (or module) may import from jaxdist, late imports included.
ALLOWED = {
    "core": set(),
    "input": {"core"},
    "launch": {"core", "_output", "_version", "_compat"},  # _compat: the launch.memstate and
    # launch.slot_files stubs
    "strategy": {"core", "input", "launch"},
    "checkpoint": {"core", "strategy", "launch", "_compat"},  # _compat: renamed names (RENAMED)
    "callbacks": {"core", "checkpoint", "launch", "_compat"},
    "training": {"core", "input", "strategy", "checkpoint", "callbacks", "launch", "_output",
                 "_version"},
    "ps": {"core", "input", "strategy", "callbacks", "launch", "_output"},
    "plan": {"core", "training", "_output"},
    "cli": {"training", "launch", "ps", "plan", "_output"},
    "_output": set(),
    "_compat": set(),
    "_version": set(),
}


def _modules():
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__"), path


def _imports(path: str) -> set[str]:
    """Every jaxdist module ``path`` imports, at any depth in the file (late imports too)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jaxdist"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxdist":
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_top_level_is_a_dozen_entries_and_each_package_is_documented():
    entries = sorted(e.removesuffix(".py") for e in os.listdir(PKG)
                     if e.endswith(".py") or os.path.isfile(os.path.join(PKG, e, "__init__.py")))
    assert len(entries) <= 14, entries
    assert set(entries) - {"__init__"} == set(ALLOWED), "a new top-level entry needs a row in ALLOWED"
    page = open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8").read()
    for e in entries:
        if not e.startswith("_"):
            assert f"  {e}" in page, f"docs/architecture.md's tree does not show {e}"


def test_imports_run_down_the_layers():
    wrong = []
    for name, path in _modules():
        here = _top(name)
        if here is None:  # jaxdist/__init__.py re-exports everything
            continue
        for target in _imports(path):
            there = _top(target)
            if there and there != here and there not in ALLOWED[here] and target in _known():
                wrong.append(f"{name} imports {target} ({here} may use {sorted(ALLOWED[here])})")
    assert not wrong, "\n".join(wrong) + RULES


def _known() -> set[str]:
    return {name for name, _ in _modules()}


def test_no_module_imports_one_that_imports_it_back():
    known = _known()
    graph = {}
    for name, path in _modules():
        # an import of a package counts as one of its __init__; a module's own parents do not count
        graph[name] = {t for t in _imports(path) if t in known and t != name and t != "jaxdist"
                       and not name.startswith(t + ".")}
    reach = {name: _reachable(graph, name) for name in graph}
    groups = {frozenset([n] + [m for m in reach[n] if n in reach[m]]) for n in graph}
    cycles = sorted(" <-> ".join(sorted(g)) for g in groups if len(g) > 1)
    assert not cycles, ("modules that import each other (late imports included):\n"
                        + "\n".join(cycles) + RULES)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    stack, out = list(graph[start]), set()
    while stack:
        v = stack.pop()
        if v not in out:
            out.add(v)
            stack.extend(graph[v])
    return out


@pytest.mark.parametrize("old", sorted(_compat.PUBLIC))
def test_a_public_path_that_moved_is_its_new_module_without_a_warning(old):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module(old)
    assert module is importlib.import_module(_compat.PUBLIC[old])
    assert module.__spec__.name == _compat.PUBLIC[old]  # the alias does not rename the module
    assert getattr(jaxdist, old.split(".")[1]) is module


def test_an_internal_path_that_moved_imports_with_a_warning_naming_the_new_one():
    # one fresh interpreter for all of them: each old path is imported for the first time there
    code = ("import importlib, json, warnings\n"
            "import jaxdist\n"
            "from jaxdist import _compat\n"
            "out = {}\n"
            "for old, new in _compat.DEPRECATED.items():\n"
            "    with warnings.catch_warnings(record=True) as w:\n"
            "        warnings.simplefilter('always')\n"
            "        same = importlib.import_module(old) is importlib.import_module(new)\n"
            "    out[old] = [same, [str(x.message) for x in w if x.category is DeprecationWarning]]\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(out) == sorted(_compat.DEPRECATED)
    for old, (same, messages) in out.items():
        assert same, f"{old} is a copy, not {_compat.DEPRECATED[old]}"
        assert any(f"{old} moved to {_compat.DEPRECATED[old]}" in m for m in messages), (old, messages)


def test_python_dash_m_jaxdist_launch_runs_the_launcher():
    proc = subprocess.run([sys.executable, "-m", "jaxdist.launch", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    assert "--nnodes" in proc.stdout and "--max-restarts" in proc.stdout


def _subpackages() -> set[str]:
    return {e for e in os.listdir(PKG) if os.path.isfile(os.path.join(PKG, e, "__init__.py"))}


def _top_modules() -> set[str]:
    """What ``from jaxdist import X`` may name from inside a subpackage: a module or package
    (``jaxdist._output``, ``jaxdist.callbacks``), never a name the top package defines."""
    return {e.removesuffix(".py") for e in os.listdir(PKG) if e.endswith(".py")} | _subpackages()


def private_reach(module: str, source: str, subpackages: set[str]) -> list[str]:
    """The imports in ``source`` (module ``module``, late imports included) of a private module or
    a private name of another subpackage: ``jaxdist.core._types``, ``from jaxdist.checkpoint import
    _slots``, ``from jaxdist.strategy.base import _scope``. A subpackage's own privates, and the
    package's shared top-level modules (``jaxdist._output``), are not reach."""
    here = _top(module)
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxdist":
            paths = [node.module]
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            paths, names = [a.name for a in node.names if a.name.split(".")[0] == "jaxdist"], []
        else:
            continue
        for path in paths:
            parts = path.split(".")
            there = parts[1] if len(parts) > 1 else None
            if there is None or there == here or there not in subpackages:
                continue  # the top package (test_no_subpackage_imports_the_top_package), its own
                # package, or a top-level module
            private = [p for p in parts[2:] if p.startswith("_")] + [
                n for n in names if n.startswith("_")]
            if private:
                out.append(f"{module}:{node.lineno} imports {', '.join(private)} from {path}")
    return out


def top_package_imports(module: str, source: str, top_modules: set[str],
                        subpackages: set[str]) -> list[str]:
    """The imports of the top package (``import jaxdist``, ``from jaxdist import fit``) in a module
    of a subpackage: the top package imports every subpackage, so these run back up the layers.
    ``from jaxdist import _output`` imports a module and is not one."""
    if _top(module) not in subpackages:
        return []
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"{module}:{node.lineno} import {a.name}" for a in node.names if a.name == "jaxdist"]
        elif isinstance(node, ast.ImportFrom) and node.module == "jaxdist" and node.level == 0:
            out += [f"{module}:{node.lineno} from jaxdist import {a.name}" for a in node.names
                    if a.name not in top_modules]
    return out


def test_no_module_reaches_into_another_packages_privates():
    subpackages = _subpackages()
    wrong = [w for name, path in _modules()
             for w in private_reach(name, open(path, encoding="utf-8").read(), subpackages)]
    assert not wrong, ("import through the package's public face (its __init__'s __all__) instead:\n"
                       + "\n".join(wrong) + RULES)


@pytest.mark.parametrize("source", [
    "from jaxdist.core._types import PyTree",
    "from jaxdist.checkpoint import _slots",
    "from jaxdist.strategy.base import _scope",
    "import jaxdist.checkpoint._pwrite",
    "def late():\n    from jaxdist.launch._owned import make\n",
])
def test_the_private_reach_check_finds_a_planted_import(source):
    subpackages = _subpackages()
    assert private_reach("jaxdist.callbacks.planted", source, subpackages)
    # a package's own privates, the shared top-level modules and public faces are not reach
    own = re.search(r"jaxdist\.(\w+)", source).group(1)
    assert not private_reach(f"jaxdist.{own}.planted", source, subpackages)
    assert not private_reach("jaxdist.checkpoint.ok", "from jaxdist._output import integer\n"
                             "from jaxdist.core import PyTree\nfrom jaxdist import _output\n", subpackages)


def test_no_subpackage_imports_the_top_package():
    top, subpackages = _top_modules(), _subpackages()
    wrong = [w for name, path in _modules()
             for w in top_package_imports(name, open(path, encoding="utf-8").read(), top, subpackages)]
    assert not wrong, ("import the name from its home module (jaxdist.training.fit.fit, ...), not "
                       "from the top package, which imports every subpackage:\n" + "\n".join(wrong)
                       + RULES)


@pytest.mark.parametrize("source", [
    "import jaxdist", "from jaxdist import fit", "from jaxdist import __version__",
    "def late():\n    import jaxdist\n    return jaxdist.fit\n",
])
def test_the_top_package_check_finds_a_planted_import(source):
    top, subpackages = _top_modules(), _subpackages()
    assert top_package_imports("jaxdist.training.planted", source, top, subpackages)
    assert not top_package_imports("jaxdist.cli", source, top, subpackages)  # a top-level module may
    assert not top_package_imports("jaxdist.training.ok", "from jaxdist import _output, callbacks\n"
                                   "import jaxdist.core.step\n", top, subpackages)


# The in-memory tier's slot files (their format, checksums and parallel writer) are the tier's:
# jaxdist/checkpoint/_slots.py and _pwrite.py (issue 42). jaxdist/launch/ keeps the state
# directory's contract only (launch/statedir.py: the files' names, whether a slot holds a snapshot).
TIER_MODULES_OUT_OF_LAUNCH = ("_slots", "_pwrite", "_tierfiles", "slots", "pwrite", "tierfiles")
SLOT_CONTENTS = {"checksum", "Piece", "pieces", "read_piece", "write", "free_slot", "covers",
                 "contains", "dtype_of", "Damaged", "TierFull", "_write_blocks", "_write_range",
                 "_range_sum"}


def slot_contents(path: str, source: str) -> list[str]:
    """The top-level functions and classes of ``source`` that read, write or check a slot's
    contents: the names of ``jaxdist.checkpoint._slots`` / ``_pwrite``, and any checksum."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
                node.name in SLOT_CONTENTS or "checksum" in node.name.lower()):
            out.append(f"{path}:{node.lineno} defines {node.name}")
    return out


def test_launch_holds_no_module_about_slot_contents_or_checksums():
    launch = os.path.join(PKG, "launch")
    there = [m for m in TIER_MODULES_OUT_OF_LAUNCH if os.path.exists(os.path.join(launch, f"{m}.py"))]
    assert not there, (f"jaxdist/launch/ holds {there}: the slot files' format is "
                       f"jaxdist/checkpoint/'s{RULES}")
    wrong = [w for name, path in _modules() if name.startswith("jaxdist.launch.")
             for w in slot_contents(os.path.relpath(path, REPO), open(path, encoding="utf-8").read())]
    assert not wrong, "slot contents or checksums in jaxdist/launch/ (they are the tier's):\n" + \
        "\n".join(wrong) + RULES
    for m in ("_slots", "_pwrite"):
        assert os.path.isfile(os.path.join(PKG, "checkpoint", f"{m}.py")), m
    # the launcher's question, whether a slot holds a snapshot, is answered in launch
    from jaxdist.checkpoint import _slots
    from jaxdist.launch import statedir

    assert _slots.slots is statedir.slots and _slots.read_header is statedir.read_header


def test_the_slot_contents_check_finds_a_planted_definition():
    assert slot_contents("m.py", "def checksum(data):\n    return 0\n")
    assert slot_contents("m.py", "class Piece:\n    pass\n")
    assert slot_contents("m.py", "def _block_checksum(raw):\n    return 0\n")
    assert not slot_contents("m.py", "def header_path(rank_dir, slot):\n    return ''\n"
                                     "def slots(directory):\n    yield from ()\n")


# Functions longer than this are split (STYLE.md). No allowance: `fit` and `Agent._watch`, the
# last two over it, were split in 0.4.0.
MAX_FUNCTION_LINES = 100


def long_functions(path: str, source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"path::Class.function": lines}`` for each function of ``source`` over ``limit`` lines
    (from its ``def`` line to its last line; nested functions count on their own too)."""
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    out[f"{path}::{prefix}{child.name}"] = lines
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_function_is_over_a_hundred_lines():
    found = {}
    for _, path in _modules():
        rel = os.path.relpath(path, REPO).replace(os.sep, "/")
        found.update(long_functions(rel, open(path, encoding="utf-8").read()))
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them): {found}{RULES}"


def test_the_function_length_check_finds_a_planted_long_function():
    source = "class A:\n    def short(self):\n        return 1\n\n    def long(self):\n" + "".join(
        f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions("m.py", source) == {"m.py::A.long": MAX_FUNCTION_LINES + 1}
    assert long_functions("m.py", source, limit=MAX_FUNCTION_LINES + 1) == {}


@pytest.mark.parametrize("package", sorted(_subpackages()))
def test_each_package_states_its_public_face(package):
    module = importlib.import_module(f"jaxdist.{package}")
    assert isinstance(getattr(module, "__all__", None), list), f"jaxdist/{package}/__init__.py has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)
               and importlib.util.find_spec(f"jaxdist.{package}.{n}") is None]  # (a submodule)
    assert not missing, f"jaxdist.{package}.__all__ names what it does not have: {missing}"
    assert not [n for n in module.__all__ if n.startswith("_")]


def test_moved_paths_are_plain_modules_not_an_import_hook():
    # before: jaxdist/_compat.py put a finder on sys.meta_path
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("jaxdist")]
    for old in _compat.MOVED:
        spec = importlib.util.find_spec(old)
        assert spec is not None and spec.origin.endswith(".py"), old  # a stub file


def test_the_version_is_the_distributions_and_a_source_tree_reads_pyproject(monkeypatch):
    import tomllib
    from importlib import metadata

    from jaxdist import _version

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    assert jaxdist.__version__ == metadata.version("jaxdist") == declared
    assert _version._from_source() == declared

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    try:
        assert importlib.reload(_version).__version__ == declared  # no metadata: pyproject.toml
    finally:
        monkeypatch.undo()
        importlib.reload(_version)


def test_contributing_says_what_the_layout_tests_point_to():
    page = open(os.path.join(REPO, "CONTRIBUTING.md"), encoding="utf-8").read()
    for heading in ("## The layout rules", "## Adding one of the pluggable parts"):
        assert heading in page, heading
    for rule in ("Imports run one way", "Public faces", "imports the top package",
                 "No function over 100 lines", "`launch` holds no arrays", "A moved module path"):
        assert rule in page, rule
    for part in ("A data source", "A cross-device op", "A save policy"):
        assert f"**{part}**" in page, part


def test_import_jaxdist_and_the_launcher_load_no_jax():
    # `import jaxdist` loads its public names on first use, and the launcher's modules need no
    # JAX: before, `python -m jaxdist.launch` and every elastic agent loaded JAX, Flax, Optax and
    # Orbax (2.3 s and 174 MB per agent; 0.2 s and 38 MB without). A fresh interpreter: what it
    # imports is the subject.
    launcher = ("launcher", "group", "elastic", "rendezvous", "receive", "hang", "reaper",
                "runtime", "cluster", "statedir", "heartbeat", "compile_cache")
    code = ("import sys, jaxdist, " + ", ".join(f"jaxdist.launch.{m}" for m in launcher) +
            "; print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax.checkpoint', 'grain')"
            " if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "TF_CONFIG"))}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    assert jaxdist.fit.__module__ == "jaxdist.training.fit"  # a name loads as it did


def test_the_top_packages_lazy_names_are_the_names_type_checkers_see():
    # jaxdist/__init__.py lists each public name twice: in the tables its __getattr__ loads from,
    # and as imports in its TYPE_CHECKING block (what mypy and IDEs read). They must not drift.
    tree = ast.parse(open(os.path.join(PKG, "__init__.py")).read())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and getattr(node.test, "id", None) == "TYPE_CHECKING")
    seen = {}
    for node in block.body:
        for alias in node.names:
            assert (alias.asname or alias.name) == alias.name, alias.name  # re-exported as itself
            seen[alias.name] = f"{node.module}.{alias.name}"
    tables = {**{n: f"{m}.{n}" for n, m in jaxdist._PUBLIC.items()}, **jaxdist._NAMESPACES}
    assert seen.keys() == tables.keys() == set(jaxdist.__all__)
    for name, path in seen.items():  # the same object, however the path is spelled
        value = getattr(jaxdist, name)  # first: it imports a namespace's module
        module, attr = path.rsplit(".", 1)
        assert getattr(importlib.import_module(module), attr) is value, name
