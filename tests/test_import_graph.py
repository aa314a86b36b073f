"""python/paddle_step has no import cycle, and its paddle-free parts stay paddle-free.

The graph holds every import a module makes at module level, under ``if TYPE_CHECKING:``
or ``try:`` too; imports inside functions (deferred on purpose) are left out.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import paddle_step

PACKAGE_DIR = Path(paddle_step.__file__).parent
PACKAGE = "paddle_step"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its
    ``__init__``)."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements outside function and class bodies."""
    found = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            pending.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's own modules that module ``name`` imports at module level."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in module_level_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = name.split(".")
            base = base[: len(base) - node.level + (1 if is_package else 0)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        targets.add(source)
        # `from package import submodule` imports the submodule too.
        targets.update(f"{source}.{alias.name}" for alias in node.names)
    return {target for target in targets if target in known and target != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    finished: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in finished:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        finished.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = {"d"}
    assert find_cycle(graph) is None


def test_imports_resolve_relative_and_type_checking_imports(tmp_path):
    source = tmp_path / "scheduler.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..config import EngineConfig\n"
        "from . import request\n"
        "if TYPE_CHECKING:\n"
        "    from .outputs import StepOutcome\n"
        "def later():\n"
        "    from .naive import generate_naive\n"
    )
    known = {
        "paddle_step",
        "paddle_step.config",
        "paddle_step.engine",
        "paddle_step.engine.naive",
        "paddle_step.engine.outputs",
        "paddle_step.engine.request",
        "paddle_step.engine.scheduler",
    }
    assert imported_modules("paddle_step.engine.scheduler", source, known) == {
        "paddle_step.config",
        "paddle_step.engine",
        "paddle_step.engine.outputs",
        "paddle_step.engine.request",
    }


def test_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30, sorted(graph)  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_tokenizer_and_protocol_import_without_paddle():
    code = (
        "import sys\n"
        "import paddle_step.tokenizer, paddle_step.tokenizer.hf\n"
        "import paddle_step.entrypoints.openai.protocol\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] == 'paddle'))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_DIR.parent))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
