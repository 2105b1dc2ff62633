"""The package's shape, read from its source: which module imports which, and module sizes.

Layers, top to bottom (LAYERS below): an import may go down or stay on its layer, never up;
and no two modules may import each other, directly or round a loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cachemgr"
MAX_LINES = 600

# Top first. A module's layer is that of its first dotted part under cachemgr.
LAYERS: list[set[str]] = [
    {"cli", "__main__"},
    {"daemon"},
    {"gc", "doctor"},
    {"ns"},
    {"identity"},
    {"state"},
    {"fs"},
    {
        "layout",
        "backends",
        "flagtext",
        "sglang",
        "vllm",
        "engines",
        "settings",
        "logs",
        "units",
        "worker",
        "",
    },  # "": __init__
    {"errors"},
]
ENTRY_POINTS = {"cli", "daemon", "__main__"}  # what only a process entry may import


def module_name(path: Path) -> str:
    parts = ["cachemgr", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str) -> str:
    """The module a dotted name lives in: itself, or the nearest enclosing module (a name
    imported from a module, or a compiled extension inside a package)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str) -> set[str]:
    """Every cachemgr module `module` imports, at the top or inside a function."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names if _ours(a.name)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if _ours(base):
                found |= {resolve(f"{base}.{a.name}") for a in node.names}
    return found - {module}


def _ours(name: str) -> bool:
    return name == "cachemgr" or name.startswith("cachemgr.")


GRAPH = {m: imports_of(m) for m in MODULES}


def top(module: str) -> str:
    """The first part under cachemgr ("" for the package itself)."""
    return module.split(".")[1] if "." in module else ""


def layer(module: str) -> int:
    for i, members in enumerate(LAYERS):
        if top(module) in members:
            return i
    raise AssertionError(f"{module} is on no layer: add it to LAYERS")


def test_the_walk_sees_imports_inside_functions() -> None:
    """The CLI imports the daemon only when `serve` runs: the walk must still see it."""
    assert "cachemgr.daemon.lifecycle" in GRAPH["cachemgr.cli.serve"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_on_a_layer_and_imports_nothing_above_it(module: str) -> None:
    upward = sorted(m for m in GRAPH[module] if layer(m) < layer(module))
    assert not upward, f"{module} imports from a layer above it: {upward}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) > 1))
def test_library_never_imports_the_cli_or_the_daemon(module: str) -> None:
    entry = sorted(m for m in GRAPH[module] if top(m) in ENTRY_POINTS)
    assert not entry, f"{module} imports {entry}"


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "modules importing each other round a loop: " + "; ".join(
        ", ".join(c) for c in cycles
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each loop: strongly connected components of more than one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_check_finds_a_loop() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_600_lines(module: str) -> None:
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines"


SQL_CALLS = {"execute", "executemany", "executescript"}
SQL_HOME = "state"  # the layer that owns the SQL: named statements in cachemgr.state.*_sql


def sql_calls(source: str) -> list[int]:
    """Lines of `<anything>.execute(...)` and friends: a statement run on a connection."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SQL_CALLS
    ]


def test_the_sql_walk_sees_a_statement() -> None:
    src = "def f(store):\n    store.conn.execute('SELECT 1')\n    c.executemany(q, rows)\n"
    assert sql_calls(src) == [2, 3]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if top(m) != SQL_HOME))
def test_only_the_state_layer_runs_sql(module: str) -> None:
    """Callers name the query (cachemgr.state.registry_sql, pages_sql, …) instead of writing
    SQL; they still own the transaction (`with store.transaction():`)."""
    lines = sql_calls(MODULES[module].read_text(encoding="utf-8"))
    assert not lines, f"{module} runs SQL itself at lines {lines}: move it to cachemgr.state"


def store_before_layout(source: str) -> list[str]:
    """Functions whose parameters put a Store before a Layout."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kinds = [ast.unparse(a.annotation) for a in node.args.args if a.annotation]
            if (
                "Store" in kinds
                and "Layout" in kinds
                and kinds.index("Store") < kinds.index("Layout")
            ):
                found.append(node.name)
    return found


def test_the_order_walk_sees_store_before_layout() -> None:
    assert store_before_layout("def f(s: Store, l: Layout) -> None: ...") == ["f"]
    assert store_before_layout("def g(l: Layout, s: Store) -> None: ...") == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layout_comes_before_store(module: str) -> None:
    """One argument order everywhere: (layout, store, ...)."""
    wrong = store_before_layout(MODULES[module].read_text(encoding="utf-8"))
    assert not wrong, f"{module}: {wrong} take (store, layout); use (layout, store)"
