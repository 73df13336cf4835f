"""The package's shape, checked with `ast` so it stays true: the JIT core imports no kernel family,
no import cycle anywhere, a family is one folder with a registered spec, every module says its job."""
import ast
from pathlib import Path

import pytest

from jitattn.jit import registry

PACKAGE = Path(__file__).resolve().parent.parent / "jitattn"
TEMPLATES = PACKAGE.parent / "templates"
# What the compiler service may import from jitattn besides itself: the error types.
JIT_MAY_IMPORT = ("jitattn.jit", "jitattn.errors")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """Every jitattn module `path` imports, at module level or inside a function (each
    `from a.b import c` names a.b.c when that is a module, else a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the package uses absolute imports)"
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name == "jitattn" or name.startswith("jitattn."))
    return found


GRAPH = {name: imported_modules(path) - {name} for name, path in MODULES.items()}


def family_folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "spec.py").is_file() and p.name != "jit")


def test_the_jit_core_imports_no_kernel_family():
    jit_modules = [name for name in MODULES if name == "jitattn.jit" or name.startswith("jitattn.jit.")]
    assert len(jit_modules) > 10  # the walk found the compiler service
    for name in jit_modules:
        foreign = sorted(m for m in GRAPH[name]
                         if not any(m == allowed or m.startswith(allowed + ".") for allowed in JIT_MAY_IMPORT))
        assert not foreign, f"{name} imports {foreign}: the JIT core must know no kernel family"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph`: each component of more than one module
    is a cycle."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in graph:
                continue
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_package_has_no_import_cycle():
    assert import_cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_the_cycle_check_sees_function_level_imports():
    """The walk must count imports inside functions too, or a lazy import could hide a cycle."""
    loader = GRAPH["jitattn.jit.loader"]
    assert "jitattn.jit.build" in loader and "jitattn.jit.record" in loader  # both imported inside functions


@pytest.mark.parametrize("folder", family_folders())
def test_a_family_is_one_folder_whose_spec_module_registers_its_classes(folder):
    classes = [cls for cls in registry.families().values() if cls.__module__ == f"jitattn.{folder}.spec"]
    assert classes, f"jitattn/{folder}/spec.py registers no spec class"
    for cls in classes:
        for template in cls.sources.values():
            assert template.startswith(f"{folder}/"), f"{cls.__name__} renders {template}, outside templates/{folder}/"
            assert (TEMPLATES / template).is_file(), template


def test_the_registry_finds_every_family_without_being_told():
    assert set(family_folders()) >= {"decode", "varlen"}
    families = registry.families()
    assert {"decode", "varlen"} <= set(families)
    assert {cls.__module__.split(".")[1] for cls in families.values()} == set(family_folders())


def test_an_unknown_family_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown kernel family 'nope'.*decode.*varlen"):
        registry.spec_from_dict({"family": "nope", "head_dim": 64})


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_opens_with_a_docstring_that_says_its_job(name):
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert doc and doc.splitlines()[0].strip(), f"{name} has no first docstring line"


def test_every_subpackage_ships_in_the_wheel():
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert packages <= listed, f"pyproject.toml [tool.setuptools] packages misses {sorted(packages - listed)}"
