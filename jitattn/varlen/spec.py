"""VarlenSpec and VarlenBackwardSpec: what a varlen_attn kernel and its backward are compiled
for (head_dim, dtype, paging, tile shape, rung), and `for_call`, the one rule that picks the spec
a call runs from the call's shape and device (prewarm lists what that rule can pick)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import ClassVar

from jitattn.jit.registry import register
from jitattn.jit.spec import DTYPE_TAGS, KernelSpec
from jitattn.varlen import overrides


def _wgmma_archs(name: str, archs: tuple[str, ...]) -> tuple[str, ...]:
    """The targets a wgmma (or TMA) kernel builds for: sm_90a for a '9.0' (or '9.0a') request; an error
    naming the spec when no target is sm_90 (both families' Hopper rungs)."""
    hopper = sorted({a.rstrip("a") + "a" for a in archs if a.rstrip("a") == "9.0"})
    if not hopper:
        raise ValueError(f"{name} uses wgmma or TMA, which only sm_90 (9.0a) has; target archs: {list(archs)}")
    return tuple(hopper)


# The tables the call rules read (VarlenSpec.for_call, VarlenBackwardSpec.for_call). Each says
# where a call takes a variant; the measurements behind it are in the note named.
# Paged D128 decode tiles copy K/V by TMA on sm_90: off, no gain measured
# (why: notes/paged-h200.md, "DECODE_TMA").
DECODE_TMA = False
# Prefill head dims whose wgmma kernel with the TMA producer runs persistent (a CTA per SM walks
# the row blocks; why: notes/forward-h200.md, "PERSISTENT_FORWARD_HEAD_DIMS").
PERSISTENT_FORWARD_HEAD_DIMS: frozenset[int] = frozenset({64, 128})
# CTAs per SM of a short call's (an encoder's sentences) head_dim 32 tile, whose one-tile CTAs
# wait on memory (why: notes/transformers-host.md, "SHORT_D32_MIN_BLOCKS").
SHORT_D32_MIN_BLOCKS = 3
# Backward head dims whose wgmma kernel has the producer warpgroup (TMA copies of Q / dO, a bulk
# dQ add at D64 / D128; why: notes/backward-h200.md, "PRODUCER_HEAD_DIMS").
PRODUCER_HEAD_DIMS: frozenset[int] = frozenset({64, 128, 256})
# Backward head dims whose producer kernel leaves dQ to a query-major kernel of its own
# (VarlenBackwardSpec.dq_kernel; why: notes/backward-d256.md, "Third step").
DQ_KERNEL_HEAD_DIMS: frozenset[int] = frozenset({256})
# Backward head dims whose producer kernel runs persistent (a CTA per SM takes key tiles from a
# counter) outside deterministic mode, where it measured slower (why: notes/backward-h200.md,
# "PERSISTENT_HEAD_DIMS").
PERSISTENT_HEAD_DIMS: frozenset[int] = frozenset({128})
# Backward head dims whose producer kernel takes 80 query rows a step on full calls (no window,
# no mask_mod, no soft cap): FlashAttention-3's non-causal hdim-128 tile, dQ computed transposed
# (dQ^T = K^T dS^T: wgmma's M is 64, so 80 rows cannot be dQ's M), a CTA per key tile (the
# persistent kernel's staging does not fit beside it). On at 128: the whole GPU backward suite
# passes on it, and full calls' backward ran 2.4% faster than the persistent 64-row kernel's
# (bf16 8 x 4096, H100; notes/backward-h200.md, fifteenth session). Read at plan time, so tests
# and benchmarks can turn it off. TILE80_FITS: the head dims the template builds it at.
TILE80_HEAD_DIMS: frozenset[int] = frozenset({128})
TILE80_FITS: frozenset[int] = frozenset({128})
# What a backward call adds to a full one (VarlenBackwardSpec.for_call's `features`), and which of
# those the 80-row tile also takes (a call takes it when every feature it has is listed). A
# score_mod counts as "affine_score_mod" when its bias is linear along the keys (relative position,
# ALiBi: render.kv_affine), else as "score_mod". The template builds every one of them at 80 rows
# (the soft cap's variant it does not). Listed: what measured faster there, with the GPU suite
# passing on every feature at 80 rows: full calls with an affine score_mod, which gain as a plain
# full call does. Not listed: a window, other score_mods (a bias table, a soft cap written as one)
# and mask_mods, which measured slower there or went both ways (sparse masks lose, as windows do):
# notes/variants-h100.md, seventeenth session. JITATTN_TEST_BACKWARD_ROWS80=all runs the GPU suite
# with all of them.
CALL_FEATURES: tuple[str, ...] = ("window", "score_mod", "affine_score_mod", "mask_mod")
TILE80_FEATURES: frozenset[str] = frozenset({"affine_score_mod"})
# The wgmma backward computes P^T of a score_mod whose slope is 1 but that is not KV_AFFINE (a bias
# table: score + bias[h, q_idx - kv_idx]) while dP^T's GEMM runs, as without a hook, instead of
# with dS^T after both GEMMs (templates/varlen/backward_wgmma.cuh). A template parameter (in the
# keys through the parameters' digest). Faster on every kernel it changes, its GPU tests passing on
# each (notes/variants-h100.md, seventeenth and nineteenth sessions).
# JITATTN_TEST_BACKWARD_EARLY_PROBS=0 runs the GPU suite without it, bench_variants.py --no-early-probs
# times the backward without it.
EARLY_UNIT_SLOPE_PROBS: bool = True


@functools.lru_cache(maxsize=256)
def _variant(text: str, kind: str):
    """The Variant of a spec field's canonical text (jitattn/variants validates it: a ValueError
    naming what is wrong), parsed once per text."""
    from jitattn.variants import parse_tree

    return parse_tree(text, kind)


def _parse_score_mod(text: str):
    return _variant(text, "score_mod")


def _parse_mask_mod(text: str):
    return _variant(text, "mask_mod")


# The spec fields of a user's variant: a traced score_mod / mask_mod as its canonical text
# (jitattn/variants), '' for none. Both families take them; the kernels' hooks render from them.
VARIANT_PARSERS = {"score_mod": _parse_score_mod, "mask_mod": _parse_mask_mod}


def _call_features(features, fixed: dict) -> set[str]:
    """A backward call's features (CALL_FEATURES) with its variants' fields counted: a score_mod
    as "affine_score_mod" where its bias is linear along the keys (render.kv_affine), else as
    "score_mod"; a mask_mod as "mask_mod"."""
    has = set(features)
    if fixed.get("score_mod"):
        from jitattn.variants import kv_affine

        affine = kv_affine(_variant(fixed["score_mod"], "score_mod")) is not None
        has = (has - {"score_mod", "affine_score_mod"}) | {"affine_score_mod" if affine else "score_mod"}
    if fixed.get("mask_mod"):
        has.add("mask_mod")
    return has


def _variant_params(spec) -> dict:
    """The template parameters of a spec's variants (hooks.cuh): the C++ jitattn's renderer wrote
    from each validated tree, and the captured tensors (the score_mod's slots first)."""
    if not spec.score_mod and not spec.mask_mod:
        return {"score_mod_source": "", "mask_mod_source": "", "score_mod_captures": 0, "num_captures": 0,
                "mask_map": False, "mask_map_per_head": False}
    from jitattn.variants import mask_map_needs, render_mask_mod, render_score_mod

    score = _variant(spec.score_mod, "score_mod") if spec.score_mod else None
    mask = _variant(spec.mask_mod, "mask_mod") if spec.mask_mod else None
    score_captures = len(score.captures) if score else 0
    mask_map, per_head = mask_map_needs(mask) if mask else (False, False)
    return {"mask_map": mask_map, "mask_map_per_head": per_head,
            "score_mod_source": render_score_mod(score) if score else "",
            "mask_mod_source": render_mask_mod(mask) if mask else "",
            "score_mod_captures": score_captures,
            "num_captures": score_captures + (len(mask.captures) if mask else 0)}


# A mask map (templates/varlen/mask_map.cuh) costs a launch and one mask evaluation per pair; it
# pays where a work unit has tiles to skip: from this many tiles on the side its units scan (the
# forward's key tiles, the backward's query tiles). Shorter calls (padded sentences, prompts of a
# few hundred tokens) classify by interval analysis alone, as do calls whose map would pass
# MASK_MAP_MAX_BYTES (16 bytes per work unit: a pack of very many sequences).
MASK_MAP_MIN_TILES = 4
MASK_MAP_MAX_BYTES = 64 << 20


def mask_map_layout(spec) -> tuple[bool, bool]:
    """(whether `spec`'s kernels were built with a mask map, whether its slots are per KV head):
    asked once per kernel the launchers keep, not per call."""
    params = spec.params()
    return bool(params["mask_map"]), bool(params["mask_map_per_head"])


def mask_map_flag(layout: tuple[bool, bool], scanned: int, tile: int, units: int, heads_kv: int) -> tuple:
    """The bindings' build_mask_map argument for one call of kernels with `layout`
    (mask_map_layout): () when they were built without a mask map, else (whether to build it):
    `scanned` positions on the side a unit scans in tiles of `tile`, `units` work units per KV head
    (or for all heads)."""
    takes, per_head = layout
    if not takes:
        return ()
    size = 16 * units * (heads_kv if per_head else 1)
    return (scanned > MASK_MAP_MIN_TILES * tile and size <= MASK_MAP_MAX_BYTES,)


def _variant_tag(spec) -> str:
    """The spec name's part for its variants: a digest of each tree's canonical text."""
    tag = ""
    for prefix, text in (("sm", spec.score_mod), ("mm", spec.mask_mod)):
        if text:
            tag += f"_{prefix}{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return tag


def _check_variants(spec) -> None:
    """The soft cap is a score hook of its own: a spec takes it or a score_mod, not both (a
    score_mod writes the cap itself: cap * tanh(score / cap))."""
    if spec.soft_cap and spec.score_mod:
        raise ValueError(f"{spec.family} spec: soft_cap=True and a score_mod both take the score hook; "
                         "write the cap in the score_mod")
    if spec.exact_soft_cap and not spec.soft_cap:
        raise ValueError(f"{spec.family} spec: exact_soft_cap=True picks the soft cap's tanh: set soft_cap=True")
    if spec.poly_tanh and (not spec.soft_cap or spec.exact_soft_cap):
        raise ValueError(f"{spec.family} spec: poly_tanh=True picks the soft cap's tanh (an alternative to the "
                         "exact one): set soft_cap=True and exact_soft_cap=False")


def _archs_facts(archs: tuple[str, ...]) -> list[bool]:
    """The values `hopper` (the call runs on sm_90) takes for calls on target `archs`: True where
    sm_90 is a target, False where another arch is or none is known."""
    hopper = any(a.rstrip("a") == "9.0" for a in archs)
    other = not archs or any(a.rstrip("a") != "9.0" for a in archs)
    return [True] * hopper + [False] * other


def _fields_of(spec: KernelSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def _unique(variants: list[dict]) -> list[dict]:
    seen, out = set(), []
    for v in variants:
        key = tuple(sorted(v.items()))
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def _with_overrides(cls, chosen: KernelSpec, choose) -> KernelSpec:
    """`chosen`, or, where an override applies to it (jitattn/varlen/overrides.py), `choose(forced)`:
    the rule run again with the forced fields fixed; a spec the constructor rejects names the override."""
    forced, source = overrides.forced_fields(cls, chosen)
    if not forced:
        return chosen
    try:
        return choose(forced)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source} forces {forced} on {chosen.name}: {exc}") from exc


@register
@dataclass(frozen=True)
class VarlenSpec(KernelSpec):
    """varlen_attn: packed sequences (optionally a paged KV pool) on tensor cores.

    Windows, GQA ratio, page size, split count and lengths are runtime arguments; the code
    changes with the head_dim, the dtype, paging and the tile. `decode` is the shape for few
    query rows per KV head (16 rows, each tile's keys spread over the warps); `wgmma` the Hopper
    rung (prefill, head_dim a multiple of 64, built for sm_90a); `soft_cap` Gemma-2's logit cap.
    The tile fields default to 0, the tuned tile (`default_tile`), resolved on construction, so
    a spec names its exact tile. Which spec a call runs: `for_call`."""

    family: ClassVar[str] = "varlen"
    sources: ClassVar[dict[str, str]] = {
        "binding.cpp": "varlen/binding.cpp.j2",
        "kernels.cu": "varlen/kernels.cu.j2",
        # a mask_mod's map kernel, a unit of its own that compiles beside kernels.cu (empty without one)
        "mask_map.cu": "varlen/kernels.cu.j2",
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
    tma: bool = False       # K/V tiles by TMA: wgmma with the producer, or decode tiles (calls: for_call)
    split_kv: bool = False  # wgmma with the producer: K and V on their own mbarriers (calls: for_call)
    persistent: bool = False  # prefill, producer, TMA, plain GEMM order: a CTA per SM walks many row blocks
    score_mod: str = ""  # a user's score_mod: its traced tree's canonical text (jitattn/variants); '' none
    mask_mod: str = ""   # a user's mask_mod, likewise
    exact_soft_cap: bool = False  # soft cap by an exact tanh (exp2 + reciprocal), not the hardware's tanh.approx
    poly_exp2: int = 0  # of every 4 key columns of 8, how many take exp2 on the FMA pipe (softmax.cuh)
    min_blocks: int = 0  # CTAs per SM the launch bounds ask ptxas to fit; 0: the shape's rule (fwd_shape.cuh)
    poly_tanh: bool = False  # soft cap: tanh on the FMA pipe where |x| <= 1, the hardware's beyond (soft_cap.cuh)

    # Field rules (KernelSpec.validate_fields); a tile field's 0 means the tuned default.
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"dtype": ("float16", "bfloat16")}
    parsers: ClassVar[dict[str, object]] = VARIANT_PARSERS
    ranges: ClassVar[dict[str, tuple[int, int]]] = {
        "head_dim": (32, 256), "warps_m": (0, 16), "m_tiles": (0, 8), "block_n": (0, 256), "stages": (0, 8),
        "poly_exp2": (0, 4), "min_blocks": (0, 4)}
    rules: ClassVar[dict[str, str]] = {"head_dim": "a multiple of 16 in [32, 256]"}

    def __post_init__(self):
        self.validate_fields()
        _check_variants(self)
        if self.head_dim % 16:
            raise ValueError(f"varlen spec field head_dim must be a multiple of 16 in [32, 256], got {self.head_dim}")
        if self.block_n % 16 or self.stages == 1:
            raise ValueError(f"varlen tiles take block_n a multiple of 16 and stages >= 2 (0: the default), "
                             f"got block_n={self.block_n}, stages={self.stages}")
        if self.wgmma and not self.wgmma_fits(self.head_dim, self.decode):
            raise ValueError(f"wgmma varlen kernels are prefill-only with head_dim a multiple of 64 "
                             f"(got head_dim={self.head_dim}, decode={self.decode})")
        tile = self.default_tile(self.head_dim, self.decode, self.wgmma, self.tma, self.split_kv)
        for name, value in zip(("warps_m", "m_tiles", "block_n", "stages"), tile):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, value)
        if self.wgmma and not self.has_producer and self.stages < 3:  # fwd_shape.cuh's AHEAD = STAGES - 2
            raise ValueError(f"varlen wgmma tiles without the producer warpgroup copy STAGES - 2 tiles ahead: "
                             f"stages >= 3 (got stages={self.stages})")
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
        if self.min_blocks and self.has_producer:
            raise ValueError(f"varlen min_blocks={self.min_blocks} sets the launch's registers, within which the "
                             f"producer kernel's setmaxnreg split is sized: only kernels without the producer "
                             f"warpgroup take it (got {self.name})")
        for name in ("pingpong", "overlap", "split_kv") + (() if self.decode else ("tma",)):
            if getattr(self, name) and not self.has_producer:
                raise ValueError(f"varlen {name}=True schedules the wgmma rung's producer warpgroup, which head_dim "
                                 f">= 128 has, and head_dim 64 with tma=True (got head_dim={self.head_dim}, "
                                 f"wgmma={self.wgmma}, tma={self.tma})")

    @classmethod
    def for_call(cls, head_dim: int, dtype: str, paged: bool, soft_cap: bool, few_rows: bool, one_split: bool,
                 hopper: bool, wgmma_enabled: bool = True, short: bool = False, **chosen) -> "VarlenSpec":
        """The spec a call runs: the one rule from a call's facts to its kernel.

        few_rows: every KV head's query rows (max_q x the GQA group) fit one 16-row tile;
        one_split: num_splits=1, which keeps the prefill shape so a sequence's result never
        depends on the rest of the batch; hopper: the call runs on sm_90; wgmma_enabled:
        JITATTN_WGMMA; short: every KV head's query rows and every sequence's keys fit
        plan.SHORT_ROWS / SHORT_KEYS (an encoder's sentences). `chosen` fixes fields ahead of
        the rule (prewarm's named fields); the active overrides (jitattn/varlen/overrides.py)
        apply on top."""
        def choose(fixed: dict) -> "VarlenSpec":
            decode = fixed.get("decode", few_rows and not one_split)
            wgmma = fixed.get("wgmma", hopper and wgmma_enabled and cls.wgmma_fits(head_dim, decode))
            if "tma" in fixed:
                tma = fixed["tma"]
            elif decode:  # the paged D128 decode tile, where DECODE_TMA turns it on
                tma = DECODE_TMA and hopper and paged and head_dim == 128
            elif short and head_dim == 64 and not paged:
                # a CTA per one-tile sequence: the lockstep 128 x 64 tile, without the producer's
                # pipeline (2x on 68-token sentences: notes/transformers-host.md, "the short-call tile")
                tma = False
            else:  # paged producer shapes, packed keys at D64 / D128 and D256 (with split_kv)
                tma = wgmma and (paged or head_dim <= 128 or head_dim == 256)
            split_kv = fixed.get("split_kv", wgmma and tma and head_dim == 256)
            persistent = fixed.get("persistent", wgmma and tma and not decode
                                   and head_dim in PERSISTENT_FORWARD_HEAD_DIMS)
            min_blocks = fixed.get("min_blocks", SHORT_D32_MIN_BLOCKS if short and head_dim == 32 and not paged
                                   and not decode and not wgmma else 0)
            return cls(**{**fixed, "head_dim": head_dim, "dtype": dtype, "paged": paged, "soft_cap": soft_cap,
                          "decode": decode, "wgmma": wgmma, "tma": tma, "split_kv": split_kv,
                          "persistent": persistent, "min_blocks": min_blocks})

        # why (TMA, split_kv, persistent): notes/forward-h200.md, "VarlenSpec.takes_tma" and after
        return _with_overrides(cls, choose(chosen), lambda forced: choose({**forced, **chosen}))

    @classmethod
    def prewarm_variants(cls, fields: dict, archs: tuple[str, ...]) -> list[dict]:
        """Every spec a call with these fields may run on `archs`: `for_call` over the facts such
        calls can have (both paging modes unless named, decode and prefill shapes, sm_90 or not
        by `archs`, JITATTN_WGMMA as set now); named fields fix their values."""
        from jitattn.jit import env

        base = {k: v for k, v in fields.items() if k not in ("head_dim", "dtype", "paged", "soft_cap")}
        wgmma_enabled = env.wgmma_enabled()
        variants = []
        for paged in [fields["paged"]] if "paged" in fields else [False, True]:
            for few_rows, one_split in ((False, False), (True, False), (True, True)):
                for hopper in _archs_facts(archs):
                    for short in (False, True):
                        spec = cls.for_call(fields.get("head_dim", 0), fields.get("dtype", "float16"), paged,
                                            fields.get("soft_cap", False), few_rows, one_split, hopper, wgmma_enabled,
                                            short, **base)
                        variants.append(_fields_of(spec))
        return _unique(variants)

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
        """(warps_m, m_tiles, block_n, stages): the tile tools/tune_varlen.py and the schedule
        sweeps found best for the shape (why: notes/forward-h200.md, "VarlenSpec.default_tile";
        the decode tile: notes/paged-decode-h200.md, "Run 2")."""
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
        """Whether the wgmma rung hands K/V copies to a producer warpgroup (the template's
        PRODUCER): from head_dim 128, and at 64 with TMA. Only those shapes have the `pingpong` /
        `overlap` GEMM orders, which no call takes (why: notes/forward-h200.md,
        "VarlenSpec.has_producer")."""
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
        variants = _variant_params(self)
        # The decode tile (a few keys of few queries per CTA, every tile checked in the kernel)
        # takes no mask map: its extra launch per call would cost generation more than it saves.
        variants["mask_map"] = variants["mask_map"] and not self.decode
        return {**super().params(), "warps_n": self.warps_n, "has_producer": self.has_producer,
                "uses_tma": self.tma and (self.has_producer or self.decode), **variants}

    def to_dict(self) -> dict:
        return {"family": self.family, **super().params()}

    @property
    def name(self) -> str:
        tile = f"m{self.warps_m}x{self.m_tiles}n{self.block_n}s{self.stages}"
        tile += ("_pingpong" if self.pingpong else "") + ("_overlap" if self.overlap else "") + ("_tma" if self.tma else "")
        tile += ("_splitkv" if self.split_kv else "") + ("_persistent" if self.persistent else "")
        tile += f"_poly{self.poly_exp2}" if self.poly_exp2 else ""
        tile += f"_b{self.min_blocks}" if self.min_blocks else ""
        return (f"varlen_{DTYPE_TAGS[self.dtype]}_d{self.head_dim}{'_paged' if self.paged else ''}"
                f"_{'decode' if self.decode else 'prefill'}{'_wgmma' if self.wgmma else ''}"
                f"{'_cap' if self.soft_cap else ''}{'x' if self.exact_soft_cap else ''}{'p' if self.poly_tanh else ''}"
                f"{_variant_tag(self)}_{tile}")


