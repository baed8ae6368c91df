"""The package's import graph: no circles between modules, and every import runs down the layers
(a module imports its own layer or the ones below it, never one above). Function-local imports
count: a local import that dodges a circle is still a circle."""

import ast
from pathlib import Path

import kvbank

ROOT = Path(kvbank.__file__).parent

# top to bottom; a module belongs to the first entry its dotted name starts with
LAYERS = (
    ("kvbank.__main__", "kvbank.options_doc"),
    ("kvbank.cli",),
    ("kvbank.flags",),
    ("kvbank.server",),
    ("kvbank.engine",),
    ("kvbank.memory",),
    ("kvbank.models", "kvbank.integrations"),
    ("kvbank.config",),
    ("kvbank.cache",),
    ("kvbank.attention",),
    ("kvbank.kernels", "kvbank.tokenizer", "kvbank.defaults"),
)


def module_files(root: Path) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    top = next(iter(modules)).split(".")[0]
    resolved = set()
    for target in targets:
        while target and target not in modules:  # a name imported from a module: the module
            target = target.rpartition(".")[0]
        if target and target not in (name, top):
            resolved.add(target)
    return resolved


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(name: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{name} is in no layer: add it to LAYERS")


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} -> {b}" for a, targets in graph.items() if a != "kvbank" for b in targets if layer(b) < layer(a)
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer():
    for name in import_graph(ROOT):
        if name != "kvbank":
            layer(name)


def test_imports_never_run_up_the_layers():
    assert upward(import_graph(ROOT)) == []


def test_no_import_circles():
    assert circles(import_graph(ROOT)) == []


def private_imports(root: Path) -> list[str]:
    """`module: name` for each private name (`_x`, not `__x__`) one module takes from another module of the
    package, by import or as an attribute of an imported module."""
    modules = module_files(root)
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(root.name):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:
                        imported.add(alias.asname or alias.name)
                    elif _private(alias.name):
                        found.append(f"{name}: {node.module}.{alias.name}")
        for node in ast.walk(tree):
            named = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            if named and node.value.id in imported and _private(node.attr):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_takes_another_modules_private_names():
    assert private_imports(ROOT) == []


def test_the_checks_find_a_circle_and_an_upward_import_through_relative_and_local_imports(tmp_path):
    package = tmp_path / "kvbank"
    (package / "engine").mkdir(parents=True)
    (package / "cache").mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine" / "__init__.py").write_text("")
    (package / "cache" / "__init__.py").write_text("")
    (package / "engine" / "a.py").write_text("from .b import thing\n")
    (package / "engine" / "b.py").write_text("def f():\n    from kvbank.engine import a\n")
    (package / "cache" / "c.py").write_text("from ..engine.a import thing\n")
    graph = import_graph(package)
    assert graph["kvbank.engine.a"] == {"kvbank.engine.b"}
    assert graph["kvbank.engine.b"] == {"kvbank.engine.a"}
    assert circles(graph) == [["kvbank.engine.a", "kvbank.engine.b"]]
    assert upward(graph) == ["kvbank.cache.c -> kvbank.engine.a"]
    (package / "cache" / "d.py").write_text(
        "from kvbank.engine.a import _hidden\nfrom kvbank.engine import b\nb._peek()\n"
    )
    assert private_imports(package) == ["kvbank.cache.d: b._peek", "kvbank.cache.d: kvbank.engine.a._hidden"]
