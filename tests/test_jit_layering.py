"""The JIT core's layering (issue 44 item 3), checked on the source: the loader walks cache tiers
without knowing the fleet, no module reaches into another's private names, and jit/ knows no
kernel family."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jitattn"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every import in a file (names empty for `import x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def test_no_module_imports_or_reads_a_private_name_of_another_jitattn_module():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jitattn"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offences.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: imports {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("jitattn")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                offences.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offences, "\n".join(offences)


def test_the_loader_knows_tiers_not_the_fleet():
    imported = {module for module, _ in _imports(PACKAGE / "jit" / "loader.py")}
    names = {name for _, names in _imports(PACKAGE / "jit" / "loader.py") for name in names}
    assert "jitattn.jit.remote" not in imported and "remote" not in names
    assert "tiers" in names
    source = (PACKAGE / "jit" / "loader.py").read_text()
    assert "fleet" not in source.lower().replace("one build per fleet", "")


def test_the_jit_core_imports_no_kernel_family():
    for path in sorted((PACKAGE / "jit").rglob("*.py")):
        for module, _ in _imports(path):
            assert not module.startswith(("jitattn.decode", "jitattn.varlen")), f"{path} imports {module}"
