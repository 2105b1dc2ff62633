"""The package's shape, read from its source: which module imports which, and module sizes.

Layers, top to bottom (LAYERS below): an import may go down or stay on its layer, never up;
and no two modules may import each other, directly or round a loop.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cachemgr"
MAX_LINES = 600  # STYLE.md: one module per concept, none over 600 lines

# Top first. A module's layer is that of the longest dotted prefix of its name under cachemgr
# listed here: an engine's package spans layers (its file format at the bottom, its identity
# record beside the identity layer, doctor's lint beside doctor, its `Engine` object above).
LAYERS: list[set[str]] = [
    {"cli", "__main__"},
    {"daemon"},
    # the registry and the engines (a probe is an engine's worker in the daemon)
    {"engines", "engine", "sglang.engine", "sglang.probe", "vllm.engine"},
    {"gc", "doctor", "fleet", "sglang.lint", "vllm.lint"},
    {"ns"},
    {"identity", "sglang.record", "sglang.identity", "sglang.kvscales", "vllm.identity"},
    {"state"},
    {"fs"},
    {
        "layout",
        "backends",
        "flagtext",
        "argprefix",
        "launchenv",
        "sglang",
        "vllm",
        "formats",
        "settings",
        "logs",
        "units",
        "canonical",
        "gil",
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
    parts = module.split(".")[1:]
    keys = [".".join(parts[:n]) for n in range(len(parts), 0, -1)] or [""]
    for key in keys:
        for i, members in enumerate(LAYERS):
            if key in members:
                return i
    raise AssertionError(f"{module} is on no layer: add it to LAYERS")


def test_an_engine_module_takes_its_listed_layer() -> None:
    assert layer("cachemgr.vllm.engine") < layer("cachemgr.doctor.root")
    assert layer("cachemgr.vllm.identity") == layer("cachemgr.identity.record")
    assert layer("cachemgr.vllm.fstier") == layer("cachemgr.layout")


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


# The formatter's layout is the project's layout: an opt-out hides packed code from review.
FORMATTER_OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)\b")


def test_the_opt_out_check_sees_a_marker() -> None:
    assert FORMATTER_OPT_OUT.search("a, b = 1, 2  # fmt" + ": skip")  # split: not one here
    assert not FORMATTER_OPT_OUT.search("fmt: FileFormat = HICACHE_FILE")


def _opt_outs(path: Path) -> list[int]:
    source = path.read_text(encoding="utf-8")
    return [n for n, line in enumerate(source.splitlines(), 1) if FORMATTER_OPT_OUT.search(line)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_has_no_formatter_opt_out(module: str) -> None:
    lines = _opt_outs(MODULES[module])
    assert not lines, f"{module}: formatter opt-out on lines {lines}"


def test_tests_and_benches_have_no_formatter_opt_out() -> None:
    repo = PACKAGE.parent
    paths = sorted([*(repo / "tests").rglob("*.py"), *(repo / "bench").rglob("*.py")])
    found = {str(p.relative_to(repo)): lines for p in paths if (lines := _opt_outs(p))}
    assert not found, f"formatter opt-outs: {found}"


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


# Engine knowledge lives in the engine's package and the registry (STYLE.md 11); settings.py
# holds the engine-specific settings by name. Elsewhere a few names remain (the file formats
# and records the layers below the registry read): at most this.
ENGINE_NAME = re.compile(r"sglang|vllm", re.IGNORECASE)
ENGINE_HOMES = ("cachemgr.sglang", "cachemgr.vllm", "cachemgr.engines", "cachemgr.settings")
MAX_ENGINE_NAMES = 8


def identifiers(source: str) -> list[str]:
    """Every identifier of a module: names, attributes, function, class and argument names,
    keywords, imported names and modules; no strings, no comments."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.append(node.id)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append(node.name)
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
            found.append(node.arg)
        elif isinstance(node, ast.alias):
            found.append(node.asname or node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


def engine_names(source: str) -> list[str]:
    return [name for name in identifiers(source) if ENGINE_NAME.search(name)]


def test_the_identifier_walk_sees_engine_names_and_skips_text() -> None:
    src = (
        "from cachemgr.vllm.args import VllmLaunchArgs\n"
        "def sglang_port(vllm_arg: int) -> str:  # sglang\n"
        "    return f(engine=x.SGLANG, vllm_version='vllm')\n"
    )
    assert engine_names(src) == [
        "cachemgr.vllm.args",
        "sglang_port",
        "VllmLaunchArgs",
        "vllm_arg",
        "vllm_version",
        "SGLANG",
    ]


def test_engine_names_stay_in_the_engines_packages_and_the_registry() -> None:
    outside = {
        m: len(engine_names(p.read_text(encoding="utf-8")))
        for m, p in MODULES.items()
        if not any(m == home or m.startswith(home + ".") for home in ENGINE_HOMES)
    }
    outside = {m: n for m, n in outside.items() if n}
    total = sum(outside.values())
    assert total <= MAX_ENGINE_NAMES, f"{total} engine-named identifiers outside: {outside}"


# The layers below the registry cannot ask it: they read these two tables of every engine.
ENGINE_TABLES = {"cachemgr.formats", "cachemgr.identity.engines"}


def test_only_the_engine_tables_below_the_registry_name_an_engine() -> None:
    """The CLI, the daemon (its probe comes from the registry), GC, doctor and namespaces
    name no engine."""
    naming = sorted(
        m
        for m, p in MODULES.items()
        if not any(m == home or m.startswith(home + ".") for home in ENGINE_HOMES)
        and m not in ENGINE_TABLES
        and engine_names(p.read_text(encoding="utf-8"))
    )
    assert not naming, f"modules that name an engine: {naming}"


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def package_map() -> dict[str, str]:
    """The package map's rows: each name in its first column -> the row's text."""
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    table = doc[doc.index("## Package map") : doc.index("## Layers")]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[1].strip().startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[1]):
                rows[name] = line
    return rows


