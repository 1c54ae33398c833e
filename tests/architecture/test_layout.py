"""The house rules (docs/architecture.md, "Rules"), checked on the source itself.

- no import circle among the project's modules, counting imports inside functions (a package's
  ``__init__`` importing its own submodules aside);
- no source file (package or test) over 400 lines;
- arrows point one way: ``policies`` imports nothing of ours; ``serve_app.engine`` imports only
  itself and ``policies`` and none of Ray, FastAPI, Redis, requests or subprocess; ``serve_app``
  imports no tool (``loadtest``, ``deploy``, the ``specserve`` command line);
- the HTTP layer and the wire types load no torch;
- proposer and policy names are spelled only in their own module and their registration.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("serve_app", "policies", "loadtest", "deploy", "training", "specserve")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files[module_name(path)] = path
    return files


MODULES = source_files()


def imported_names(path: Path) -> Iterator[str]:
    """Every module name an import statement anywhere in the file (functions too) names."""
    module = module_name(path)
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target
            for alias in node.names:
                yield f"{target}.{alias.name}"


def project_imports(module: str) -> set[str]:
    """The project's modules that ``module`` imports (a name resolves to the longest module)."""
    found = set()
    for name in imported_names(MODULES[module]):
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in MODULES:
                found.add(candidate)
                break
    found.discard(module)
    if MODULES[module].name == "__init__.py":  # a package re-exporting its own submodules
        found = {m for m in found if not m.startswith(module + ".")}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


GRAPH = {module: project_imports(module) for module in MODULES}


def test_the_walker_sees_imports_inside_functions() -> None:
    tree = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(tree) == [["a", "b", "c"]]
    # serve_app.app imports the api only inside a method: the walker must still see it.
    assert "serve_app.api.routes" in GRAPH["serve_app.app"]


def test_no_import_circle() -> None:
    assert cycles(GRAPH) == []


def test_no_source_file_over_400_lines() -> None:
    """The packages' modules and the tests that mirror them alike."""
    paths = [*MODULES.values(), *sorted((ROOT / "tests").rglob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _imports_of(prefix: str) -> dict[str, set[str]]:
    return {
        m: {n for n in imported_names(MODULES[m])}
        for m in MODULES
        if m == prefix or m.startswith(prefix + ".")
    }


def test_policies_import_nothing_of_ours() -> None:
    ours = ("serve_app", "loadtest", "deploy", "training", "specserve")
    bad = {
        m: sorted(n for n in names if n.split(".")[0] in ours) for m, names in _imports_of("policies").items()
    }
    assert {m: n for m, n in bad.items() if n} == {}


ENGINE_FORBIDDEN = (
    "ray",
    "fastapi",
    "starlette",
    "redis",
    "requests",
    "subprocess",
    "urllib",
    "opentelemetry",
)


def test_engine_imports_no_serving_or_io_library() -> None:
    bad = {}
    for module, names in _imports_of("serve_app.engine").items():
        wrong = sorted(
            n
            for n in names
            if n.split(".")[0] in ENGINE_FORBIDDEN
            or (n.startswith("serve_app.") and not n.startswith("serve_app.engine"))
            or n.split(".")[0] in ("loadtest", "deploy", "training", "specserve")
        )
        if wrong:
            bad[module] = wrong
    assert bad == {}


def test_serving_imports_no_tool() -> None:
    tools = ("loadtest", "deploy", "training", "specserve")
    bad = {
        m: sorted(n for n in names if n.split(".")[0] in tools)
        for m, names in _imports_of("serve_app").items()
    }
    assert {m: n for m, n in bad.items() if n} == {}


@pytest.mark.parametrize("module", ["serve_app.api", "serve_app.wire", "serve_app.config"])
def test_http_layer_loads_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"importing {module} loads torch"


def _string_constants(path: Path) -> Iterator[tuple[int, str]]:
    """String literals of a file, docstrings excluded (a docstring may name anything)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def _registered() -> dict[str, set[str]]:
    """Each registered name -> the modules allowed to spell it (its own module, its registration)."""
    import policies
    from policies.registry import policy_modules
    from serve_app.engine.proposers.registry import proposer_modules

    assert policies.registered_policies()
    allowed: dict[str, set[str]] = {}
    for name, module in policy_modules().items():
        allowed.setdefault(name, set()).update({module, "policies.registry"})
    for name, module in proposer_modules().items():
        allowed.setdefault(name, set()).update({module, "serve_app.engine.proposers.registry"})
    return allowed


def test_proposer_and_policy_names_live_in_their_registries() -> None:
    allowed = _registered()
    spelled = {}
    for module, path in MODULES.items():
        for line, value in _string_constants(path):
            if value in allowed and module not in allowed[value]:
                spelled.setdefault(value, []).append(f"{module}:{line}")
    assert spelled == {}
