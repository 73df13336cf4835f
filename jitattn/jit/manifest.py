"""Prewarm manifests: TOML files listing the specializations a deployment needs (any family).

    [[spec]]
    family = "decode"
    head_dim = [64, 128]          # a list expands: the entry is the cross product of its lists
    dtype_q = "bfloat16"
    dtype_kv = "bfloat16"
    group_size = [1, 4, 8]        # decode: the GQA group (or group_tile directly)

Record mode writes the same format, one scalar entry per specialization.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

from jitattn.jit.registry import spec_from_dict
from jitattn.jit.spec import KernelSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def expand(entry: dict) -> list[dict]:
    """One manifest entry -> the plain dicts of its cross product."""
    names = list(entry)
    choices = [v if isinstance(v, list) else [v] for v in entry.values()]
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def read_manifest(path: Path) -> list[KernelSpec]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read manifest {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"manifest {path} is not valid TOML: {exc}") from None
    entries = data.get("spec", [])
    if not isinstance(entries, list):
        raise ValueError(f"manifest {path}: 'spec' must be an array of tables ([[spec]])")
    specs: list[KernelSpec] = []
    for i, entry in enumerate(entries):
        for fields in expand(entry):
            try:
                specs.append(spec_from_dict(fields))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"manifest {path}, spec #{i + 1} {fields}: {exc}") from None
    return unique(specs)


def unique(specs) -> list[KernelSpec]:
    return list(dict.fromkeys(specs))
