"""KernelSpec: the base of every family's specialization (every compile-time choice, nothing else).

A spec is a frozen dataclass. `name` is a readable slug that makes cache directories
self-explaining; the content key lives in `jitattn.jit.keys` because it also depends on the
build target (archs, toolchain). Families subclass it in their own folder and register the
subclass (`jitattn.jit.registry`); nothing here knows an attention kernel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

# Short dtype names used in spec names and templates.
DTYPE_TAGS = {"float16": "f16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


@dataclass(frozen=True)
class KernelSpec:
    family: ClassVar[str] = ""
    # Templates rendered for this family: output file name -> template path under templates/.
    sources: ClassVar[dict[str, str]] = {}
    # Names `from_fields` takes besides the dataclass fields (shorthands the family resolves).
    shorthands: ClassVar[tuple[str, ...]] = ()

    @property
    def name(self) -> str:
        raise NotImplementedError

    def archs_for(self, archs: tuple[str, ...]) -> tuple[str, ...]:
        """The archs to build this family for. Families that use no arch-specific instructions
        (wgmma, setmaxnreg) build plain sm_XY for an 'X.Ya' request: that code runs on the same
        GPUs, and one cache entry then serves both spellings."""
        return tuple(sorted({a.rstrip("a") for a in archs}, key=lambda a: (float(a), a)))

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
    def from_fields(cls, data: dict) -> "KernelSpec":
        """Inverse of `to_dict` without the family (manifests, record files, CLI). Families with
        shorthand fields (decode's `group_size`) override this to resolve them first."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown {cls.family} spec fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**data)
