"""Code that reads as design (issue 44 item 3): no measured figures in the product's comments and
docstrings (they live in notes/*.md with a date and a command), and no tool or test that writes a
private attribute of a jitattn module (they use the public override, jitattn.varlen.plan.override_spec,
or a public hook such as jitattn.kernel.fresh_memos)."""
from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- (a) measured figures
FIGURE = re.compile(r"TFLOP/?s|TB/s|GB/s|\d(?:\.\d+)?\s*(?:µs|us|ms)\b", re.IGNORECASE)


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line of a Python file."""
    prose = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose.append((token.start[0], token.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                start = node.body[0].lineno
                prose += [(start + i, line) for i, line in enumerate(doc.splitlines())]
    return prose


C_COMMENT = re.compile(r"//.*|/\*.*?(?:\*/|$)|^\s*\*.*|\{#.*?(?:#\}|$)")


def template_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of the comment parts of a C++ / CUDA / Jinja line (// ..., /* ... */, {# ... #}),
    and of the lines inside a block comment."""
    prose, in_block = [], False
    for number, line in enumerate(source.splitlines(), 1):
        if in_block:
            prose.append((number, line))
            in_block = "*/" not in line and "#}" not in line
            continue
        for match in C_COMMENT.finditer(line):
            prose.append((number, match.group()))
            text = match.group()
            in_block = (text.startswith("/*") and "*/" not in text) or (text.startswith("{#") and "#}" not in text)
    return prose


def figures_in(path: Path) -> list[str]:
    source = path.read_text()
    prose = python_prose(source) if path.suffix == ".py" else template_prose(source)
    return [f"{path.relative_to(REPO)}:{line}: {text.strip()}" for line, text in prose if FIGURE.search(text)]


PRODUCT_FILES = sorted(p for folder in ("jitattn", "templates") for p in (REPO / folder).rglob("*")
                       if p.is_file() and p.suffix in (".py", ".j2", ".cuh", ".cu", ".h", ".cpp"))


