"""The size limits the layout keeps, checked so that a change that breaks them says so: the training loop stays
short, no function in the library outgrows one screen, and the profiling package stays in small files."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "mobilenet"


def _definitions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_the_trainer_is_at_most_200_lines():
    sizes = [n for node, n in _definitions(LIBRARY / "engine.py")
             if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    assert sizes and sizes[0] <= 200, f"Trainer is {sizes} lines: move what it does not need into a module"


def test_no_library_function_is_longer_than_80_lines():
    long = [f"{path.relative_to(LIBRARY.parent)}:{node.lineno} {node.name} ({n} lines)"
            for path in sorted(LIBRARY.rglob("*.py")) for node, n in _definitions(path)
            if not isinstance(node, ast.ClassDef) and n > 80]
    assert not long, long


def test_profiling_files_are_at_most_400_lines():
    big = {p.name: n for p in (LIBRARY / "profiling").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not big, big
