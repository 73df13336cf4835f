"""The content key of a specialization for a build target, and its named components.

The key hashes content, never mtimes or paths: the template sources the spec renders from
(every file reachable through includes, by relative path and bytes), the spec's fields, and a
digest of the parameters the templates read (`spec.params()`: the fields and what Python derives
from them, a variant's C++ that jitattn/variants/render.py writes among them), which together fix
the rendered source text exactly; the normalized compile flags; the sorted target archs; the
stable-ABI target; the cache schema; the nvcc release and host compiler version. `components()`
lists them so `jitattn explain` can say why two keys differ.
"""
from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

from jitattn.jit.render import spec_template_digest
from jitattn.jit.spec import KernelSpec

# Bump when the cache layout, manifest format or binding convention changes.
CACHE_SCHEMA = "v1"
# Oldest torch whose stable ABI the bindings target: one .so serves this torch and newer.
TORCH_ABI_TARGET = (2, 10)
TORCH_TARGET_VERSION_FLAG = "-DTORCH_TARGET_VERSION=0x%02x%02x000000000000" % TORCH_ABI_TARGET

# Flags we pass (torch adds its include paths and defines; those depend on paths, not content).
CXX_FLAGS = ("-O3", "-std=c++17", TORCH_TARGET_VERSION_FLAG)
CUDA_FLAGS = ("-O3", "-std=c++17", "--expt-relaxed-constexpr", TORCH_TARGET_VERSION_FLAG)

# The toolchain components: provenance of a build. Strict mode may accept an entry that
# differs only in these (it cannot build anyway, and the binary interface does not change).
TOOLCHAIN_COMPONENTS = ("nvcc", "host_cxx")


class _BuildTargetFields(NamedTuple):
    archs: tuple[str, ...]
    nvcc: str  # release, e.g. "13.0.88"
    host_cxx: str  # e.g. "gcc 12.2.0"


class BuildTarget(_BuildTargetFields):
    """What a build targets besides the spec. Archs are sorted and unique, so the order given
    never matters. (A NamedTuple, not a dataclass: this module is on the warm import path.)"""

    __slots__ = ()

    def __new__(cls, archs, nvcc, host_cxx):
        ordered = tuple(sorted(set(archs), key=lambda a: (float(a.rstrip("a")), a)))
        return super().__new__(cls, ordered, nvcc, host_cxx)

    def _replace(self, **changes):
        return BuildTarget(**{**self._asdict(), **changes})


def cuda_flags(archs: tuple[str, ...]) -> list[str]:
    from jitattn.jit.toolchain import gencode_flags

    return [*CUDA_FLAGS, *gencode_flags(archs)]


def params_digest(spec: KernelSpec) -> str:
    """sha256 of the parameters the spec's templates render from. The fields alone do not fix the
    source: a change to the Python that derives parameters from them (a variant's renderer, the
    derivative's simplifier) would otherwise load an entry built from the old code."""
    return hashlib.sha256(json.dumps(spec.params(), sort_keys=True).encode()).hexdigest()


def components(spec: KernelSpec, target: BuildTarget) -> dict:
    return {
        "schema": CACHE_SCHEMA,
        "abi": "torch-stable-%d.%d" % TORCH_ABI_TARGET,
        "archs": list(target.archs),
        "cxx_flags": list(CXX_FLAGS),
        "cuda_flags": cuda_flags(target.archs),
        "spec": spec.to_dict(),
        "templates": spec_template_digest(spec),
        "params": params_digest(spec),
        "nvcc": target.nvcc,
        "host_cxx": target.host_cxx,
    }


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def differing(ours: dict, theirs: dict) -> list[str]:
    return sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