# The register splits of the backward's producer variant: compute warpgroups' registers -> the
# producer warpgroup's. setmaxnreg only moves registers within the launch's pool, 168 a thread
# at 384 threads: 128 * producer + 256 * compute <= 64512 (32 / 240 waited forever on the H200).
CONSUMER_REGS = {224: 56, 240: 24}


@register
@dataclass(frozen=True)
class VarlenBackwardSpec(KernelSpec):
    """The backward of varlen_attn (packed KV): preprocess, main and postprocess kernels.

    Windows, GQA ratio, lengths, scale and deterministic mode are runtime arguments; the code
    changes with the head_dim, the dtype and the tile: `block_n` keys per CTA, `block_m` query
    rows per step of its walk, `warps_q` warps per 16-key group (2 split dK / dV's columns, which
    head_dim > 128 needs). The tile fields default to 0, the tuned tile (`default_tile`), resolved
    on construction. `wgmma` is the Hopper rung (sm_90a, FlashAttention-3's shape); `producer`
    adds a warpgroup that copies the query tiles by TMA and adds dQ in bulk; `dq_kernel` moves dQ
    into a query-major kernel of its own (templates/varlen/backward_dq.cuh); `persistent` walks
    many key tiles per CTA. Which spec a call runs: `for_call`."""

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
    score_mod: str = ""  # the forward's score_mod (its tree's canonical text): dS takes its derivative
    mask_mod: str = ""   # the forward's mask_mod
    exact_soft_cap: bool = False  # the forward's exact tanh (its P must match the forward's lse)
    poly_tanh: bool = False  # the forward's poly_tanh (tanh_split: the same value per logit)

    # Field rules (KernelSpec.validate_fields); a tile field's 0 means the tuned default.
    choices: ClassVar[dict[str, tuple[str, ...]]] = {"dtype": ("float16", "bfloat16")}
    parsers: ClassVar[dict[str, object]] = VARIANT_PARSERS
    ranges: ClassVar[dict[str, tuple[int, int]]] = {
        "head_dim": (32, 256), "block_n": (0, 256), "block_m": (0, 128), "warps_q": (0, 2), "consumer_regs": (0, 255)}
    rules: ClassVar[dict[str, str]] = {"head_dim": "a multiple of 16 in [32, 256]", "warps_q": "1 or 2 (0: the default)"}

    @classmethod
    def for_call(cls, head_dim: int, dtype: str, soft_cap: bool, deterministic: bool, hopper: bool,
                 wgmma_enabled: bool = True, features: frozenset[str] | None = None,
                 **chosen) -> "VarlenBackwardSpec":
        """The spec a backward call runs: the Hopper rung on sm_90 where it covers the head_dim
        and JITATTN_WGMMA allows it (with the producer, dq_kernel and persistent at their head
        dims, persistent never in deterministic mode), else mma.sync; the soft cap's variant when
        the forward had one. `features`: what the call adds to a full one (CALL_FEATURES; empty:
        a full call; None: not known, as for a call that may have any; a score_mod or mask_mod
        in `chosen` counts whether listed or not): 80 query rows a step at TILE80_HEAD_DIMS where
        TILE80_FEATURES lists every one of them and there is no soft cap.
        `chosen` and the overrides as for VarlenSpec.for_call."""
        if features is not None and not set(features) <= set(CALL_FEATURES):
            raise ValueError(f"varlen_backward features are some of {CALL_FEATURES}, got {sorted(features)}")

        def choose(fixed: dict) -> "VarlenBackwardSpec":
            wgmma = fixed.get("wgmma", hopper and wgmma_enabled and cls.wgmma_fits(head_dim))
            producer = fixed.get("producer", wgmma and head_dim in PRODUCER_HEAD_DIMS)
            dq_kernel = fixed.get("dq_kernel", producer and head_dim in DQ_KERNEL_HEAD_DIMS)
            has = None if features is None else _call_features(features, fixed)
            rows80 = (producer and has is not None and has <= TILE80_FEATURES and not soft_cap
                      and head_dim in TILE80_HEAD_DIMS and not fixed.get("persistent") and not fixed.get("dq_kernel"))
            block_m = fixed.get("block_m", 80 if rows80 else 0)
            persistent = fixed.get("persistent", producer and head_dim in PERSISTENT_HEAD_DIMS and not deterministic
                                   and block_m != 80)
            return cls(**{**fixed, "head_dim": head_dim, "dtype": dtype, "soft_cap": soft_cap, "wgmma": wgmma,
                          "producer": producer, "dq_kernel": dq_kernel, "persistent": persistent,
                          "block_m": block_m})

        return _with_overrides(cls, choose(chosen), lambda forced: choose({**forced, **chosen}))

    @classmethod
    def prewarm_variants(cls, fields: dict, archs: tuple[str, ...]) -> list[dict]:
        """Every spec a backward call with these fields may run on `archs`: `for_call` over both
        modes (deterministic or not), with a window or not (a variant in the fields counts as
        for_call says), and sm_90 or not by `archs`, JITATTN_WGMMA as set now; named fields fix their values."""
        from jitattn.jit import env

        base = {k: v for k, v in fields.items() if k not in ("head_dim", "dtype", "soft_cap")}
        wgmma_enabled = env.wgmma_enabled()
        return _unique([_fields_of(cls.for_call(fields.get("head_dim", 0), fields.get("dtype", "float16"),
                                                fields.get("soft_cap", False), deterministic, hopper, wgmma_enabled,
                                                window, **base))
                        for hopper in _archs_facts(archs) for deterministic in (False, True)
                        for window in (frozenset({"window"}), frozenset())])

    def __post_init__(self):
        self.validate_fields()
        _check_variants(self)
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
        rows80 = self.wgmma and self.block_m == 80
        if rows80 and not (self.producer and self.head_dim in TILE80_FITS and not self.persistent
                           and not self.dq_kernel and not self.soft_cap):
            raise ValueError(f"varlen_backward block_m=80 is the producer kernel's 80-row tile at head_dim "
                             f"{sorted(TILE80_FITS)}, a CTA per key tile, without a soft cap (got head_dim="
                             f"{self.head_dim}, producer={self.producer}, persistent={self.persistent}, "
                             f"soft_cap={self.soft_cap})")
        if self.wgmma and not rows80 and (self.block_n, self.block_m, self.warps_q) != want:
            raise ValueError(f"varlen_backward wgmma tile at head_dim {self.head_dim} is block_n={want[0]}, "
                             f"block_m={want[1]}, warps_q={want[2]} (got {self.block_n}, {self.block_m}, {self.warps_q})")
        if self.warps_q not in (1, 2):
            raise ValueError(f"varlen_backward warps_q must be 1 or 2, got {self.warps_q}")
        if self.warps_q == 1 and self.head_dim > 128:
            raise ValueError(f"varlen_backward warps_q=1 holds all of dK and dV per warp: head_dim <= 128 "
                             f"(got {self.head_dim}); use warps_q=2")
        if rows80:
            return
        if self.block_m not in (64, 128) or self.block_n % 16 or not 32 <= self.block_n <= 2 * self.block_m:
            raise ValueError(f"varlen_backward tile: block_m 64 or 128, block_n a multiple of 16 in "
                             f"[32, 2 * block_m] (got block_n={self.block_n}, block_m={self.block_m})")
        if (self.block_n // 16 * self.warps_q) % (self.block_m // 16):
            raise ValueError(f"varlen_backward tile: the {self.block_n // 16 * self.warps_q} warps must split "
                             f"into whole groups of block_m / 16 = {self.block_m // 16} (dQ)")

    @staticmethod
    def default_consumer_regs(head_dim: int) -> int:
        """The compute warpgroups' registers beside the producer (CONSUMER_REGS; the producer gets
        the rest): 240 at head_dim 128, where 224 made ptxas serialize every wgmma, 224 elsewhere
        (why: notes/backward-h200.md, "VarlenBackwardSpec.default_consumer_regs")."""
        return 240 if head_dim == 128 else 224

    @staticmethod
    def wgmma_fits(head_dim: int) -> bool:
        """Shapes the wgmma rung covers (the caller also needs an sm_90 GPU)."""
        return head_dim in (64, 128, 256)

    @staticmethod
    def default_tile(head_dim: int, wgmma: bool = False) -> tuple[int, int, int]:
        """(block_n, block_m, warps_q): 128 keys x 64 queries, one warp per 16 keys, up to head_dim
        128; above, 64 x 64 with two warps per key group (dK / dV split along head_dim to fit in
        registers). The same on both rungs (why: notes/backward-h200.md,
        "VarlenBackwardSpec.default_tile")."""
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
        dq_stages = 1 if self.block_m == 80 else 2  # 80 rows: one hand-off buffer fits
        dq = dq_stages * self.block_m * self.head_dim * 4 if self.producer and self.warps_q == 1 else 0
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
                f"{'x' if self.exact_soft_cap else ''}{'p' if self.poly_tanh else ''}{_variant_tag(self)}"
                f"_n{self.block_n}m{self.block_m}q{self.warps_q}")

    def params(self) -> dict:
        early = EARLY_UNIT_SLOPE_PROBS and bool(self.score_mod)  # only a score_mod's kernels change
        return {**super().params(), **_variant_params(self), "early_unit_slope_probs": early}

    def to_dict(self) -> dict:
        return {"family": self.family, **super().params()}
