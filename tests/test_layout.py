"""The package's layers: no module imports from a layer above its own, and no modules import each other in a circle.

Read from the source with ast (nothing is imported), imports inside functions included: a lazy import up the layers
is still a dependency up the layers.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_lite"
LAYERS = ("config", "runtime", "models", "quantization", "data", "parallel", "checkpoint", "training", "tools")  # bottom to top


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The torchtitan_lite modules (or packages) that `path` imports, relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module` too
    return {name for name in found if name.split(".")[0] == "torchtitan_lite"}


def layer(module: str) -> int:
    """The layer of a module; the package itself is below them all (its __init__ is a docstring)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imported(path) if m in modules and m != name} for name, path in modules.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} imports {b}" for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, found by a depth-first walk."""
    found, done = [], set()

    def walk(node: str, stack: list[str]) -> None:
        for nxt in sorted(edges.get(node, ())):
            if nxt in stack:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(nxt, [*stack, nxt])
        done.add(node)

    for start in sorted(edges):
        if start not in done:
            walk(start, [start])
    return found


def test_every_module_is_in_a_layer():
    stray = [m for m in graph() if m != "torchtitan_lite" and layer(m) < 0]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_no_import_runs_up_the_layers():
    assert not upward(graph()), "\n".join(upward(graph()))


def test_no_import_circles():
    assert not circles(graph()), circles(graph())


def test_only_config_reexports():
    """Importing one module must not import a whole layer: subpackages' __init__ hold a docstring and nothing else
    (config's re-exports its public API, so `from torchtitan_lite.config import X` reads as one module would)."""
    for init in PACKAGE.rglob("__init__.py"):
        body = ast.parse(init.read_text()).body
        assert body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), f"{init}: docstring"
        if init.parent.name != "config":
            assert len(body) == 1, f"{init}: only a docstring"


def test_the_checks_see_a_planted_upward_import_and_circle():
    """The walk itself works: an upward edge and a circle planted in a copy of the graph are both reported."""
    edges = {**graph(), "torchtitan_lite.models.llama": {"torchtitan_lite.parallel.dims"},
             "torchtitan_lite.parallel.dims": {"torchtitan_lite.models.llama"}}
    assert "torchtitan_lite.models.llama imports torchtitan_lite.parallel.dims" in upward(edges)
    assert ["torchtitan_lite.models.llama", "torchtitan_lite.parallel.dims", "torchtitan_lite.models.llama"] in circles(
        edges)
