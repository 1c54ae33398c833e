"""``policies`` is the decision layer: pure Python (numpy), never importing serve_app or heavy deps."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import policies

PACKAGE = Path(policies.__file__).parent
FORBIDDEN = ("serve_app", "torch", "ray", "redis", "fastapi", "transformers", "opentelemetry")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names.update(
                a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
            )
    return names


def test_no_module_of_policies_imports_serve_app_or_heavy_packages():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10
    offenders = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in files
        for name in imported_modules(path)
        if name.split(".")[0] in FORBIDDEN or "importlib" in name
    }
    assert not offenders, offenders


def test_importing_policies_loads_none_of_them():
    # A fresh interpreter: the test session itself has torch and serve_app loaded by conftest.
    code = (
        "import sys, policies, policies.simulate\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == ""
