"""Tier 1: the layout holds. No import cycle between modules, function-level imports only where a reason allows,
short functions, tests that import helper modules rather than each other.

Why tests: each of these rules was broken before it was written down (four import circles hidden by function-level
imports, a 558-line engine class); a test keeps the house from sliding back.
"""
import ast
import os
import re

import pytest

from conftest import ROOT

# source folder -> the package it installs as (setup.py's package_dir)
ROOMS = {"hethub": "hethub", "partitioner": "hethub.partitioner", "kernels": "hethub.kernels"}
OPTIONAL = {"triton", "transformers", "megatron", "matplotlib"}  # may be imported where used: not every install has them
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 400


def _modules() -> dict[str, str]:
    """Module name -> file, for every product module."""
    out = {}
    for folder, package in ROOMS.items():
        base = os.path.join(ROOT, folder)
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if f.endswith(".py") and "__pycache__" not in dirpath:
                    parts = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                    parts = parts[:-1] if parts[-1] == "__init__" else parts
                    out[".".join([package, *parts])] = os.path.join(dirpath, f)
    return out


MODULES = _modules()


def _target(module: str, path: str, node: ast.ImportFrom) -> str:
    package = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    if not node.level:
        return node.module or ""
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: str):
    """(imported product module or external name, line, in a function?, source line) of every import."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    lines = open(path, encoding="utf-8").read().splitlines()

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, in_function, lines[child.lineno - 1]
            elif isinstance(child, ast.ImportFrom):
                base = _target(module, path, child)
                for alias in child.names:
                    name = f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                    yield name, child.lineno, in_function, lines[child.lineno - 1]
            yield from visit(child, inside)
    yield from visit(tree, False)


def _product(name: str):
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for name, *_ in _imports(m, path):
            target = _product(name)
            if target and target != m:
                graph[m].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]):
    """One import cycle as a list of modules, or None (depth-first search with colours)."""
    state, stack = {}, []

    def walk(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = walk(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return None
    for v in sorted(graph):
        if v not in state:
            found = walk(v)
            if found:
                return found
    return None


def test_no_import_cycle_between_modules():
    """Module-level and function-level imports alike: a cycle hidden in a function is still a cycle."""
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_only_of_optional_packages_or_with_a_reason():
    """A function-level import is for an optional dependency (Triton, transformers, megatron-core, matplotlib) or
    says why on its line (``# lazy: ...``); anything else belongs at the top of the module."""
    bad = []
    for m, path in MODULES.items():
        for name, line, in_function, text in _imports(m, path):
            if in_function and name.split(".")[0] not in OPTIONAL and "# lazy:" not in text:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {text.strip()}")
    assert not bad, "\n".join(bad)


def _definitions():
    for path in MODULES.values():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield path, node, node.end_lineno - node.lineno + 1


def test_no_function_over_60_lines_and_no_class_over_400():
    long = [f"{os.path.relpath(p, ROOT)}:{n.lineno} {n.name}: {k} lines" for p, n, k in _definitions()
            if k > (MAX_CLASS_LINES if isinstance(n, ast.ClassDef) else MAX_FUNCTION_LINES)]
    assert not long, "\n".join(long)


def test_the_deepspeed_adapter_is_thin():
    """The engine only adapts DeepSpeed; the schedule, transfers and gradients are the runtime's parts."""
    path = MODULES["hethub.runtime.engine"]
    cls = next(n for p, n, _k in _definitions() if p == path and n.name == "HeteroPipelineEngine")
    assert cls.end_lineno - cls.lineno + 1 <= 200


@pytest.mark.parametrize("test_file", sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")))
def test_no_test_file_imports_another(test_file):
    """Shared helpers live in helper modules (conftest, dist_util, plans, instances), not in test files."""
    text = open(os.path.join(ROOT, "tests", test_file), encoding="utf-8").read()
    assert not re.search(r"^\s*(from|import) test_\w+", text, re.M), test_file


def test_setup_installs_every_package():
    """A sub-package missing from setup.py's list works in an editable install and is absent from a wheel."""
    text = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    listed = set(re.findall(r'"(hethub(?:\.\w+)*)"', text.split("packages=", 1)[1].split("]", 1)[0]))
    packages = {m for m, path in MODULES.items() if path.endswith("__init__.py")}
    assert packages == listed


def test_no_module_shadows_the_standard_library_where_scripts_run():
    """A script run by path puts its folder first on sys.path: ``hethub/cli/bench_worker.py`` then imports its
    neighbours before the standard library (a ``profile.py`` there broke ``cProfile`` inside torch)."""
    import sys
    for folder in ("hethub/cli", "hethub/emulated", "tests/workers", "tests", "benchmarks", "examples"):
        names = {f[:-3] for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".py")}
        assert not names & set(sys.stdlib_module_names), (folder, names & set(sys.stdlib_module_names))


def test_schedule_names_are_compared_only_in_their_registry():
    """What a schedule is lives in ``partitioner.schedule_kinds``: a module that compares a schedule's name (or
    tests membership of CHUNKED) would be one more place a new schedule has to be added."""
    import re
    names = r'"(1f1b|zb-h1|zb-v|interleaved-1f1b)"'
    pattern = re.compile(rf'(==|!=)\s*{names}|{names}\s*(==|!=)|\bin CHUNKED\b|\bnot in CHUNKED\b')
    found = []
    for root in ("partitioner", "hethub"):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, root)):
            for name in files:
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or name == "schedule_kinds.py":
                    continue
                with open(path) as f:
                    for i, line in enumerate(f, 1):
                        if pattern.search(line.split("#")[0]):
                            found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
