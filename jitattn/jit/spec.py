"""KernelSpec: the base of every family's specialization (every compile-time choice, nothing else).

A spec is a frozen dataclass. `name` is a readable slug that makes cache directories
self-explaining; the content key lives in `jitattn.jit.keys` because it also depends on the
build target (archs, toolchain). Families subclass it in their own folder and register the
subclass (`jitattn.jit.registry`); nothing here knows an attention kernel.
"""
from __future__ import annotations

import dataclasses
import re
import reprlib
from dataclasses import dataclass
from typing import ClassVar

# SAFE_NAME: what a spec name (so an entry directory, a log name, an op namespace) may be made
# of; cache.entry_path refuses any other name where it becomes a path.
from jitattn.jit.cache import SAFE_NAME

# Short dtype names used in spec names and templates.
DTYPE_TAGS = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# A target arch as the families take it: '9.0', '8.9', '9.0a'.
ARCH = re.compile(r"(\d{1,3})\.(\d{1,3})(a?)")
# The Python type each field annotation stands for (fields are data: ints, bools, enum strings).
_FIELD_TYPES = {"int": int, "bool": bool, "str": str}
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = 60


def show(value) -> str:
    """A short repr of a user's value for an error message (long or deep values cut)."""
    return _shown.repr(value)


def check_field(family: str, name: str, value, kind: type, accepted=None, rule: str | None = None):
    """`value` as spec field `name` of type `kind` (bool, int or str), or a TypeError / ValueError
    naming the field and what it accepts. `accepted`: an int's (lowest, highest), a str's values
    (both required: an unbounded int or a free string would reach the templates as code); `rule`
    says what an int field takes when that is more than its range ("a multiple of 16 in [32, 256]")."""
    if kind is bool:
        if type(value) is not bool:
            raise TypeError(f"{family} spec field {name} must be true or false (a bool), "
                            f"got {show(value)} ({type(value).__name__})")
        return value
    if accepted is None:
        raise TypeError(f"{family} spec field {name} declares no accepted values (ranges / choices)")
    if kind is int:
        rule = rule or f"in [{accepted[0]}, {accepted[1]}]"
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{family} spec field {name} must be an integer {rule}, "
                            f"got {show(value)} ({type(value).__name__})")
        value = int.__index__(value)
        if not accepted[0] <= value <= accepted[1]:
            raise ValueError(f"{family} spec field {name} must be {rule}, got {value}")
        return value
    words = ", ".join(accepted[:-1]) + " or " + accepted[-1] if len(accepted) > 1 else accepted[0]
    if type(value) is not str:
        raise TypeError(f"{family} spec field {name} must be {words} (a string), "
                        f"got {show(value)} ({type(value).__name__})")
    if value not in accepted:
        raise ValueError(f"{family} spec field {name} must be {words}, got {show(value)}")
    return value


class _Parsed:
    """A str field whose value is structured data in a canonical text form (a traced variant's
    expression tree), checked by the family's parser instead of a list of choices: the parser
    bounds and validates it, raising ValueError naming what is wrong. The empty string is the
    field's "none"."""

    def __init__(self, parse):
        self.parse = parse

    def check(self, family: str, name: str, value) -> None:
        if type(value) is not str:
            raise TypeError(f"{family} spec field {name} must be a string (a variant's canonical text, or '' for "
                            f"none), got {show(value)} ({type(value).__name__})")
        if value:
            try:
                self.parse(value)
            except ValueError as exc:
                raise ValueError(f"{family} spec field {name}: {exc}") from exc


_plans: dict[type, tuple] = {}


def _field_plan(cls: type) -> tuple:
    """(name, type, accepted, rule) of each field of spec class `cls`, worked out once."""
    plan = _plans.get(cls)
    if plan is None:
        rows = []
        for f in dataclasses.fields(cls):
            kind = _FIELD_TYPES.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
            if kind is None:
                raise TypeError(f"{cls.__name__}.{f.name}: spec fields are int, bool or str, not {f.type}")
            if kind is str and f.name in cls.parsers:
                kind = _Parsed(cls.parsers[f.name])
            accepted = (cls.ranges.get(f.name) if kind is int else cls.choices.get(f.name) if kind is str
                        else () if kind is bool else kind.parse)
            if accepted is None:
                raise TypeError(f"{cls.family} spec field {f.name} declares no accepted values (ranges / choices)")
            rows.append((f.name, kind, accepted, cls.rules.get(f.name)))
        plan = _plans[cls] = tuple(rows)
    return plan


def check_fields(data, family: str) -> dict:
    """`data` as spec fields: a dict of str keys, or a TypeError naming what it is instead."""
    if not isinstance(data, dict):
        raise TypeError(f"a {family} spec is a table of fields, got {show(data)} ({type(data).__name__})")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise TypeError(f"{family} spec field names are strings, got {show(bad)}")
    return data


