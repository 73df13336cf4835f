"""Templates -> CUDA/C++ source text, and the content digest of the templates a spec uses.

Jinja is imported only to render (a cold build): the warm path needs just `template_digest`,
which reads the template files and hashes their bytes.
"""
from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from jitattn.jit.spec import KernelSpec

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
# Matches {% include "x" %}, {% import "x" as y %}, {% from "x" import y %}.
_INCLUDE_RE = re.compile(r"""{%-?\s*(?:include|import|from)\s+["']([^"']+)["']""")


def templates_dir() -> Path:
    """Installed wheel: jitattn/templates; source checkout: <repo>/templates."""
    for candidate in (_PACKAGE_DIR / "templates", _PACKAGE_DIR.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"jitattn templates not found next to {_PACKAGE_DIR}")


@functools.lru_cache(maxsize=None)
def template_files(root: Path, entry_points: tuple[str, ...]) -> tuple[str, ...]:
    """Every template file reachable from the entry points through includes, sorted."""
    seen: set[str] = set()
    pending = list(entry_points)
    while pending:
        rel = pending.pop()
        if rel in seen:
            continue
        seen.add(rel)
        text = (root / rel).read_text()
        pending.extend(_INCLUDE_RE.findall(text))
    return tuple(sorted(seen))


@functools.lru_cache(maxsize=None)
def template_digest(root: Path, entry_points: tuple[str, ...]) -> str:
    """sha256 over (relative path, bytes) of each template file the entry points reach.

    Paths are relative to the templates root, so relocating an install changes nothing.
    """
    h = hashlib.sha256()
    for rel in template_files(root, entry_points):
        data = (root / rel).read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def spec_template_digest(spec: KernelSpec, root: Path | None = None) -> str:
    return template_digest(root or templates_dir(), tuple(sorted(spec.sources.values())))


@functools.lru_cache(maxsize=4)
def _environment(root: Path):
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(spec: KernelSpec, op_namespace: str, root: Path | None = None) -> dict[str, str]:
    """Render each of the spec's sources: output file name -> text. A template may give several
    outputs (translation units: `unit` is the output's name); one that renders empty is not built."""
    env = _environment(root or templates_dir())
    context = {**spec.params(), "spec_name": spec.name, "op_namespace": op_namespace}
    return {out: env.get_template(tpl).render(**context, unit=out) for out, tpl in spec.sources.items()}
