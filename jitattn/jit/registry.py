"""The family registry: kernel family name -> its KernelSpec class, found without naming any family.

A family is a subpackage of `jitattn` with a `spec` module that decorates its spec classes with
`@register`. The JIT core never imports a family: the first lookup imports every
`jitattn.<package>.spec` it finds on disk, so adding a family is adding its folder. The spec
modules stay light (no torch), so the command line and manifests pay little for this.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from jitattn.jit.spec import KernelSpec, check_fields, show

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # jitattn/
_families: dict[str, type[KernelSpec]] = {}
_discovered = False
_lock = threading.Lock()


def register(cls: type[KernelSpec]) -> type[KernelSpec]:
    """Class decorator: make `cls` the spec class of `cls.family`."""
    if not cls.family:
        raise TypeError(f"{cls.__name__} has no family name")
    known = _families.get(cls.family)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise TypeError(f"kernel family {cls.family!r} is registered twice: {known.__qualname__} and {cls.__qualname__}")
    _families[cls.family] = cls
    return cls


@contextlib.contextmanager
def registered(cls: type[KernelSpec]) -> Iterator[type[KernelSpec]]:
    """Within the block `cls` is a registered family; after it, the registry is as it was (a test's
    or a tool's family that must not outlive it)."""
    previous = _families.get(cls.family)
    register(cls)
    try:
        yield cls
    finally:
        if previous is None:
            _families.pop(cls.family, None)
        else:
            _families[cls.family] = previous


def _discover() -> None:
    import importlib  # here, not at the top: a call's import path (spec modules) never pays for them
    import importlib.util
    import pkgutil

    global _discovered
    with _lock:
        if _discovered:
            return
        for info in pkgutil.iter_modules([str(_PACKAGE_DIR)]):
            if info.ispkg and info.name != "jit":
                name = f"jitattn.{info.name}.spec"
                if importlib.util.find_spec(name) is not None:
                    importlib.import_module(name)
        _discovered = True


def families() -> dict[str, type[KernelSpec]]:
    """Every registered family, by name."""
    _discover()
    return dict(_families)


def family(name: str) -> type[KernelSpec]:
    found = _families.get(name) if isinstance(name, str) else None
    found = found or (families().get(name) if isinstance(name, str) else None)
    if found is None:
        raise ValueError(f"unknown kernel family {show(name)}; known: {sorted(families())}")
    return found


def spec_from_dict(data: dict) -> KernelSpec:
    """Inverse of `KernelSpec.to_dict` (manifests, record files, CLI): the family names the class.
    Whatever `data` is, the outcome is a spec or a ValueError / TypeError that says what is wrong
    (manifests, `--spec` JSON and archive or fleet manifests are not trusted)."""
    data = dict(check_fields(data, "kernel"))
    if "family" not in data:
        raise ValueError(f"unknown kernel family None: a spec needs a 'family' field, one of {sorted(families())}")
    return family(data.pop("family")).from_fields(data)
