"""KernelSpec: every compile-time choice of one specialization, and nothing else.

A spec is a frozen dataclass. `name` is a readable slug that makes cache directories
self-explaining; the content key lives in `jitattn.jit.keys` because it also depends on the
build target (archs, toolchain).
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


@dataclass(frozen=True)
class DecodeSpec(KernelSpec):
    """single_decode_with_kv_cache: one query token per head, split-KV over the sequence."""

    family: ClassVar[str] = "decode"
    sources: ClassVar[dict[str, str]] = {
        "binding.cpp": "decode/binding.cpp.j2",
        "kernels.cu": "decode/kernels.cu.j2",
    }

    head_dim: int
    dtype_q: str = "float16"
    dtype_kv: str = "float16"
    pos_encoding: str = "NONE"  # NONE | ROPE_LLAMA | ALIBI
    soft_cap: bool = False
    group_tile: int = 1  # query heads of one GQA group handled per CTA (1..8; up to 16 with tensor cores)
    tensor_cores: bool = False  # mma.sync path: the group's query heads are the MMA's rows

    @staticmethod
    def group_tile_for(group_size: int, dtype_kv: str = "float16") -> int:
        """Query heads per CTA for a GQA group: the group rounded up to a power of two, at most 8
        (4 with fp8 KV, whose threads hold twice the elements); larger groups take several CTAs
        per KV head."""
        limit = 4 if dtype_kv.startswith("float8") else 8
        return min(limit, 1 << (group_size - 1).bit_length())

    @staticmethod
    def tensor_core_group_tile(group_size: int) -> int:
        """Query heads per CTA on the tensor-core path: up to the MMA's 16 rows."""
        return min(16, 1 << (group_size - 1).bit_length())

    @property
    def name(self) -> str:
        return (
            f"decode_{DTYPE_TAGS[self.dtype_q]}_kv{DTYPE_TAGS[self.dtype_kv]}_d{self.head_dim}"
            f"_pos{self.pos_encoding.lower().replace('_', '')}_cap{int(self.soft_cap)}"
            f"_g{self.group_tile}{'_tc' if self.tensor_cores else ''}"
        )


@dataclass(frozen=True)
class VarlenSpec(KernelSpec):
    """varlen_attn: packed sequences (optionally a paged KV pool) on tensor cores.

    Windows, GQA ratio, page size, split count and lengths are runtime arguments; what changes
    the code is the head_dim, the dtype, paging (how a key row is addressed) and the tile shape.
    `decode` picks the shape for few query rows per KV head (16 rows, each tile's keys spread over
    4 warps) instead of the prefill one (the rows spread over the warps). The tile fields
    (warps_m, m_tiles, block_n, stages) default to 0, which means the tuned shape for the head_dim
    (`default_tile`); they are resolved on construction, so a spec always names its exact tile."""

    family: ClassVar[str] = "varlen"
    sources: ClassVar[dict[str, str]] = {
        "binding.cpp": "varlen/binding.cpp.j2",
        "kernels.cu": "varlen/kernels.cu.j2",
    }

    head_dim: int
    dtype: str = "float16"
    paged: bool = False
    decode: bool = False
    warps_m: int = 0  # warps along the query rows (decode shapes: 1, and 4 warps along the keys)
    m_tiles: int = 0  # 16-row MMA tiles per warp
    block_n: int = 0  # keys per pipeline stage
    stages: int = 0   # cp.async pipeline depth

    def __post_init__(self):
        for name, value in zip(("warps_m", "m_tiles", "block_n", "stages"), self.default_tile(self.head_dim, self.decode)):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)

    @staticmethod
    def default_tile(head_dim: int, decode: bool) -> tuple[int, int, int, int]:
        """(warps_m, m_tiles, block_n, stages), from the tools/tune_varlen.py sweep on the H200:
        prefill bf16 8x4k, head_dim 64/128 best at 4 warps x 32 rows x 64 keys (D128: 32-key
        tiles within 3%, 8 warps x 16 rows 5-10% slower), 256 at 8 warps x 16 rows x 64 keys
        (+13% over 32 keys); paged decode best at 64 keys x 3 stages (4 stages leave one CTA per
        SM: -37%)."""
        if decode:
            return (1, 1, 64, 3 if head_dim <= 128 else 2)
        return (4, 2, 64, 2) if head_dim <= 128 else (8, 1, 64, 2)

    @property
    def warps_n(self) -> int:
        return 4 if self.decode else 1

    @property
    def block_m(self) -> int:
        return self.warps_m * self.m_tiles * 16

    def params(self) -> dict:
        return {**super().params(), "warps_n": self.warps_n}

    def to_dict(self) -> dict:
        return {"family": self.family, **super().params()}

    @property
    def name(self) -> str:
        tile = f"m{self.warps_m}x{self.m_tiles}n{self.block_n}s{self.stages}"
        return (f"varlen_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}{'_paged' if self.paged else ''}"
                f"_{'decode' if self.decode else 'prefill'}_{tile}")


FAMILIES: dict[str, type[KernelSpec]] = {cls.family: cls for cls in (DecodeSpec, VarlenSpec)}


def spec_from_dict(data: dict) -> KernelSpec:
    """Inverse of `KernelSpec.to_dict` (manifests, record files, CLI)."""
    data = dict(data)
    family = data.pop("family", None)
    if family == "decode":
        data.setdefault("dtype_kv", data.get("dtype_q", "float16"))
        if "group_size" in data:  # manifests may name the GQA group instead of the tile
            size = int(data.pop("group_size"))
            data["group_tile"] = (DecodeSpec.tensor_core_group_tile(size) if data.get("tensor_cores")
                                  else DecodeSpec.group_tile_for(size, data["dtype_kv"]))
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
    cls = FAMILIES[family]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {family} spec fields {sorted(unknown)}; known: {sorted(names)}")
    return cls(**data)
