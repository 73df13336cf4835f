"""Spec overrides: the one public way for benchmarks and tests to make calls run another variant.

`VarlenSpec.for_call` and `VarlenBackwardSpec.for_call` pick a call's kernel; an override forces
some of its fields on top of that choice (the rule then derives the rest from them: forcing
`tma=False` also drops the `split_kv` and `persistent` that need it). Two sources, applied in
this order, later ones winning:

- the JITATTN_SPEC_OVERRIDES knob (jitattn/jit/env.py), e.g.
  `varlen_backward:persistent=0;varlen:block_n=48,stages=4@head_dim=128,decode=1`;
- `override_spec(family, when=None, **fields)`, a context manager (innermost wins).

`when` (`@...` in the knob) limits an override to calls whose rule choice has those field
values. A forced spec is validated by the spec's constructor; an error names the override.
The per-call kernel memos key on `state()`, so switching overrides in one process takes effect.
Overrides are process-wide (every thread sees them): they are for benchmarks and tests.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from jitattn.jit import env

KNOB = "JITATTN_SPEC_OVERRIDES"
FAMILIES = ("varlen", "varlen_backward")

# (family, when, fields, source) per active override_spec block, outermost first; a tuple,
# replaced (never mutated) on entry and exit, so memo keys may hold it.
_active: tuple = ()


def state() -> tuple:
    """What the active overrides are (hashable): part of every per-call kernel memo key."""
    return _active, env.spec_overrides()


@contextlib.contextmanager
def override_spec(family: str, when: dict | None = None, **fields) -> Iterator[None]:
    """Within the block, calls of `family` ("varlen" or "varlen_backward") whose rule choice
    matches `when` (all calls if None) run the spec with `fields` forced, e.g.
    `with override_spec("varlen_backward", persistent=False): ...`."""
    global _active
    cls = _family(family, "override_spec")
    for name in {**(when or {}), **fields}:
        _field_type(cls, name, "override_spec")
    source = f"override_spec({family!r}, when={when!r}, {', '.join(f'{k}={v!r}' for k, v in fields.items())})"
    saved = _active
    _active = saved + ((family, tuple((when or {}).items()), tuple(fields.items()), source),)
    try:
        yield
    finally:
        _active = saved


def forced_fields(cls, chosen) -> tuple[dict, str]:
    """The fields the active overrides force on `chosen` (the rule's spec of family `cls`), and
    which overrides did (for errors); ({}, "") when none applies."""
    forced, sources = {}, []
    for family, when, fields, source in _entries():
        if family != cls.family:
            continue
        when = {name: _coerce(cls, name, value, source) for name, value in when}
        if all(getattr(chosen, name) == value for name, value in when.items()):
            forced.update({name: _coerce(cls, name, value, source) for name, value in fields})
            sources.append(source)
    return forced, " and ".join(sources)


def _entries() -> Iterator[tuple]:
    for family, when, fields in env.spec_overrides():
        _family(family, KNOB)
        yield family, when, fields, KNOB
    yield from _active


def _family(name: str, source: str):
    if name not in FAMILIES:
        raise ValueError(f"{source}: the family must be one of {FAMILIES}, got {name!r}")
    from jitattn.jit.registry import family

    return family(name)


def _field_type(cls, name: str, source: str) -> str:
    for field in dataclasses.fields(cls):
        if field.name == name:
            return str(field.type)
    known = sorted(f.name for f in dataclasses.fields(cls))
    raise ValueError(f"{source}: {cls.family} has no field {name!r}; its fields: {known}")


def _coerce(cls, name: str, value, source: str):
    """The knob's text as the field's type (bool, int, str); values given in Python pass as they are."""
    kind = _field_type(cls, name, source)
    if not isinstance(value, str) or kind == "str":
        return value
    text = value.strip().lower()
    if kind == "bool" and text in ("1", "true", "on", "yes", "0", "false", "off", "no"):
        return text in ("1", "true", "on", "yes")
    if kind == "int" and text.lstrip("-").isdigit():
        return int(text)
    raise ValueError(f"{source}: {cls.family} field {name} takes a {kind}, got {value!r}")
