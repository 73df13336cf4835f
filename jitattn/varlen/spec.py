"""VarlenSpec and VarlenBackwardSpec: what a varlen_attn kernel and its backward are compiled for
(head_dim, dtype, paging, tile shape, rung)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jitattn.jit.registry import register
from jitattn.jit.spec import DTYPE_TAGS, KernelSpec


def _wgmma_archs(name: str, archs: tuple[str, ...]) -> tuple[str, ...]:
    """The targets a wgmma (or TMA) kernel builds for: sm_90a for a '9.0' (or '9.0a') request; an error
    naming the spec when no target is sm_90 (both families' Hopper rungs)."""
    hopper = sorted({a.rstrip("a") + "a" for a in archs if a.rstrip("a") == "9.0"})
    if not hopper:
        raise ValueError(f"{name} uses wgmma or TMA, which only sm_90 (9.0a) has; target archs: {list(archs)}")
    return tuple(hopper)


# Whether calls' paged D128 decode tiles copy K/V by TMA on sm_90 (VarlenSpec.takes_tma). Off:
# on the H200 (bf16 64 x 4k keys, 32/8 heads, page 16, notes/paged-h200.md) the 32 x 3 tile ran
# 265.8 us by TMA against 264.3 by cp.async (packed keys 260.0 against 245.1); the cp.async tile's
# page slots since took it to 243 us (notes/paged-decode-h200.md), TMA was not re-measured. Specs with
# tma=True on decode shapes still build and run (tools/bench_varlen.py --decode-tiles N,M,K,S,1).
DECODE_TMA = False

# Head dims whose wgmma backward (with the producer) computes dQ in a kernel of its own
# (VarlenBackwardSpec.dq_kernel): where backward_launch.plan takes it, and what prewarm builds.
DQ_KERNEL_HEAD_DIMS: frozenset[int] = frozenset({256})
# Head dims whose wgmma backward with the producer runs persistent (VarlenBackwardSpec.persistent:
# a CTA per SM takes key tiles from a counter) outside deterministic mode, which plans the kernel
# a CTA per key tile (the persistent one, run so, measured 1.08-1.14x slower there).
# Measured on the H200 (bf16 8 x 4k, tools/bwd_ab.py against a CTA per key tile in the same
# rounds, both orders, TFLOP/s): D128 full +0..+4%, causal +2..+5%; D64 -1..+2% full, -3..+3%
# causal, a wash, so D64 stays a CTA per key tile (notes/backward-h200.md).
PERSISTENT_HEAD_DIMS: frozenset[int] = frozenset({128})

# Head dims whose wgmma prefill with the TMA producer runs persistent (VarlenSpec.persistent: a
# CTA per SM walks the row blocks; VarlenSpec.takes_persistent). Measured on an H100 (bf16, D*H =
# 2048, tools/fwd_schedule.py, the default kernel and SDPA in the same interleaved rounds,
# TFLOP/s full / causal, notes/forward-h200.md): 32 x 1k D64 367 / 265 against 348 / 238, D128
# 537 / 374 against 507 / 341 (+5..+11%: a row block's start and end leave the critical path);
# 8 x 4k D64 494 / 428 against 501 / 412, D128 637 / 530 against 621 / 543 (-2..+4%, within the
# rounds' spread; the H200 had D128 +2.4% / +4.1%). D256 (split_kv, 2 stages of 80 keys) lost
# 15% at 8 x 4k and 29% at 32 x 1k (not yet understood: with 2 stages, the one that holds an
# item's O until its stores are done leaves a single stage to start the next item in). O by TMA
# stores since (PERSISTENT in templates/varlen/kernels.cu.j2): 32 x 1k D128 557 / 398 against
# 537 / 372 with the warps' own stores, D64 +0..2%, 8 x 4k level (H100, 3 alternating processes).
PERSISTENT_FORWARD_HEAD_DIMS: frozenset[int] = frozenset({64, 128})


@register
@dataclass(frozen=True)
class VarlenSpec(KernelSpec):
    """varlen_attn: packed sequences (optionally a paged KV pool) on tensor cores.

    Windows, GQA ratio, page size, split count and lengths are runtime arguments; what changes
    the code is the head_dim, the dtype, paging (how a key row is addressed) and the tile shape.
    `decode` picks the shape for few query rows per KV head (16 rows, each tile's keys spread over
    4 warps) instead of the prefill one (the rows spread over the warps). `wgmma` (prefill,
    head_dim a multiple of 64, Hopper only: built for sm_90a) runs both GEMMs as warpgroup MMAs
    from shared memory, two warpgroups of 64 rows each (three at D64 with TMA: default_tile). `soft_cap` adds the logit soft cap
    (Gemma-2's): logits cap * tanh(scale * q.k / cap), cap a runtime argument. The tile fields
    (warps_m, m_tiles, block_n, stages) default to 0, which means the tuned shape for the head_dim
    (`default_tile`); they are resolved on construction, so a spec always names its exact tile.
    `persistent` (the TMA producer tiles) launches one CTA per SM that walks the row blocks
    (templates/varlen/kernels.cu.j2, PERSISTENT); calls take it where `takes_persistent` says."""

    family: ClassVar[str] = "varlen"
    sources: ClassVar[dict[str, str]] = {
        "binding.cpp": "varlen/binding.cpp.j2",
        "kernels.cu": "varlen/kernels.cu.j2",
    }

    head_dim: int
    dtype: str = "float16"
    paged: bool = False
    decode: bool = False
    warps_m: int = 0  # warps along the query rows (decode shapes: 1, and block_n / 16 warps along the keys)
    m_tiles: int = 0  # 16-row MMA tiles per warp
    block_n: int = 0  # keys per pipeline stage
    stages: int = 0   # cp.async pipeline depth
    wgmma: bool = False  # Hopper rung (after the tiles, so positional tiles keep their places)
    soft_cap: bool = False  # logits cap * tanh(scale * s / cap); the cap is a runtime argument
    pingpong: bool = False  # wgmma with the producer: the warpgroups take turns on the GEMMs
    overlap: bool = False   # wgmma with the producer: softmax of S_j under O += P_{j-1} V_{j-1}
    tma: bool = False       # K/V tiles by TMA: wgmma with the producer, or decode tiles (calls take `takes_tma`)
    split_kv: bool = False  # wgmma with the producer: K and V on their own mbarriers (calls take `takes_split_kv`)
    persistent: bool = False  # prefill, producer, TMA, plain GEMM order: a CTA per SM walks many row blocks

    def __post_init__(self):
        if self.wgmma and not self.wgmma_fits(self.head_dim, self.decode):
            raise ValueError(f"wgmma varlen kernels are prefill-only with head_dim a multiple of 64 "
                             f"(got head_dim={self.head_dim}, decode={self.decode})")
        tile = self.default_tile(self.head_dim, self.decode, self.wgmma, self.tma, self.split_kv)
        for name, value in zip(("warps_m", "m_tiles", "block_n", "stages"), tile):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        if self.decode and (self.block_n % 16 or not 32 <= self.block_n <= 256):
            raise ValueError(f"varlen decode tiles give each warp 16 keys: block_n a multiple of 16 in [32, 256] "
                             f"(got {self.block_n})")
        # A decode tile's thread 0 copies rows 16 * block_n / head_dim apart: with tma it must hold
        # the page id of every 8th row (each box's first), so that step divides 8.
        step = 16 * self.block_n // self.head_dim
        if self.tma and self.decode and (16 * self.block_n % self.head_dim or step not in (1, 2, 4, 8)):
            raise ValueError(f"varlen decode tiles with tma=True copy rows 16 * block_n / head_dim apart per thread, "
                             f"which must divide 8 (got block_n={self.block_n}, head_dim={self.head_dim})")
        if self.pingpong and self.has_producer and self.warps_m != 8:
            raise ValueError(f"varlen pingpong=True takes turns between two compute warpgroups (warps_m=8, got "
                             f"{self.warps_m})")
        if self.split_kv and (self.pingpong or self.overlap):
            raise ValueError("varlen split_kv=True hands K and V back at fixed points of the plain GEMM order; "
                             "it does not combine with pingpong / overlap")
        # O of the warpgroups past the K stage's block_n // 64 goes into the V stage (block_n keys).
        staged_in_v = (self.warps_m // 4 - self.block_n // 64) * 64
        if self.persistent and not (self.has_producer and self.tma and not self.decode and staged_in_v <= self.block_n
                                    and not (self.pingpong or self.overlap)):
            raise ValueError("varlen persistent=True runs the prefill producer kernel with TMA and the plain GEMM "
                             "order, its output staged in the last key tile's K / V stage (block_n keys each): "
                             f"got {self.name}")
        for name in ("pingpong", "overlap", "split_kv") + (() if self.decode else ("tma",)):
            if getattr(self, name) and not self.has_producer:
                raise ValueError(f"varlen {name}=True schedules the wgmma rung's producer warpgroup, which head_dim "
                                 f">= 128 has, and head_dim 64 with tma=True (got head_dim={self.head_dim}, "
                                 f"wgmma={self.wgmma}, tma={self.tma})")

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
                for w in rungs:
                    variant = {**fields, "paged": paged, "decode": decode, "wgmma": w}
                    if "tma" not in fields and cls.takes_tma(fields.get("head_dim", 0), paged, decode, w, hopper):
                        variants.append(cls._with_schedule({**variant, "tma": True}))
                        if w or not other:  # a decode tile on another GPU copies by cp.async
                            continue
                    variants.append(cls._with_schedule(variant))
        return variants

    @classmethod
    def _with_schedule(cls, fields: dict) -> dict:
        """`fields` with the split_kv and persistent a call of that shape takes, unless named."""
        head_dim, tma = fields.get("head_dim", 0), fields.get("tma", False)
        if "split_kv" not in fields and cls.takes_split_kv(head_dim, fields["wgmma"], tma):
            fields = {**fields, "split_kv": True}
        if "persistent" not in fields and cls.takes_persistent(head_dim, fields["decode"], fields["wgmma"], tma):
            fields = {**fields, "persistent": True}
        return fields

    @staticmethod
    def takes_tma(head_dim: int, paged: bool, decode: bool, wgmma: bool, hopper: bool = True) -> bool:
        """Whether a call's kernel copies K/V by TMA (`tma`; `hopper`: the call runs on sm_90):
        the paged wgmma shapes with the producer warpgroup (has_producer), packed keys at D64 and
        D128, and, if DECODE_TMA (off: no gain measured), the paged D128 decode tile on sm_90. On the H200 (bf16 8 x 4k, D*H = 2048, full / causal
        TFLOP/s, pages a random permutation; one box per tile or page; notes/forward-tma.md):
        paged D128 page 16 went from 270 / 263 (cp.async) to 582 / 537, 0.95x / 1.01x of
        contiguous (bench_varlen.py --parts paged-prefill), page 256 to 580 / 505, D256 from
        298 / 277 to 508 / 487 (tools/fwd_tma.py). Packed keys with TMA measured 634 / 548 against
        573 / 531 at D128 (+11% / +3%) and 563 / 520 against 571 / 524 at D256 (-1%) in the same
        job, so packed D128 takes it too; packed D256 takes it with split_kv, which needs it to
        gain (takes_split_kv). At D64, TMA brings a producer warpgroup (one CTA per SM
        instead of the lockstep loop's two): packed keys +3-5% (see default_tile). Paged D64 takes
        the same kernel (its pages under 16 rows by the producer's cp.async), so paged and packed
        keys keep giving the same bits (one tile shape, one reduction order)."""
        if decode:
            return DECODE_TMA and hopper and paged and head_dim == 128
        if not wgmma or head_dim < 64:
            return False
        return paged or head_dim <= 128 or head_dim == 256

    @staticmethod
    def takes_split_kv(head_dim: int, wgmma: bool, tma: bool) -> bool:
        """Whether a call's kernel takes `split_kv` (and with it its tile): the D256 wgmma kernels by TMA,
        whose two pipelines let a stage's K come free a tile before its V, so 2 stages of 80 keys
        keep the copies ahead (FlashAttention-3's hdim256 tile). On the H200 (bf16 8 x 4k, 8
        heads, full / causal TFLOP/s, tools/fwd_schedule.py, interleaved rounds, same job): 606 /
        537 against 550 / 470 for the 48 x 3 cp.async kernel (535 / 475 by TMA, 510 / 465 for
        80 x 2 without split_kv; 64 x 2 with it 565 / 526); a second job 583 / 529 against 544 /
        483. D128 (128 x 3: 559 / 489 against 609 / 552; 128 x 2 and 160 x 2 also slower) and D64
        (128 x 4: 418 / 354 against 432 / 363) lose, so they keep one barrier a stage
        (notes/forward-h200.md)."""
        return wgmma and tma and head_dim == 256

    @staticmethod
    def takes_persistent(head_dim: int, decode: bool, wgmma: bool, tma: bool) -> bool:
        """Whether a call's kernel is the persistent one (`persistent`): the wgmma prefill with the
        TMA producer at PERSISTENT_FORWARD_HEAD_DIMS (D64, D128). Each row block's arithmetic is a
        CTA's of the other schedule, so outputs are the same bits either way."""
        return wgmma and tma and not decode and head_dim in PERSISTENT_FORWARD_HEAD_DIMS

    @staticmethod
    def wgmma_fits(head_dim: int, decode: bool) -> bool:
        """Shapes the wgmma rung covers (the caller also needs an sm_90 GPU)."""
        return not decode and head_dim % 64 == 0

    def archs_for(self, archs: tuple[str, ...]) -> tuple[str, ...]:
        """wgmma exists on sm_90 only, and only in the arch-specific target: a '9.0' request
        builds sm_90a; other archs cannot run this spec."""
        return _wgmma_archs(self.name, archs) if self.wgmma or self.tma else super().archs_for(archs)

    @staticmethod
    def default_tile(head_dim: int, decode: bool, wgmma: bool = False, tma: bool = False,
                     split_kv: bool = False) -> tuple[int, int, int, int]:
        """(warps_m, m_tiles, block_n, stages), from the tools/tune_varlen.py sweep on the H200:
        prefill bf16 8x4k, head_dim 64/128 best at 4 warps x 32 rows x 64 keys (D128: 32-key
        tiles within 3%, 8 warps x 16 rows 5-10% slower), 256 at 8 warps x 16 rows x 64 keys
        (+13% over 32 keys). Decode shapes (block_n / 16 warps, 16 keys each) at D128: 32 keys x
        3 stages (2 warps, 53 KB, 4 CTAs per SM), from tools/bench_varlen.py --decode-tiles (bf16
        64 x 4k, 32/8, page 16, cold L2, two runs): paged 262-264 us against 275-279 for 64 x 3
        (2 CTAs per SM), 387 for 32 x 6, 331-347 for 48 x 4 and 128 x 3; packed keys 240-245
        against 240-247. Other head dims keep 64 keys x 3 stages (2 at D256; 4 stages had left
        one CTA per SM: -37%), not re-measured. The wgmma rung (two warpgroups of 64 rows)
        measured best at 64 keys x 3 stages for D64 (2 CTAs per SM; 128 keys: -20%), and, with its producer warpgroup, 128
        keys x 3 stages for D128 (64 or 96 keys: -7 to -18%; 2 stages: -22%) and 48 keys x 3
        stages for D256 (64 or 80 keys fit only 2 stages: -20%). D64 with TMA (and so a producer):
        128 keys x 4 stages, 428-434 / 350-359 TFLOP/s full / causal against the lockstep loop's
        410-414 / 344 in the same job; 64 keys x 3-4: 364-375 / 315-327; 128 x 3: 411-415 /
        346-348; three compute warpgroups (192 rows, 160 registers) x 128 keys x 3: 442 / 339-344
        (2 stages: 288 / 251) (notes/forward-h200.md). Since taken: three compute warpgroups x 128
        keys x 4 stages (12 warps, 192 rows; registers 32 / 160), 458.5 / 387.7 against 418.0 /
        367.7 for two warpgroups in the same job (interleaved rounds, 456-460 / 385-392 against
        400-432 / 352-371), SDPA 459.8 / 441.1: K/V read once per 192 rows instead of 128. D128
        with 2 stages of wider tiles (144-192 keys, with or without overlap) lost 21-34%.
        D256 with split_kv: 80 keys x 2 stages
        (see takes_split_kv), the most 2 stages fit beside Q's 64 KB."""
        if wgmma:
            if head_dim == 64 and tma:
                return (12, 1, 128, 4)
            if head_dim == 256 and split_kv:
                return (8, 1, 80, 2)
            return {64: (8, 1, 64, 3), 128: (8, 1, 128, 3)}.get(head_dim, (8, 1, 48, 3))
        if decode:
            return (1, 1, 32, 3) if head_dim == 128 else (1, 1, 64, 3 if head_dim < 128 else 2)
        return (4, 2, 64, 2) if head_dim <= 128 else (8, 1, 64, 2)

    @property
    def has_producer(self) -> bool:
        """The wgmma rung hands K/V copies to a producer warpgroup from head_dim 128, and at 64 when
        they come by TMA (the template's PRODUCER). Only those shapes have `pingpong` / `overlap`: how the two compute warpgroups
        order their GEMMs (templates/varlen/kernels.cu.j2, PINGPONG and OVERLAP). Both default to
        off (the old kernel) and no call turns them on: on the H200 (bf16 8 x 4k, full / causal
        TFLOP/s, same run, tools/fwd_schedule.py) D128 603 / 495 without, 595 / 495 pingpong,
        592 / 496 overlap, 525 / 478 both; D256 573 / 516, 570 / 515, 567 / 505, 508 / 479 (see
        notes/forward-h200.md). Caveat on `overlap`: ptxas (CUDA 13.0) pulls the O += P V wait up
        above the softmax in every such build, so it runs the deferred order without the overlap;
        the ways found to keep the wait in place serialize every wgmma (SASS, notes/forward-h200.md,
        2026-12-05). A shape that gains from one would take it where the call's spec is made
        (jitattn/varlen/forward.py), as `wgmma` is."""
        return self.wgmma and (self.head_dim >= 128 or self.tma)

    @property
    def warps_n(self) -> int:
        """Warps along a tile's keys: decode shapes give each warp 16 keys of every tile."""
        return self.block_n // 16 if self.decode else 1

    @property
    def block_m(self) -> int:
        return self.warps_m * self.m_tiles * 16

    def params(self) -> dict:
        # Decisions the templates read rather than re-derive: the producer warpgroup, and TMA
        # (which __post_init__ allows only with the producer or on a decode tile).
        return {**super().params(), "warps_n": self.warps_n, "has_producer": self.has_producer,
                "uses_tma": self.tma and (self.has_producer or self.decode)}

    def to_dict(self) -> dict:
        return {"family": self.family, **super().params()}

    @property
    def name(self) -> str:
        tile = f"m{self.warps_m}x{self.m_tiles}n{self.block_n}s{self.stages}"
        tile += ("_pingpong" if self.pingpong else "") + ("_overlap" if self.overlap else "") + ("_tma" if self.tma else "")
        tile += ("_splitkv" if self.split_kv else "") + ("_persistent" if self.persistent else "")
        return (f"varlen_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}{'_paged' if self.paged else ''}"
                f"_{'decode' if self.decode else 'prefill'}{'_wgmma' if self.wgmma else ''}"
                f"{'_cap' if self.soft_cap else ''}_{tile}")


# The register splits of the backward's producer variant: compute warpgroups' registers -> the
# producer warpgroup's. setmaxnreg only moves registers within the launch's pool, 168 a thread
# at 384 threads: 128 * producer + 256 * compute <= 64512 (32 / 240 waited forever on the H200).
CONSUMER_REGS = {224: 56, 240: 24}


@register
@dataclass(frozen=True)
class VarlenBackwardSpec(KernelSpec):
    """The backward of varlen_attn (packed KV): preprocess, main and postprocess kernels.

    Windows, GQA ratio, lengths, scale and deterministic mode are runtime arguments; what
    changes the code is the head_dim, the dtype and the tile shape: `block_n` keys per CTA,
    `block_m` packed query rows per step of its walk, and `warps_q` (1 or 2) warps per 16-key
    group (2 splits the head_dim columns of dK / dV between them, which head_dim > 128 needs
    to keep its accumulators in registers). The tile fields default to 0, the tuned shape for
    the head_dim (`default_tile`), resolved on construction, so a spec always names its exact
    tile. `wgmma` is the Hopper rung (sm_90a: warpgroup MMAs, FlashAttention-3's shape): head_dim
    64 or 128, 128 keys x 64 queries on two warpgroups; 256: 64 keys x 64 queries, the two
    warpgroups splitting dK / dV along head_dim (warps_q=2); it builds for 9.0a only. `producer`
    (wgmma only) adds a third warpgroup that copies the query tiles by TMA and adds each tile's
    dQ with one bulk reduce-add, handing both over through mbarriers (FlashAttention-3's data
    movement; jitattn.varlen.backward_launch.PRODUCER_HEAD_DIMS, the default at 64, 128, 256;
    at 256 only the copies: the compute warpgroups add dQ themselves).
    `soft_cap`: the backward of the forward's logit soft cap (the cap a runtime argument).
    `dq_kernel` (wgmma with the producer, head_dim 256: DQ_KERNEL_HEAD_DIMS, where backward_launch
    plans it): dQ by a kernel of its own, one CTA per query tile summing dQ in registers over the
    key tiles (templates/varlen/backward_dq.cuh; no fp32 accumulator, no atomics, no
    postprocess), the main kernel computing dK / dV only (notes/backward-d256.md)."""

    family: ClassVar[str] = "varlen_backward"
    sources: ClassVar[dict[str, str]] = {
        "binding.cpp": "varlen/backward_binding.cpp.j2",
        "kernels.cu": "varlen/backward.cu.j2",
    }

    head_dim: int
    dtype: str = "float16"
    block_n: int = 0
    block_m: int = 0
    warps_q: int = 0
    wgmma: bool = False
    producer: bool = False
    soft_cap: bool = False  # the forward's logit soft cap: dS takes the slope 1 - tanh^2
    dq_kernel: bool = False  # dQ by its own query-major kernel, the main kernel dK / dV only
    consumer_regs: int = 0  # producer only: the compute warpgroups' registers (setmaxnreg); 0: the tuned split
    persistent: bool = False  # producer, head_dim <= 128: a CTA per SM walks many key tiles (not deterministic)

    @classmethod
    def prewarm_variants(cls, fields: dict, archs: tuple[str, ...]) -> list[dict]:
        """What backward calls with these fields may run on `archs` (as VarlenSpec's forward):
        the wgmma rung where sm_90 is a target and the head_dim fits (with the producer warpgroup
        unless `producer` is named, as backward_launch plans it), the mma.sync one where another
        arch is (or it does not fit, or no arch is known); `wgmma` named: as named."""
        def persistent(producer: bool) -> list[bool]:  # as backward_launch plans it unless named:
            if "persistent" in fields:                  # both where deterministic mode takes the other
                return [fields["persistent"]]
            return [True, False] if producer and fields.get("head_dim", 0) in PERSISTENT_HEAD_DIMS else [False]

        if "wgmma" in fields:
            return [{**fields, "persistent": p} for p in persistent(fields.get("producer", False))]
        hopper = any(a.rstrip("a") == "9.0" for a in archs)
        other = not archs or any(a.rstrip("a") != "9.0" for a in archs)
        fits = cls.wgmma_fits(fields.get("head_dim", 0))
        rungs = ([True] if fits and hopper else []) + ([False] if other or not fits else [])
        def hopper_variants() -> list[dict]:
            producer = fields.get("producer", True)
            dq = fields.get("dq_kernel", producer and fields.get("head_dim", 0) in DQ_KERNEL_HEAD_DIMS)
            return [{**fields, "wgmma": True, "producer": producer, "dq_kernel": dq, "persistent": p}
                    for p in persistent(producer)]

        return [v for w in rungs for v in (hopper_variants() if w else [{**fields, "wgmma": False}])]

    def __post_init__(self):
        if self.head_dim % 16 or not 32 <= self.head_dim <= 256:
            raise ValueError(f"varlen_backward head_dim must be a multiple of 16 in [32, 256], got {self.head_dim}")
        if self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"varlen_backward dtype must be float16 or bfloat16, got {self.dtype!r}")
        if self.producer and not self.wgmma:
            raise ValueError("varlen_backward producer=True is part of the wgmma rung: set wgmma=True")
        if self.dq_kernel and not (self.producer and self.head_dim in DQ_KERNEL_HEAD_DIMS):
            raise ValueError(f"varlen_backward dq_kernel=True is a variant of the wgmma rung with the producer at "
                             f"head_dim {sorted(DQ_KERNEL_HEAD_DIMS)} (got head_dim={self.head_dim}, "
                             f"wgmma={self.wgmma}, producer={self.producer})")
        if self.wgmma and not self.wgmma_fits(self.head_dim):
            raise ValueError(f"varlen_backward wgmma kernels cover head_dim 64, 128 and 256 (got {self.head_dim})")
        if self.consumer_regs == 0:
            object.__setattr__(self, "consumer_regs", self.default_consumer_regs(self.head_dim) if self.producer else 0)
        if self.producer and self.consumer_regs not in CONSUMER_REGS:
            raise ValueError(f"varlen_backward consumer_regs is one of {sorted(CONSUMER_REGS)} "
                             f"(got {self.consumer_regs})")
        if self.persistent and not (self.producer and self.head_dim <= 128):
            raise ValueError("varlen_backward persistent=True overlaps a key tile's epilogue with the next one's loads "
                             f"by the producer warpgroup: producer=True and head_dim <= 128 (got producer="
                             f"{self.producer}, head_dim={self.head_dim})")
        if not self.producer and self.consumer_regs:
            raise ValueError("varlen_backward consumer_regs splits the registers with the producer warpgroup: "
                             "set producer=True")
        tile = self.default_tile(self.head_dim, self.wgmma)
        for name, value in zip(("block_n", "block_m", "warps_q"), tile):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        want = self.default_tile(self.head_dim, True)
        if self.wgmma and (self.block_n, self.block_m, self.warps_q) != want:
            raise ValueError(f"varlen_backward wgmma tile at head_dim {self.head_dim} is block_n={want[0]}, "
                             f"block_m={want[1]}, warps_q={want[2]} (got {self.block_n}, {self.block_m}, {self.warps_q})")
        if self.warps_q not in (1, 2):
            raise ValueError(f"varlen_backward warps_q must be 1 or 2, got {self.warps_q}")
        if self.warps_q == 1 and self.head_dim > 128:
            raise ValueError(f"varlen_backward warps_q=1 holds all of dK and dV per warp: head_dim <= 128 "
                             f"(got {self.head_dim}); use warps_q=2")
        if self.block_m not in (64, 128) or self.block_n % 16 or not 32 <= self.block_n <= 2 * self.block_m:
            raise ValueError(f"varlen_backward tile: block_m 64 or 128, block_n a multiple of 16 in "
                             f"[32, 2 * block_m] (got block_n={self.block_n}, block_m={self.block_m})")
        if (self.block_n // 16 * self.warps_q) % (self.block_m // 16):
            raise ValueError(f"varlen_backward tile: the {self.block_n // 16 * self.warps_q} warps must split "
                             f"into whole groups of block_m / 16 = {self.block_m // 16} (dQ)")

    @staticmethod
    def default_consumer_regs(head_dim: int) -> int:
        """The compute warpgroups' registers with the producer warpgroup (CONSUMER_REGS: the
        producer's are what is left): 240 at head_dim 128, 224 elsewhere. At D128 with 224 ptxas
        serializes every wgmma (advisory C7512, a WARPGROUP.DEPBAR after each of the 32 HGMMAs of a
        step; ncu on the H200: 48% of the compute warps' stall samples on those waits); at 240 it
        issues them back to back (4 waits a step) and the producer, left 24, spills 92 bytes. On
        the H200 (bf16 8 x 4k, 32 heads, tools/bwd_ab.py, 3 interleaved rounds, same job): 473.8 /
        432.0 TFLOP/s full / causal against 440.8 / 379.2 at 224 (SDPA 493.1 / 441.4). D64 at 224
        keeps its wgmmas pipelined (4 waits) and was not timed at 240 (notes/backward-h200.md)."""
        return 240 if head_dim == 128 else 224

    @staticmethod
    def wgmma_fits(head_dim: int) -> bool:
        """Shapes the wgmma rung covers (the caller also needs an sm_90 GPU)."""
        return head_dim in (64, 128, 256)

    @staticmethod
    def default_tile(head_dim: int, wgmma: bool = False) -> tuple[int, int, int]:
        """(block_n, block_m, warps_q). mma.sync: 128 keys x 64 queries on 8 warps up to
        head_dim 128 (each warp 16 keys with all of dK / dV in registers), 64 x 64 on 8 warps
        (two per key group) above. On the H200 (bf16 8 x 4k, full / causal TFLOP/s): D64 165 /
        153 against 141 / 138 for 64 x 64 on 4 warps and 148 / 140 for 128 x 64 with two warps
        per key group; D128 190 / 180 against 117 / 114 (64 x 64, 4 warps) and 128 / 123
        (64 x 64, 8 warps). wgmma: 128 keys (two warpgroups of 64) x 64 queries: D64 207 / 192,
        D128 261 / 236; with the producer D64 388 / 332, D128 431 / 370 (128 queries a step at D64,
        FlashAttention-3's hdim64 tile, measured 372 / 316 against 391 / 323: notes/backward-h200.md).
        wgmma at D256: 64 keys x 64 queries, warps_q=2 (the warpgroups split dK / dV along
        head_dim: 128 keys would need 256 accumulator registers a thread), with the producer 259 /
        240 against 114 / 114 on mma.sync (notes/backward-d256.md; bound by the L2's dQ reductions);
        with dQ in its own kernel (dq_kernel) 391 / 353."""
        if wgmma:  # head_dim 256: 64 keys, the two warpgroups split dK / dV along head_dim (warps_q=2)
            return (128, 64, 1) if head_dim <= 128 else (64, 64, 2)
        return (128, 64, 1) if head_dim <= 128 else (64, 64, 2)

    def archs_for(self, archs: tuple[str, ...]) -> tuple[str, ...]:
        """wgmma exists on sm_90 only, and only in the arch-specific target: a '9.0' request
        builds sm_90a; other archs cannot run this spec. mma.sync builds plain archs."""
        return _wgmma_archs(self.name, archs) if self.wgmma else super().archs_for(archs)

    @property
    def warps(self) -> int:
        return self.block_n // 16 * self.warps_q

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main kernel (keep in sync with backward_mma.cuh and
        backward_wgmma.cuh)."""
        row_chunks = -(-self.head_dim // 64) * 8
        kv = self.block_n * row_chunks
        qt = self.block_m * row_chunks
        ds = self.block_n * self.block_m // 8
        if self.wgmma:  # dS^T stages (2 with the producer at warps_q=1 or dq_kernel), with P^T beside it at warps_q=2
            p_tile = (2 if self.producer and (self.warps_q == 1 or self.dq_kernel) else 1) * self.warps_q
        else:
            p_tile = 2 if self.warps_q == 2 else 1
        # two dQ hand-off buffers (the producer's bulk add); at warps_q=2 the compute warps add,
        # through a scratch of 8 rows x head_dim / 4 floats a warp (DQ_SCRATCH)
        dq = 2 * self.block_m * self.head_dim * 4 if self.producer and self.warps_q == 1 else 0
        if self.wgmma and self.warps_q == 2 and not self.dq_kernel:
            dq = self.warps * 8 * self.head_dim // 4 * 4
        return (2 * kv + 4 * qt + p_tile * ds) * 16 + 4 * self.block_m * 4 + dq + (1024 if self.wgmma else 0)

    @property
    def name(self) -> str:
        rung = "_wgmma_producer" if self.producer else "_wgmma" if self.wgmma else ""
        rung += "_dqkernel" if self.dq_kernel else ""
        rung += "_persistent" if self.persistent else ""
        if self.producer and self.consumer_regs != 224:
            rung += f"_r{self.consumer_regs}"
        return (f"varlen_backward_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}{rung}{'_cap' if self.soft_cap else ''}"
                f"_n{self.block_n}m{self.block_m}q{self.warps_q}")
