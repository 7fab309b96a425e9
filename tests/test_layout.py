"""The layout's rules (DESIGN section 3), checked on the source: imports point one way, no cycles.

- `common/` never imports a stage (`router`, `prefill`, `decode`), not even lazily, except the
  `pdserve` dispatcher `common/cli.py`; `kvtransfer/` imports no stage; stages do not import
  each other; `benchmarks/` never imports `tests/`; `common/kernels` never imports
  `common/model`.
- Module-level imports between the packages' modules form no cycle (imports inside functions are
  the deliberate way to defer a heavy import and are allowed to point back).
- Every module imports in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "router", "prefill", "decode", "kvtransfer")
STAGES = ("router", "prefill", "decode")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def imported(node: ast.AST, current: str, is_package: bool) -> list[str]:
    """Dotted names an import statement brings in (`from a import b` gives a and a.b)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolve against the current package
            base = current.split(".")
            base = base if is_package else base[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        return [module] + [f"{module}.{alias.name}" for alias in node.names]
    return []


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module, current: str, is_package: bool) -> list[str]:
    """Imports executed when the module is imported (not in functions, not TYPE_CHECKING)."""
    names: list[str] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names += imported(node, current, is_package)
            continue
        if isinstance(node, ast.ClassDef):
            stack.extend(node.body)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)
    return names


def all_imports(tree: ast.Module, current: str, is_package: bool) -> list[str]:
    return [n for node in ast.walk(tree) for n in imported(node, current, is_package)]


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def top(name: str) -> str:
    return name.split(".")[0]


def test_common_and_kvtransfer_never_import_a_stage() -> None:
    offenders = []
    for path in source_files("common", "kvtransfer"):
        mod = module_name(path)
        if mod == "common.cli":  # the pdserve dispatcher: the one module that imports upward
            continue
        tree = parse(path)
        for name in all_imports(tree, mod, path.name == "__init__.py"):
            if top(name) in STAGES:
                offenders.append(f"{mod} imports {name}")
    assert not offenders, offenders


def test_kernels_never_import_the_model() -> None:
    """common/kernels take tensors and plain descriptions (quant_weight.QuantWeight,
    cpu_layer.LayerWeights) that the model side builds: not even a lazy or type-only import of
    common.model there."""
    offenders = []
    for path in source_files("common/kernels"):
        mod = module_name(path)
        for name in all_imports(parse(path), mod, path.name == "__init__.py"):
            if name == "common.model" or name.startswith("common.model."):
                offenders.append(f"{mod} imports {name}")
    assert not offenders, offenders


def test_stages_do_not_import_each_other() -> None:
    offenders = []
    for stage in STAGES:
        for path in source_files(stage):
            mod = module_name(path)
            for name in all_imports(parse(path), mod, path.name == "__init__.py"):
                if top(name) in STAGES and top(name) != stage:
                    offenders.append(f"{mod} imports {name}")
    assert not offenders, offenders


def test_benchmarks_never_import_tests() -> None:
    offenders = [
        f"{path.name} imports {name}"
        for path in source_files("benchmarks")
        for name in all_imports(parse(path), "benchmarks." + path.stem, False)
        if top(name) == "tests"
    ]
    assert not offenders, offenders


def test_no_import_cycles() -> None:
    files = source_files(*PACKAGES)
    modules = {module_name(p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in files:
        mod = module_name(path)
        for name in module_level_imports(parse(path), mod, path.name == "__init__.py"):
            # importing a.b.c runs a/__init__ and a/b/__init__ first; a module's own ancestor
            # packages are already being imported when it runs, so those edges close no cycle
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    cycles = strongly_connected(graph)
    assert not cycles, cycles


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; returns the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    modules = sorted(module_name(p) for p in source_files(*PACKAGES))
    # Deepest modules first: a module that only works after its package's siblings were
    # imported by someone else fails here.
    order = sorted(modules, key=lambda m: (-m.count("."), m))
    code = f"import importlib\nfor m in {order!r}:\n    importlib.import_module(m)\n"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
