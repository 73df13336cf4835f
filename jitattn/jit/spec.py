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


TENSOR_CORE_MIN_GROUP = 4  # GQA groups this large run on tensor cores by default (DecodeSpec.for_call)


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

    @classmethod
    def for_call(cls, head_dim: int, dtype_q: str, dtype_kv: str, pos_encoding: str, soft_cap: bool,
                 group_size: int, use_tensor_cores: bool = False) -> "DecodeSpec":
        """The specialization a call runs (single_decode_with_kv_cache and manifests' group_size
        both ask here).

        Tensor cores when asked for, and also with use_tensor_cores=False where they measured
        faster on the H200 (D128, cold L2):
        - GQA groups of TENSOR_CORE_MIN_GROUP or more: the CUDA-core kernel is compute-bound
          there (fp16 32/8 12.7 vs 13.9 us at 4k, 38.7 vs 45.2 at 32k; 32/4 24.6 vs 44.6 at
          32k), and with fp8 K/V even more so (widened in registers on tensor cores: 32/8
          26.4 vs 41.0 us at 32k, 76 vs 131 at 128k);
        - RoPE at any group size with fp16/bf16 K/V: the tensor-core kernel rotates K fragments
          in registers, where the CUDA-core one rotates every element on its own (32/32 at 32k
          137 vs 141 us, 32/8 44 vs 61).
        fp8 MHA stays on CUDA cores (32/32 at 32k: 68.8 vs 72.5 us). Never with a head_dim that
        is not a multiple of 32: the CUDA-core kernel runs (same results)."""
        fp8 = dtype_kv.startswith("float8")
        tensor_cores = head_dim % 32 == 0 and (use_tensor_cores or group_size >= TENSOR_CORE_MIN_GROUP
                                               or (pos_encoding == "ROPE_LLAMA" and not fp8))
        tile = cls.tensor_core_group_tile(group_size) if tensor_cores else cls.group_tile_for(group_size, dtype_kv)
        return cls(head_dim, dtype_q, dtype_kv, pos_encoding, soft_cap, tile, tensor_cores)

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
    4 warps) instead of the prefill one (the rows spread over the warps). `wgmma` (prefill,
    head_dim a multiple of 64, Hopper only: built for sm_90a) runs both GEMMs as warpgroup MMAs
    from shared memory, two warpgroups of 64 rows each. The tile fields
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
    wgmma: bool = False  # Hopper rung (last, so positional tiles keep their places)

    def __post_init__(self):
        if self.wgmma and not self.wgmma_fits(self.head_dim, self.decode):
            raise ValueError(f"wgmma varlen kernels are prefill-only with head_dim a multiple of 64 "
                             f"(got head_dim={self.head_dim}, decode={self.decode})")
        tile = self.default_tile(self.head_dim, self.decode, self.wgmma)
        for name, value in zip(("warps_m", "m_tiles", "block_n", "stages"), tile):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)

    @staticmethod
    def wgmma_fits(head_dim: int, decode: bool) -> bool:
        """Shapes the wgmma rung covers (the caller also needs an sm_90 GPU)."""
        return not decode and head_dim % 64 == 0

    def archs_for(self, archs: tuple[str, ...]) -> tuple[str, ...]:
        """wgmma exists on sm_90 only, and only in the arch-specific target: a '9.0' request
        builds sm_90a; other archs cannot run this spec."""
        if not self.wgmma:
            return super().archs_for(archs)
        hopper = sorted({a.rstrip("a") + "a" for a in archs if a.rstrip("a") == "9.0"})
        if not hopper:
            raise ValueError(f"{self.name} uses wgmma, which only sm_90 (9.0a) has; target archs: {list(archs)}")
        return tuple(hopper)

    @staticmethod
    def default_tile(head_dim: int, decode: bool, wgmma: bool = False) -> tuple[int, int, int, int]:
        """(warps_m, m_tiles, block_n, stages), from the tools/tune_varlen.py sweep on the H200:
        prefill bf16 8x4k, head_dim 64/128 best at 4 warps x 32 rows x 64 keys (D128: 32-key
        tiles within 3%, 8 warps x 16 rows 5-10% slower), 256 at 8 warps x 16 rows x 64 keys
        (+13% over 32 keys); paged decode best at 64 keys x 3 stages (4 stages leave one CTA per
        SM: -37%). The wgmma rung (two warpgroups of 64 rows) measured best at 64 keys x 3
        stages for D64 (2 CTAs per SM; 128 keys: -20%), and, with its producer warpgroup, 128
        keys x 3 stages for D128 (64 or 96 keys: -7 to -18%; 2 stages: -22%) and 48 keys x 3
        stages for D256 (64 or 80 keys fit only 2 stages: -20%)."""
        if wgmma:
            return {64: (8, 1, 64, 3), 128: (8, 1, 128, 3)}.get(head_dim, (8, 1, 48, 3))
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
                f"_{'decode' if self.decode else 'prefill'}{'_wgmma' if self.wgmma else ''}_{tile}")


FAMILIES: dict[str, type[KernelSpec]] = {cls.family: cls for cls in (DecodeSpec, VarlenSpec)}


def spec_from_dict(data: dict) -> KernelSpec:
    """Inverse of `KernelSpec.to_dict` (manifests, record files, CLI)."""
    data = dict(data)
    family = data.pop("family", None)
    if family == "decode":
        data.setdefault("dtype_kv", data.get("dtype_q", "float16"))
        if "group_size" in data:  # manifests may name the GQA group: the spec a call would run
            call = DecodeSpec.for_call(data.get("head_dim", 0), data.get("dtype_q", "float16"), data["dtype_kv"],
                                       data.get("pos_encoding", "NONE"), data.get("soft_cap", False),
                                       int(data.pop("group_size")), bool(data.get("tensor_cores", False)))
            data["group_tile"], data["tensor_cores"] = call.group_tile, call.tensor_cores
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
    cls = FAMILIES[family]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {family} spec fields {sorted(unknown)}; known: {sorted(names)}")
    return cls(**data)
