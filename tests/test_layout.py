"""The package's layers: no module imports from a layer above its own, and no modules import each other in a circle.
And its map: README.md's layout section and each folder's __init__.py name every module of the folder, and no other.

Read from the source with ast (nothing is imported), imports inside functions included: a lazy import up the layers
is still a dependency up the layers.
"""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchtitan_lite"
README = PACKAGE.parent / "README.md"
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
    model = "torchtitan_lite.models.llama3.model"
    edges = {**graph(), model: {"torchtitan_lite.parallel.dims"}, "torchtitan_lite.parallel.dims": {model}}
    assert f"{model} imports torchtitan_lite.parallel.dims" in upward(edges)
    assert [model, "torchtitan_lite.parallel.dims", model] in circles(edges)


MODELS = "torchtitan_lite.models"
GENERIC_MODELS = {f"{MODELS}.{name}" for name in ("spec", "registry", "documents", "init", "init_cpu", "common")}


def architecture_imports(edges: dict[str, set[str]]) -> list[str]:
    """The parallel layer's imports of an architecture (`models.llama3...`, anything of models/ but its model-generic
    modules): it gets what it needs of a model from the model's spec (models/spec.py), never a model class. The
    registry is generic too: it names the architectures so that no other layer has to."""
    return sorted(f"{a} imports {b}" for a, targets in edges.items() if a.startswith("torchtitan_lite.parallel")
                  for b in targets if b.startswith(f"{MODELS}.") and ".".join(b.split(".")[:3]) not in GENERIC_MODELS)


def test_the_parallel_layer_imports_no_architecture():
    assert not architecture_imports(graph()), "\n".join(architecture_imports(graph()))


def test_the_architecture_check_sees_a_planted_import():
    edges = {**graph(), "torchtitan_lite.parallel.pipeline": {f"{MODELS}.llama3", f"{MODELS}.spec"}}
    assert architecture_imports(edges) == [f"torchtitan_lite.parallel.pipeline imports {MODELS}.llama3"]


def names_of_models(files: dict[str, str], models: set[str]) -> list[str]:
    """Where library code outside models/ names an architecture: an import of its folder, or a string that is a
    registered model's name or one of its flavors' (a model's knowledge belongs in its spec). The config's defaults
    (model.name and model.flavor: what a run trains unless told otherwise) are the one allowed place."""
    found = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{MODELS}."):
                if ".".join(node.module.split(".")[:3]) not in GENERIC_MODELS:
                    found.append(f"{path}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Constant) and node.value in models and path != "config/sections.py":
                found.append(f"{path}:{node.lineno} names {node.value!r}")
    return found


def library_files() -> dict[str, str]:
    return {str(f.relative_to(PACKAGE)): f.read_text() for f in PACKAGE.rglob("*.py")
            if f.relative_to(PACKAGE).parts[0] != "models"}


def test_no_library_code_outside_models_names_a_model():
    """The files a new architecture touches outside its folder are the registry, its configs and its rows in the
    parity tables (docs/extension.md): nothing in the trainer, the parallel layer or the tools knows a model."""
    from torchtitan_lite.models import registry  # noqa: PLC0415 - torch's import, for this test alone

    models = {name for name in registry.SPECS} | {f for spec in registry.SPECS.values() for f in spec.flavors}
    assert not names_of_models(library_files(), models), "\n".join(names_of_models(library_files(), models))
    planted = {**library_files(), "tools/planted.py": 'from torchtitan_lite.models.qwen3 import spec\nSIZE = "8B"\n'}
    assert names_of_models(planted, models) == ["tools/planted.py:1 imports torchtitan_lite.models.qwen3",
                                                "tools/planted.py:2 names '8B'"]


ENTRY = re.compile(r"^- ([\w.]+):", re.M)  # an __init__ docstring's line per module: `- loader.py: what it owns`
PARENTHESES = re.compile(r"\([^()]*\)")
FOLDER = re.compile(r"( {0,8})(\w+)/(?: |$)")  # a folder's first line in README's tree, two spaces a level deeper


def on_disk() -> dict[str, set[str]]:
    """Each package folder (`torchtitan_lite/data`) -> its modules (`loader.py`) and subpackages (`data`)."""
    return {init.parent.relative_to(PACKAGE.parent).as_posix():
            {p.name for p in init.parent.glob("*.py") if p.name != "__init__.py"}
            | {d.name for d in init.parent.iterdir() if (d / "__init__.py").is_file()}
            for init in PACKAGE.rglob("__init__.py")}


def in_inits() -> dict[str, set[str]]:
    """Each package folder -> the names its __init__.py docstring lists, one `- name:` line each."""
    return {init.parent.relative_to(PACKAGE.parent).as_posix():
            set(ENTRY.findall(ast.get_docstring(ast.parse(init.read_text())) or ""))
            for init in PACKAGE.rglob("__init__.py")}


def in_readme(text: str) -> dict[str, set[str]]:
    """Each folder of the package in README's layout tree -> the modules and subfolders named on its lines. What is in
    parentheses describes a module, so a name mentioned there is not counted as listed."""
    section = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert section, "README.md has no `## Layout` section with its tree in a ``` block"
    path, lines = [], {}
    for line in section.group(1).splitlines():
        if m := FOLDER.match(line):
            path = [*path[: len(m.group(1)) // 2], m.group(2)]
            lines.setdefault("/".join(path[:-1]), []).append(m.group(2) + "/")
            line = line[m.end():]
        lines.setdefault("/".join(path), []).append(line)
    named = {}
    for folder, text in lines.items():
        text = " ".join(text)
        while PARENTHESES.search(text):  # innermost first: a description may hold parentheses of its own
            text = PARENTHESES.sub("", text)
        named[folder] = set(re.findall(r"\b\w+\.py\b", text)) | set(re.findall(r"(\w+)/(?=\s|$)", text))
    return {folder: names for folder, names in named.items() if folder.split("/")[0] == PACKAGE.name}


def mismatches(listed: dict[str, set[str]], disk: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """The package's modules that `listed` leaves out, and the modules it names that the package does not hold."""
    missing = sorted(f"{folder}/{name}" for folder, names in disk.items() for name in names - listed.get(folder, set()))
    stale = sorted(f"{folder}/{name}" for folder, names in listed.items() for name in names - disk.get(folder, set()))
    return missing, stale


def test_readme_layout_names_every_module():
    missing, stale = mismatches(in_readme(README.read_text()), on_disk())
    assert not missing, f"README.md's layout section does not name {missing} (a few words on each, in its style)"
    assert not stale, f"README.md's layout section names {stale}, which do not exist"


def test_each_init_lists_its_modules():
    missing, stale = mismatches(in_inits(), on_disk())
    assert not missing, f"the folder's __init__.py docstring does not list {missing} (a `- NAME: what it owns` line)"
    assert not stale, f"the folder's __init__.py docstring lists {stale}, which do not exist"


def test_the_lists_checks_see_a_missing_and_a_stale_module():
    """A module renamed in README's tree is both missing and stale there; a module planted on disk is missing from
    its __init__'s list, and one planted in that list is stale."""
    missing, stale = mismatches(in_readme(README.read_text().replace("digest.py", "renamed.py")), on_disk())
    assert "torchtitan_lite/data/digest.py" in missing and "torchtitan_lite/data/renamed.py" in stale
    disk, inits = on_disk(), in_inits()
    disk["torchtitan_lite/data"].add("planted.py")
    inits["torchtitan_lite/tools"].add("gone.py")
    missing, stale = mismatches(inits, disk)
    assert "torchtitan_lite/data/planted.py" in missing and "torchtitan_lite/tools/gone.py" in stale