@dataclass(frozen=True)
class KernelSpec:
    family: ClassVar[str] = ""
    # Templates rendered for this family: output file name -> template path under templates/.
    sources: ClassVar[dict[str, str]] = {}
    # Names `from_fields` takes besides the dataclass fields (shorthands the family resolves).
    shorthands: ClassVar[tuple[str, ...]] = ()
    # The declarative field rules `validate_fields` checks on construction, before a family's own
    # shape rules: every str field's accepted values, every int field's (lowest, highest).
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    ranges: ClassVar[dict[str, tuple[int, int]]] = {}
    rules: ClassVar[dict[str, str]] = {}  # an int field's rule in words, where it is more than its range
    # str fields holding structured data (a variant's tree) -> the parser that validates their text
    parsers: ClassVar[dict[str, object]] = {}
    # The oldest arch the family's kernels build for, and why (cp.async and mma.sync need sm_80).
    min_arch: ClassVar[tuple[int, int]] = (8, 0)
    min_arch_reason: ClassVar[str] = "its kernels use cp.async and bf16 mma.sync, which need sm_80 or newer"

    def __post_init__(self):
        self.validate_fields()

    def validate_fields(self) -> None:
        """Every field against its annotation (a bool is a bool; an int an int, not a bool) and the
        family's `choices` / `ranges`: a TypeError or ValueError naming the field and what it
        accepts. Families call this first in their own `__post_init__`: a spec's fields end up
        rendered into C++ and its name into paths, so nothing unchecked may get that far."""
        for name, kind, accepted, rule in _field_plan(type(self)):
            value = getattr(self, name)
            if isinstance(kind, _Parsed):
                kind.check(self.family, name, value)
                continue
            if type(value) is kind and (kind is bool or (accepted[0] <= value <= accepted[1] if kind is int
                                                         else value in accepted)):
                continue  # the common case, checked inline: specs are made on every cold call
            object.__setattr__(self, name, check_field(self.family, name, value, kind, accepted, rule))

    @property
    def name(self) -> str:
        raise NotImplementedError

    def archs_for(self, archs: tuple[str, ...]) -> tuple[str, ...]:
        """The archs to build this family for. Families that use no arch-specific instructions
        (wgmma, setmaxnreg) build plain sm_XY for an 'X.Ya' request: that code runs on the same
        GPUs, and one cache entry then serves both spellings."""
        self.check_archs(archs)
        return tuple(sorted({a.rstrip("a") for a in archs}, key=lambda a: (float(a), a)))

    def check_archs(self, archs: tuple[str, ...]) -> None:
        """Refuse (ValueError, before any compiler runs) an arch string that is not 'X.Y' / 'X.Ya'
        or an arch older than the family's `min_arch`, with the family's reason."""
        for arch in archs:
            match = ARCH.fullmatch(arch) if isinstance(arch, str) else None
            if match is None:
                raise ValueError(f"bad CUDA arch {show(arch)}: expected 'X.Y' or 'X.Ya', e.g. '9.0' or '9.0a'")
            if (int(match.group(1)), int(match.group(2))) < self.min_arch:
                raise ValueError(f"{self.family} cannot build for arch {arch}: {self.min_arch_reason} "
                                 f"(sm_{self.min_arch[0]}{self.min_arch[1]})")

    def params(self) -> dict:
        """The template parameters: every field, by name (plain JSON-able values)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict:
        return {"family": self.family, **self.params()}

    @classmethod
    def accepted_fields(cls) -> set[str]:
        """Every name `from_fields` takes (the command line maps its flags onto these)."""
        return {f.name for f in dataclasses.fields(cls)} | set(cls.shorthands)

    @classmethod
    def prewarm_variants(cls, fields: dict, archs: tuple[str, ...]) -> list[dict]:
        """The field sets a prewarm of `fields` (what a command line named; the rest default)
        builds for target `archs`: every spec a call with those fields may run. By default just
        `fields`; a family whose calls choose among kernels at run time lists them all."""
        return [dict(fields)]

    @classmethod
    def check_fields(cls, data) -> dict:
        """`data` if it is a dict of field names (a TypeError otherwise)."""
        return check_fields(data, cls.family)

    @classmethod
    def from_fields(cls, data: dict) -> "KernelSpec":
        """Inverse of `to_dict` without the family (manifests, record files, CLI). Families with
        shorthand fields (decode's `group_size`) override this to resolve them first."""
        cls.check_fields(data)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown {cls.family} spec fields {sorted(unknown)}; known: {sorted(cls.accepted_fields())}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{cls.family} spec needs the fields {missing}")
        return cls(**data)
