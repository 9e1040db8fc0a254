"""The package keeps its shape: ruff and mypy clean, imports pointing one way, a core of plain
Python, no module grown into several, the launch options declared once. Read from the source (ast)
and by the tools themselves."""
import ast
import os
import shutil
import subprocess
import sys
import typing
from dataclasses import fields

import pytest

pytestmark = pytest.mark.quality

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ddp_notebook")
# Lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = ["core", "transfer", "worker", "executors", "lifecycle", "recipes", "integrations", "ui"]
# Modules split by responsibility, not by length: a cohesive module of 600 lines is fine. This only
# catches a module that has grown into several.
MAX_LINES = 800
# What the pure core, and what runs inside a rank, must not import when they are imported.
NOT_IN_CORE = {"torch", "IPython", "ipywidgets", "ipyparallel", "matplotlib", "numpy"}
# What the core never imports, anywhere: it is plain Python about runs (devices, validation,
# errors, events, state, failures, bounds, run directories). Memory, sockets, processes and
# signals are the data path's, the executors' and the workers'.
OUTSIDE_THE_CORE = {"ctypes", "mmap", "socket", "subprocess", "signal", "fcntl", "faulthandler", "cloudpickle"}


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield (rel[: -len(".__init__")] if rel.endswith(".__init__") else rel), path


def imported(module, path):
    """Every ddp_notebook module ``module`` imports (at any depth: functions included), with the
    line and whether the import is at module level."""
    is_package = path.endswith("__init__.py")
    tree = ast.parse(open(path).read())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in top


def layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_imports_point_down_the_layers():
    upward = []
    for module, path in modules():
        mine = layer(module)
        if mine is None:  # the package root and __main__: the composition root imports anything
            continue
        for name, line, _ in imported(module, path):
            theirs = layer(name) if name.startswith("ddp_notebook.") else None
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{module}:{line} imports {name} ({mine} -> {theirs})")
            if name in ("ddp_notebook", "ddp_notebook.__init__") or name.startswith("ddp_notebook.__main__"):
                upward.append(f"{module}:{line} imports the package root")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_loop():
    # Every import counts, one inside a function or under TYPE_CHECKING too: a loop of modules
    # means their responsibilities are not split where the code says they are.
    found = dict(modules())
    graph = {m: {n for n, _, _ in imported(m, p) if n in found and n != m and not found[n].endswith("__init__.py")}
             for m, p in found.items()}
    loops, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                loops.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not loops, "modules importing each other in a loop:\n" + "\n".join(loops)


def test_the_core_imports_no_heavy_or_front_end_library_at_import_time():
    found = []
    for module, path in modules():
        if layer(module) in ("core", "transfer", "worker"):
            for name, line, at_top in imported(module, path):
                if at_top and name.split(".")[0] in NOT_IN_CORE:
                    found.append(f"{module}:{line} imports {name}")
    assert not found, found


def test_the_core_is_plain_python():
    found = [f"{module}:{line} imports {name}" for module, path in modules() if layer(module) == "core"
             for name, line, _ in imported(module, path) if name.split(".")[0] in OUTSIDE_THE_CORE]
    assert not found, found


def test_the_lifecycle_reaches_the_ranks_only_through_the_runs_contracts():
    # A run reaches its ranks through an executor's transport and the frames of core.events
    # (the assignment, control frames, events, a session's requests and answers): the lifecycle
    # (runs, sessions, their supervisor) never imports what runs inside a rank.
    found = [f"{m}:{line} imports {name}" for m, p in modules() if layer(m) == "lifecycle"
             for name, line, _ in imported(m, p) if name.startswith("ddp_notebook.worker")]
    assert not found, found


def test_nothing_imports_the_worker_process_or_fork_server_module():
    # boot.py runs them as __main__ with runpy: imported first, runpy warns in every worker.
    found = [f"{m}:{line}" for m, p in modules() for name, line, _ in imported(m, p)
             if name.startswith(("ddp_notebook.worker.process", "ddp_notebook.worker.zygote"))]
    assert not found, found


def test_no_module_has_grown_into_several():
    big = {m: n for m, p in modules() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not big, big


def test_a_package_says_what_it_owns_and_may_import():
    for module, path in modules():
        if path.endswith("__init__.py") and module != "ddp_notebook":
            doc = ast.get_docstring(ast.parse(open(path).read())) or ""
            assert "Owns" in doc and ("May import" in doc or module.count(".") > 1), module


def test_launch_options_are_declared_once():
    from ddp_notebook.lifecycle.options import LaunchKwargs, LaunchOptions

    hints = typing.get_type_hints(LaunchOptions)
    assert {f.name: hints[f.name] for f in fields(LaunchOptions)} == typing.get_type_hints(LaunchKwargs)


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e .[test]")
    done = subprocess.run([ruff, "check", "ddp_notebook", "tests", "conftest.py", "benchmarks", "scripts"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