@pytest.mark.parametrize("module", sorted(m for m in MODULES if MODULES[m].name != "__init__.py"))
def test_module_is_in_the_package_map(module: str) -> None:
    """docs/architecture.md names every module: top-level ones in the first column, a
    package's in its row (as `name.py`)."""
    rel = MODULES[module].relative_to(PACKAGE)
    rows = package_map()
    if len(rel.parts) == 1:
        assert rel.name in rows, f"{rel} is not in the package map of {ARCHITECTURE}"
    else:
        row = rows.get(f"{rel.parts[0]}/", "")
        assert re.search(rf"`{re.escape(rel.name)}`", row), (
            f"{rel} is not in the {rel.parts[0]}/ row of the package map in {ARCHITECTURE}"
        )


MAX_PARAMS = 8  # STYLE.md 10: what travels together is one object
# Counted: every parameter a caller may pass (positional, keyword-only, *args, **kwargs);
# not the `self`/`cls` a method receives.
BOUND = {"self", "cls"}


def long_signatures(source: str) -> list[str]:
    """`name(n)` for each function taking more than MAX_PARAMS parameters."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
            n = len([p for p in names if p not in BOUND])
            if n > MAX_PARAMS:
                found.append(f"{node.name}({n})")
    return found


def test_the_signature_walk_counts_parameters() -> None:
    nine = "def f(a, b, c, d, e, f, g, h, i): ..."
    assert long_signatures(nine) == ["f(9)"]
    assert long_signatures("def f(a, b, c, d, e, f, g, *, h, **kw): ...") == ["f(9)"]
    method = "class C:\n    def m(self, a, b, c, d, e, f, g, h): ..."
    assert long_signatures(method) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if top(m) != "cli"))
def test_no_function_outside_the_cli_takes_more_than_8_parameters(module: str) -> None:
    """The CLI's commands take one parameter per flag (click's way); nothing else may."""
    long = set(long_signatures(MODULES[module].read_text(encoding="utf-8")))
    assert not long, f"{module}: {long} take more than {MAX_PARAMS} parameters: bundle them"


LOGS_HOME = "cachemgr.logs"  # where purpose loggers (named for what they log) are declared


def named_loggers(source: str) -> list[int]:
    """Lines of `getLogger(...)` calls whose name is not `__name__`."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and (ast.unparse(node.func) in {"getLogger", "logging.getLogger"})
        and [ast.unparse(a) for a in node.args] != ["__name__"]
    ]


def test_the_logger_walk_sees_a_borrowed_name() -> None:
    src = 'import logging\na = logging.getLogger(__name__)\nb = logging.getLogger("x.y")\n'
    assert named_loggers(src) == [3]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != LOGS_HOME))
def test_every_logger_is_named_after_its_module(module: str) -> None:
    """A JSON log line's `logger` names the file that wrote it; a line with a purpose (the
    HTTP trail) uses the logger `cachemgr.logs` declares for it."""
    lines = named_loggers(MODULES[module].read_text(encoding="utf-8"))
    assert not lines, f"{module}: getLogger without __name__ at lines {lines}"


def test_purpose_loggers_are_declared_once() -> None:
    """Each name given to getLogger in cachemgr.logs is given once: one declaration each."""
    tree = ast.parse(MODULES[LOGS_HOME].read_text(encoding="utf-8"))
    names = [
        ast.literal_eval(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "logging.getLogger"
        and isinstance(node.args[0], ast.Constant)
    ]
    assert len(names) == len(set(names)), names
