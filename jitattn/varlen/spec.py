"""VarlenSpec: what a varlen_attn kernel is compiled for (head_dim, dtype, paging, tile shape, rung)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jitattn.jit.registry import register
from jitattn.jit.spec import DTYPE_TAGS, KernelSpec


@register
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

    @classmethod
    def prewarm_variants(cls, fields: dict, archs: tuple[str, ...]) -> list[dict]:
        """What varlen calls with these fields may run on `archs`: both paging modes and both
        tile shapes unless named (a call picks the shape from its batch); for prefill the wgmma
        rung where sm_90 is a target and the head_dim fits, and the mma.sync one where another
        arch is (or the shape does not fit, or no arch is known). `wgmma` named: as named."""
        hopper = any(a.rstrip("a") == "9.0" for a in archs)
        other = not archs or any(a.rstrip("a") != "9.0" for a in archs)
        variants = []
        for paged in [fields["paged"]] if "paged" in fields else [False, True]:
            for decode in [fields["decode"]] if "decode" in fields else [False, True]:
                if "wgmma" in fields:
                    rungs = [fields["wgmma"]]
                else:
                    fits = cls.wgmma_fits(fields.get("head_dim", 0), decode)
                    rungs = ([True] if fits and hopper else []) + ([False] if other or not fits else [])
                variants += [{**fields, "paged": paged, "decode": decode, "wgmma": w} for w in rungs]
        return variants

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
