"""What scripts/gen_sglang_flags.py reads from SGLang's model classes without importing them
(their modules need CUDA kernels, transformers and more): the architectures the registry
serves, and which of their classes have a given method, inherited ones included.

The registry (models/registry.py `import_model_classes`) maps each class in a module's
`EntryClass` to its `__name__`; a base class is followed through its module's imports and
aliases into the other model modules, and no further (torch, transformers: no such method).
"""

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "sglang.srt.models"


@dataclass
class Module:
    """One model module: its classes (bases, methods), imported and aliased names, entries."""

    classes: dict[str, tuple[list[ast.expr], set[str]]] = field(default_factory=dict)
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local → (module, name)
    modules: dict[str, str] = field(default_factory=dict)  # `import a.b as m`: m → a.b
    entries: list[ast.expr] = field(default_factory=list)


def _absolute(module: str, level: int, name: str | None) -> str:
    """An import's module as an absolute name, `from .x import y` resolved in PACKAGE."""
    if level == 0:
        return name or ""
    base = module.split(".")[:-level]
    return ".".join([*base, name] if name else base)


def _read(module: str, source: str) -> Module:
    found = Module()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            found.classes[node.name] = (node.bases, methods)
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(module, node.level, node.module)
            for alias in node.names:
                found.names[alias.asname or alias.name] = (origin, alias.name)
                found.modules[alias.asname or alias.name] = f"{origin}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id == "EntryClass":
                value = node.value
                found.entries = list(value.elts) if isinstance(value, ast.List) else [value]
            elif isinstance(target, ast.Name) and isinstance(node.value, ast.Name):
                found.names[target.id] = (module, node.value.id)
    return found


class ModelClasses:
    """SGLang's model modules as read from the installed package's source."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec(PACKAGE)
        assert spec is not None and spec.submodule_search_locations, PACKAGE
        self.root = Path(spec.submodule_search_locations[0])
        self._modules: dict[str, Module | None] = {}

    def _module(self, name: str) -> Module | None:
        """A module of the models package (subpackages too), None for any other."""
        if name not in self._modules:
            rel = name.removeprefix(PACKAGE + ".").replace(".", "/")
            path = self.root / f"{rel}.py"
            is_model = name.startswith(PACKAGE + ".") and path.is_file()
            self._modules[name] = _read(name, path.read_text()) if is_model else None
        return self._modules[name]

    def _resolve(self, module: str, expr: ast.expr) -> tuple[str, str] | None:
        """(defining module, class name) of a class expression, None outside the package."""
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            found = self._module(module)
            target = found.modules.get(expr.value.id) if found else None
            return self._resolve(target, ast.Name(expr.attr)) if target else None
        if not isinstance(expr, ast.Name):
            return None
        found = self._module(module)
        if found is None:
            return None
        if expr.id in found.classes:
            return module, expr.id
        if expr.id in found.names:
            origin, name = found.names[expr.id]
            if (origin, name) == (module, expr.id):
                return None
            return self._resolve(origin, ast.Name(name))
        return None

    def has_method(self, module: str, name: str, method: str) -> bool:
        """Whether the class, or a base class in the package, defines `method`."""
        found = self._module(module)
        assert found is not None, module
        bases, methods = found.classes[name]
        if method in methods:
            return True
        resolved = (self._resolve(module, base) for base in bases)
        return any(self.has_method(*r, method) for r in resolved if r is not None)

    def entries(self) -> dict[str, tuple[str, str]]:
        """Every registered architecture → (module, class name), as the registry builds it
        (top-level modules only: pkgutil.iter_modules skips the subpackages)."""
        out: dict[str, tuple[str, str]] = {}
        for path in sorted(self.root.glob("*.py")):
            module = f"{PACKAGE}.{path.stem}"
            found = self._module(module)
            assert found is not None, module
            for expr in found.entries:
                resolved = self._resolve(module, expr)
                assert resolved is not None, f"{module}: EntryClass {ast.unparse(expr)}"
                assert resolved[1] not in out, f"two classes named {resolved[1]}"
                out[resolved[1]] = resolved
        return out
