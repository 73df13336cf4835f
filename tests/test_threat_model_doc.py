"""docs/threat-model.md backs each sentence with a named test: every test it names must exist."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_test_the_threat_model_names_exists():
    text = (REPO / "docs" / "threat-model.md").read_text()
    named = set(re.findall(r"`(test_\w+\.py)::(test_\w+)`", text))
    assert len(named) >= 20
    for path, name in sorted(named):
        tree = ast.parse((REPO / "tests" / path).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"docs/threat-model.md names {path}::{name}, which does not exist"
