"""The import graph keeps its direction: rules are pure tensor code, tasks know nothing of decoding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dropmatch"
DECODING = {"models", "drafters", "engine", "methods", "runner", "experiments", "analysis", "judge_mining", "cli"}


def imported_modules(path: Path) -> set[str]:
    """First component under ``dropmatch`` of every module ``path`` imports (absolute or relative)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts] if node.module else [base + [a.name] for a in node.names]
            else:
                names = [(node.module or "").split(".")]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        found.update(parts[1] for parts in names if len(parts) > 1 and parts[0] == "dropmatch")
    return found


@pytest.mark.parametrize("layer, forbidden", [
    ("rules", DECODING | {"tasks"}),
    ("heads", DECODING | {"rules", "tasks"}),
    ("tasks", DECODING | {"rules", "heads"}),
])
def test_lower_layers_import_no_higher_one(layer, forbidden):
    offenders = {str(f.relative_to(PACKAGE)): sorted(imported_modules(f) & forbidden)
                 for f in (PACKAGE / layer).rglob("*.py")}
    assert not {f: m for f, m in offenders.items() if m}


def test_the_checker_sees_relative_and_absolute_imports(tmp_path):
    module = PACKAGE / "rules" / "standard.py"
    assert {"sampling", "rules"} <= imported_modules(module)
    assert "engine" in imported_modules(PACKAGE / "methods.py")