@pytest.mark.parametrize("path", PRODUCT_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_comment_or_docstring_in_the_product_carries_a_measured_figure(path):
    """Figures go to notes/<file>.md with their date and command; code says why and points there."""
    found = figures_in(path)
    assert not found, "measured figures in code (move them to notes/, point there):\n" + "\n".join(found)


def test_the_figure_check_sees_comments_and_docstrings_and_not_code(tmp_path):
    py = tmp_path / "m.py"
    py.write_text('"""A module."""\nX = "12 ms"  # 450 TFLOP/s here\n\n\ndef f():\n    """Took 3.5 us."""\n'
                  '    return "4.4 TB/s"\n')
    assert [text for _, text in python_prose(py.read_text()) if FIGURE.search(text)] == \
        ["# 450 TFLOP/s here", "Took 3.5 us."]
    cu = "int x = 2; // 12.5 us on the H200\n/* a block\n   4.4 TB/s */\n{# 600 TFLOP/s #}\nint users = 3;\n"
    assert [n for n, text in template_prose(cu) if FIGURE.search(text)] == [1, 3, 4]


# ---------------------------------------------------------------- (b) private state written from outside
MUTATORS = {"clear", "update", "pop", "popitem", "setdefault", "append", "extend", "remove", "add", "discard",
            "insert"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_jitattn_module(dotted: str) -> bool:
    try:
        return dotted.split(".")[0] == "jitattn" and importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False


class PrivateWrites(ast.NodeVisitor):
    """Finds writes to a private attribute of a jitattn module: `mod._x = ...`, `mod._x[k] = ...`,
    `mod._x.clear()` (and the other mutators), `setattr(mod, "_x", ...)`, `monkeypatch.setattr(mod,
    "_x", ...)` or `monkeypatch.setattr("jitattn.mod._x", ...)`, `monkeypatch.setitem(mod._x, ...)`.
    `mod` is any name the file binds to a jitattn module by an import (anywhere in the file)."""

    def __init__(self, tree: ast.AST):
        self.modules: dict[str, str] = {}  # local name -> jitattn module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jitattn"):
                        self.modules[alias.asname or alias.name.split(".")[0]] = \
                            alias.name if alias.asname else alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jitattn") and not node.level:
                for alias in node.names:
                    if _is_jitattn_module(f"{node.module}.{alias.name}"):
                        self.modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        self.found: list[tuple[int, str]] = []

    def _module_of(self, node: ast.AST) -> str | None:
        """The jitattn module `node` (a name or a chain of attributes) denotes, if any."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.modules:
            return None
        dotted = ".".join([self.modules[node.id], *reversed(parts)])
        return dotted if _is_jitattn_module(dotted) else None

    def _private_attribute(self, node: ast.AST) -> str | None:
        """`mod._x` (or `mod._x[...]`) with mod a jitattn module: 'module._x'."""
        while isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and _private(node.attr):
            module = self._module_of(node.value)
            if module:
                return f"{module}.{node.attr}"
        return None

    def _flag(self, node: ast.AST, what: str | None) -> None:
        if what:
            self.found.append((node.lineno, what))

    def visit_Assign(self, node):
        for target in node.targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                self._flag(node, self._private_attribute(element))
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._flag(node, self._private_attribute(node.target))
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node):
        for target in node.targets:
            self._flag(node, self._private_attribute(target))
        self.generic_visit(node)

    def visit_Call(self, node):
        func, args = node.func, node.args
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in ("setattr", "delattr") and len(args) >= 2:
            if isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):  # monkeypatch's dotted form
                module, _, attr = args[0].value.rpartition(".")
                if _private(attr) and _is_jitattn_module(module):
                    self._flag(node, args[0].value)
            elif isinstance(args[1], ast.Constant) and isinstance(args[1].value, str) and _private(args[1].value):
                module = self._module_of(args[0])
                if module:
                    self._flag(node, f"{module}.{args[1].value}")
        elif name in ("setitem", "delitem") and args:
            self._flag(node, self._private_attribute(args[0]))
        elif name in MUTATORS and isinstance(func, ast.Attribute):
            self._flag(node, self._private_attribute(func.value))
        self.generic_visit(node)


def private_writes(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    walker = PrivateWrites(tree)
    walker.visit(tree)
    return walker.found


OUTSIDE_FILES = sorted(p for folder in ("tools", "tests") for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", OUTSIDE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_tool_or_test_writes_a_private_attribute_of_jitattn(path):
    """Benchmarks and tests force a variant through jitattn.varlen.plan.override_spec (or
    JITATTN_SPEC_OVERRIDES) and start from empty memos with jitattn.kernel.fresh_memos."""
    found = [f"{path.relative_to(REPO)}:{line}: writes {what}" for line, what in private_writes(path.read_text())]
    assert not found, "\n".join(found)


def test_the_private_write_check_finds_each_form():
    source = '''
import jitattn.varlen.forward as fwd
from jitattn.varlen import backward_launch, spec
from jitattn.jit import loader
import jitattn

def f(monkeypatch, mp):
    fwd._kernels = {}
    fwd._kernels[1] = 2
    backward_launch._kernels.clear()
    setattr(spec, "_hidden", 1)
    monkeypatch.setattr(loader, "_modules", {})
    mp.setattr("jitattn.jit.loader._modules", {})
    monkeypatch.setitem(fwd._kernels, 1, 2)
    jitattn.varlen.forward._kernels.update({})
    monkeypatch.setattr(fwd, "get_module", None)   # public: allowed
    monkeypatch.setattr(fwd, "__doc__", "")        # dunder: allowed
    other._kernels = {}                            # not a jitattn module
    x = fwd._kernels                               # a read
'''
    assert [line for line, _ in private_writes(source)] == [8, 9, 10, 11, 12, 13, 14, 15]
