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
from jitattn.jit.spec import KernelSpec, show

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# The most specializations one entry's lists may expand to (a typo must not ask for millions).
MAX_EXPANSION = 4096


def expand(entry: dict) -> list[dict]:
    """One manifest entry -> the plain dicts of its cross product (a TypeError / ValueError for
    an entry that is not a table, an empty list, or a product over MAX_EXPANSION)."""
    if not isinstance(entry, dict):
        raise TypeError(f"a spec entry is a table of fields, got {show(entry)} ({type(entry).__name__})")
    names = list(entry)
    choices = [v if isinstance(v, list) else [v] for v in entry.values()]
    empty = [name for name, values in zip(names, choices) if not values]
    if empty:
        raise ValueError(f"spec fields {empty} list no values")
    count = 1
    for values in choices:
        count *= len(values)
        if count > MAX_EXPANSION:
            raise ValueError(f"a spec entry's lists expand to more than {MAX_EXPANSION} specializations")
    return [dict(zip(names, combo)) for combo in itertools.product(*choices)]


def read_manifest(path: Path) -> list[KernelSpec]:
    """The specs of a TOML manifest; a ValueError naming the file and the entry for anything
    else (unknown tables such as a `[[specs]]` typo, unknown fields, bad values)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read manifest {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"manifest {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"spec"})
    if unknown:
        raise ValueError(f"manifest {path}: unknown table(s) or key(s) {unknown}; a manifest lists "
                         f"specializations as [[spec]] tables")
    entries = data.get("spec", [])
    if not isinstance(entries, list):
        raise ValueError(f"manifest {path}: 'spec' must be an array of tables ([[spec]])")
    specs: list[KernelSpec] = []
    for i, entry in enumerate(entries):
        try:
            expanded = expand(entry)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"manifest {path}, spec #{i + 1}: {exc}") from None
        for fields in expanded:
            try:
                specs.append(spec_from_dict(fields))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"manifest {path}, spec #{i + 1} {show(fields)}: {exc}") from None
    return unique(specs)


def unique(specs) -> list[KernelSpec]:
    return list(dict.fromkeys(specs))
