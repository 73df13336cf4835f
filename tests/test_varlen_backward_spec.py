"""CPU tests of the varlen backward family's spec: names, content keys, rendering of every head_dim
and tile, the shapes it refuses, the archs it builds for, the manifests that list it (no compiles;
tests/test_compile.py builds it for real)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from jitattn.jit import keys, render
from jitattn.jit.manifest import read_manifest
from jitattn.jit.registry import spec_from_dict
from jitattn.varlen import spec as spec_module
from jitattn.varlen.spec import CONSUMER_REGS, DQ_KERNEL_HEAD_DIMS, PERSISTENT_HEAD_DIMS, VarlenBackwardSpec, VarlenSpec

REPO = Path(__file__).resolve().parent.parent
TARGET = keys.BuildTarget(("9.0",), "13.0.88", "gcc 12.2.0")
JINJA_LEFTOVER = re.compile(r"\{\{\s*\w|\{%-?\s*[a-z]|\{#")
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


@pytest.mark.parametrize("head_dim", range(32, 257, 16))
def test_every_backward_head_dim_renders_completely(head_dim):
    for dtype, ctype in CTYPES.items():
        spec = VarlenBackwardSpec(head_dim, dtype)
        out = render.render(spec, "ns")
        assert set(out) == {"binding.cpp", "kernels.cu"}
        for name, text in out.items():
            assert not JINJA_LEFTOVER.search(text), (spec.name, name, JINJA_LEFTOVER.search(text))
            assert spec.name in text
        kernels = out["kernels.cu"]
        assert f"constexpr int HEAD_DIM = {head_dim};" in kernels and f"using T = {ctype};" in kernels
        assert f"constexpr int BLOCK_N = {spec.block_n};" in kernels
        assert f"constexpr int WARPS_Q = {spec.warps_q};" in kernels
        for kernel in ("varlen_bwd_pre", "varlen_bwd(", "varlen_bwd_post"):
            assert f"void __launch_bounds__" in kernels and kernel in kernels
        assert "TORCH_BOX(&run)" in out["binding.cpp"] and "ns" in out["binding.cpp"]


def test_backward_default_tiles_fit_shared_memory_and_name_themselves():
    for head_dim in range(32, 257, 16):
        spec = VarlenBackwardSpec(head_dim)
        assert spec.smem_bytes() <= 227 * 1024, spec.name
        assert spec.warps in (4, 8, 16)
    assert VarlenBackwardSpec(128).name == "varlen_backward_f16_d128_n128m64q1"
    assert VarlenBackwardSpec(256, "bfloat16").name == "varlen_backward_bf16_d256_n64m64q2"
    assert VarlenBackwardSpec(128, block_n=128) == VarlenBackwardSpec(128)  # 0 and the default are one spec


@pytest.mark.parametrize("field, value", [("head_dim", 64), ("dtype", "bfloat16"), ("block_n", 64),
                                          ("block_m", 128), ("warps_q", 2), ("wgmma", True), ("producer", True)])
def test_backward_names_and_keys_differ_in_every_field(field, value):
    base = VarlenBackwardSpec(128, wgmma=field == "producer")
    other = dataclasses.replace(base, **{field: value})
    assert other.name != base.name
    assert keys.key_of(keys.components(base, TARGET)) != keys.key_of(keys.components(other, TARGET))


def test_backward_consumer_regs_is_a_split_of_the_producer_variant():
    # 0 resolves to the tuned split; every split fits the launch's register pool (168 a thread
    # at 384 threads), which setmaxnreg cannot grow.
    for head_dim in (64, 128, 256):
        spec = VarlenBackwardSpec(head_dim, "bfloat16", wgmma=True, producer=True)
        assert spec.consumer_regs == VarlenBackwardSpec.default_consumer_regs(head_dim) in CONSUMER_REGS
    assert VarlenBackwardSpec(128, wgmma=True).consumer_regs == 0
    assert all(128 * p + 256 * c <= 168 * 384 for c, p in CONSUMER_REGS.items())
    base = VarlenBackwardSpec(128, "bfloat16", wgmma=True, producer=True, consumer_regs=224)
    other = dataclasses.replace(base, consumer_regs=240)
    assert base.name == "varlen_backward_bf16_d128_wgmma_producer_n128m64q1"
    assert other.name == "varlen_backward_bf16_d128_wgmma_producer_r240_n128m64q1"
    assert keys.key_of(keys.components(base, TARGET)) != keys.key_of(keys.components(other, TARGET))
    assert "PRODUCER_REGS = 24, CONSUMER_REGS = 240;" in render.render(other, "x")["kernels.cu"]
    assert "PRODUCER_REGS = 56, CONSUMER_REGS = 224;" in render.render(base, "x")["kernels.cu"]
    with pytest.raises(ValueError, match="consumer_regs is one of"):
        VarlenBackwardSpec(128, wgmma=True, producer=True, consumer_regs=232)
    with pytest.raises(ValueError, match="set producer=True"):
        VarlenBackwardSpec(128, wgmma=True, consumer_regs=240)


def test_backward_persistent_is_a_variant_of_the_producer_kernel_the_default_at_128():
    spec = VarlenBackwardSpec(128, "bfloat16", wgmma=True, producer=True)
    persistent = dataclasses.replace(spec, persistent=True)
    assert not spec.persistent and persistent.name == "varlen_backward_bf16_d128_wgmma_producer_persistent_r240_n128m64q1"
    assert keys.key_of(keys.components(spec, TARGET)) != keys.key_of(keys.components(persistent, TARGET))
    assert "constexpr bool PERSISTENT = true;" in render.render(persistent, "x")["kernels.cu"]
    assert "constexpr bool PERSISTENT = false;" in render.render(spec, "x")["kernels.cu"]
    # The plan takes it at D128 with the producer outside deterministic mode, never elsewhere.
    plan = lambda head_dim, dtype, hopper=True, deterministic=False: VarlenBackwardSpec.for_call(
        head_dim, dtype, False, deterministic, hopper)
    assert plan(128, "bfloat16").persistent
    assert not plan(64, "float16").persistent
    assert not plan(128, "bfloat16", deterministic=True).persistent
    assert not plan(256, "bfloat16").persistent
    assert not plan(128, "bfloat16", hopper=False).persistent
    # What `prewarm --family varlen_backward` builds follows the plan (both modes) unless named.
    # (and, where the 80-row tile is on at 128, full calls' non-persistent 80-row spec between them)
    fields = {"head_dim": 128, "dtype": "bfloat16"}
    rows80 = [(False, 80)] if 128 in spec_module.TILE80_HEAD_DIMS else []
    assert [(v["persistent"], v["block_m"]) for v in VarlenBackwardSpec.prewarm_variants(fields, ("9.0a",))] == [
        (True, 64), *rows80, (False, 64)]
    assert [(v["persistent"], v["block_m"]) for v in VarlenBackwardSpec.prewarm_variants(
        {**fields, "persistent": False}, ("9.0a",))] == [(False, 64), *rows80]


@pytest.fixture
def rows80(monkeypatch):
    """The 80-row tile on where the template builds it (the default: spec.TILE80_HEAD_DIMS)."""
    from jitattn.varlen import spec as spec_module

    monkeypatch.setattr(spec_module, "TILE80_HEAD_DIMS", spec_module.TILE80_FITS)
    monkeypatch.setattr(spec_module, "TILE80_FEATURES", frozenset())


def test_prewarm_builds_the_80_row_tile_where_the_plan_takes_it(rows80):
    """The persistent kernel, the 80-row one for full calls, a CTA per key tile for deterministic
    calls with a window."""
    built = [(v["persistent"], v["block_m"]) for v in VarlenBackwardSpec.prewarm_variants(
        {"head_dim": 128, "dtype": "bfloat16"}, ("9.0a",))]
    assert built == [(True, 64), (False, 80), (False, 64)]


def _causal_mask_text() -> str:
    from jitattn.variants import gallery
    from jitattn.variants.trace import trace_mask_mod

    return trace_mask_mod(gallery.causal).key_text


def test_backward_full_calls_at_128_take_80_query_rows_a_step_and_nothing_else_does(rows80):
    """FlashAttention-3's non-causal hdim-128 tile: 80 query rows a step, dQ transposed, a CTA per
    key tile; a call with a window, a mask_mod, a score_mod or a soft cap keeps 64 rows."""
    plan = lambda head_dim=128, soft_cap=False, deterministic=False, features=frozenset(), **chosen: (
        VarlenBackwardSpec.for_call(head_dim, "bfloat16", soft_cap, deterministic, True, True, features, **chosen))
    spec = plan()
    assert (spec.block_m, spec.persistent) == (80, False) and spec.name.endswith("_n128m80q1")
    assert plan(deterministic=True).block_m == 80
    for other in (plan(features=frozenset({"window"})), plan(features=None), plan(64), plan(256), plan(soft_cap=True),
                  plan(mask_mod=_causal_mask_text())):  # the mask_mod counts though `features` left it out
        assert other.block_m == 64, other.name
    assert "constexpr int BLOCK_M = 80;" in render.render(spec, "x")["kernels.cu"]
    for bad in (dict(head_dim=64), dict(persistent=True), dict(soft_cap=True)):
        with pytest.raises(ValueError, match="block_m=80"):
            VarlenBackwardSpec(**{"head_dim": 128, "dtype": "bfloat16", "wgmma": True, "producer": True,
                                  "block_m": 80, **bad})


def test_backward_spec_round_trips_through_a_dict():
    spec = VarlenBackwardSpec(96, "bfloat16", block_n=64)
    assert spec.to_dict()["family"] == "varlen_backward"
    assert spec_from_dict(spec.to_dict()) == spec
    assert spec_from_dict({"family": "varlen_backward", "head_dim": 64}) == VarlenBackwardSpec(64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(head_dim=136), "multiple of 16"),
    (dict(head_dim=16), "multiple of 16"),
    (dict(head_dim=128, dtype="float8_e4m3fn"), "float16 or bfloat16"),
    (dict(head_dim=256, warps_q=1), "warps_q=1 holds all of dK and dV"),
    (dict(head_dim=128, warps_q=3), "warps_q must be 1 or 2"),
    (dict(head_dim=128, block_m=32), "block_m 64 or 128"),
    (dict(head_dim=128, block_n=256), r"\[32, 2 \* block_m\]"),
    (dict(head_dim=64, block_n=48, block_m=128), "whole groups"),
    (dict(head_dim=192, wgmma=True), "wgmma kernels cover head_dim 64, 128 and 256"),
    (dict(head_dim=96, wgmma=True), "wgmma kernels cover head_dim 64, 128 and 256"),
    (dict(head_dim=128, wgmma=True, block_m=128), "wgmma tile at head_dim 128 is block_n=128, block_m=64"),
    (dict(head_dim=256, wgmma=True, block_n=128), "wgmma tile at head_dim 256 is block_n=64, block_m=64, warps_q=2"),
    (dict(head_dim=128, producer=True), "producer=True is part of the wgmma rung"),
    (dict(head_dim=128, wgmma=True, producer=True, dq_kernel=True), "dq_kernel=True is a variant"),
    (dict(head_dim=256, wgmma=True, dq_kernel=True), "dq_kernel=True is a variant"),
    (dict(head_dim=256, dq_kernel=True), "dq_kernel=True is a variant"),
    (dict(head_dim=256, wgmma=True, producer=True, persistent=True), "persistent=True overlaps"),
    (dict(head_dim=128, wgmma=True, persistent=True), "persistent=True overlaps"),
])
def test_backward_spec_refuses_shapes_it_cannot_run(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VarlenBackwardSpec(**kwargs)


def test_backward_mma_rung_builds_plain_sm():
    assert VarlenBackwardSpec(128).archs_for(("9.0a",)) == ("9.0",)
    assert VarlenBackwardSpec(128).archs_for(("8.0", "9.0")) == ("8.0", "9.0")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype, ptx", [("float16", "f16"), ("bfloat16", "bf16")])
@pytest.mark.parametrize("producer", [False, True])
def test_backward_wgmma_rung_renders_and_targets_sm90a(head_dim, dtype, ptx, producer):
    spec = VarlenBackwardSpec(head_dim, dtype, wgmma=True, producer=producer)
    split = head_dim == 256  # two warpgroups on 64 keys, dK / dV split along head_dim
    tile = "n64m64q2" if split else "n128m64q1"
    rung = ("_producer" + ("_r240" if spec.consumer_regs == 240 else "")) if producer else ""
    assert spec.name == f"varlen_backward_{ptx}_d{head_dim}_wgmma{rung}_{tile}"
    assert spec_from_dict(spec.to_dict()) == spec and spec.smem_bytes() <= 227 * 1024
    kernels = render.render(spec, "ns")["kernels.cu"]
    assert not JINJA_LEFTOVER.search(kernels)
    # S^T / dP^T (n64; split: n32 a warpgroup), dV / dK (n = head_dim; split: half of it), dQ with
    # a transposed A (n = head_dim / 2; split: in two slices of 64).
    widths = (32, 128, 64) if split else (64, head_dim, head_dim // 2)
    for n in widths:
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx}" in kernels
    assert "::ss<0, 1, 1>(" in kernels and '"n"(TRANS_A)' in kernels  # dQ = dS K reads dS^T transposed
    assert f"constexpr bool PRODUCER = {'true' if producer else 'false'};" in kernels
    assert spec.archs_for(("9.0",)) == spec.archs_for(("8.0", "9.0a")) == ("9.0a",)
    with pytest.raises(ValueError, match="only sm_90"):
        spec.archs_for(("8.0",))


@pytest.mark.parametrize("dtype, ptx", [("float16", "f16"), ("bfloat16", "bf16")])
@pytest.mark.parametrize("soft_cap", [False, True])
def test_backward_dq_kernel_variant_names_keys_and_renders_its_kernel(dtype, ptx, soft_cap):
    """dq_kernel: its own name and key, a round trip, and the rendered source with the dQ kernel
    (n64 S / dP, n256 dQ from registers) and the dK / dV kernel without dQ atomics or a postprocess."""
    base = VarlenBackwardSpec(256, dtype, wgmma=True, producer=True, soft_cap=soft_cap)
    spec = dataclasses.replace(base, dq_kernel=True)
    assert spec.name == f"varlen_backward_{ptx}_d256_wgmma_producer_dqkernel{'_cap' if soft_cap else ''}_n64m64q2"
    assert spec_from_dict(spec.to_dict()) == spec and spec.smem_bytes() <= 227 * 1024
    assert keys.key_of(keys.components(base, TARGET)) != keys.key_of(keys.components(spec, TARGET))
    sources = render.render(spec, "ns")
    kernels = sources["kernels.cu"]
    assert not JINJA_LEFTOVER.search(kernels)
    assert "void __launch_bounds__(DQ_THREADS, 1) varlen_bwd_dq(" in kernels and "launch_dependent(varlen_bwd_post" not in kernels
    for n in (32, 64, 128, 256):
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx}" in kernels
    assert "dq_atomics" not in kernels and "atomicAdd(reinterpret_cast<float4*>" not in kernels.split("varlen_bwd_dq")[0]
    assert "int num_m_blocks) -> ()" in sources["binding.cpp"]
    assert "int num_m_blocks" not in render.render(base, "ns")["binding.cpp"]


def test_backward_templates_are_apart_from_the_forward_ones():
    """The forward's cache keys must not move when the backward's templates change."""
    forward = render.template_files(render.templates_dir(), tuple(sorted(VarlenSpec.sources.values())))
    backward = render.template_files(render.templates_dir(), tuple(sorted(VarlenBackwardSpec.sources.values())))
    assert not [f for f in forward if "backward" in f]
    assert {"varlen/backward_schedule.cuh", "varlen/backward_mma.cuh", "varlen/backward_wgmma.cuh",
            "varlen/backward_prepost.cuh", "common/wgmma.cuh"} <= set(backward)


@pytest.mark.parametrize("manifest", ["default.toml", "gpu-tests.toml"])
def test_manifests_list_the_backward_beside_the_forward(manifest):
    specs = read_manifest(REPO / "cache" / manifest)
    backward = {s for s in specs if isinstance(s, VarlenBackwardSpec)}
    for head_dim in (64, 128, 256):
        for dtype in ("float16", "bfloat16"):
            assert VarlenBackwardSpec(head_dim, dtype) in backward, (manifest, head_dim, dtype)
            if VarlenBackwardSpec.wgmma_fits(head_dim):
                producer = VarlenBackwardSpec(head_dim, dtype, wgmma=True, producer=True,
                                              dq_kernel=head_dim in DQ_KERNEL_HEAD_DIMS,
                                              persistent=head_dim in PERSISTENT_HEAD_DIMS)
                assert producer in backward, (manifest, head_dim, dtype)  # what for_call picks
                lockstep = VarlenBackwardSpec(head_dim, dtype, wgmma=True)
                assert (lockstep in backward) == (manifest == "gpu-tests.toml"), "the lockstep variant is opt-in"


@pytest.mark.parametrize("manifest, capped", [("default.toml", (False,)), ("gpu-tests.toml", (False, True))])
def test_manifests_list_the_backward_kernels_hopper_calls_run(manifest, capped):
    """Each backward a call plans on sm_90 (VarlenBackwardSpec.for_call: dq_kernel at D256, the register
    split at D128, the soft cap's variant) is in the manifest, so production's and the GPU tests'
    JIT-disabled calls find it (the D256 soft-cap dq_kernel was once missing from gpu-tests.toml)."""
    listed = {s for s in read_manifest(REPO / "cache" / manifest) if isinstance(s, VarlenBackwardSpec)}
    for head_dim in (64, 128, 256):
        for dtype in ("float16", "bfloat16"):
            for cap in capped:
                for deterministic in (False, True):
                    spec = VarlenBackwardSpec.for_call(head_dim, dtype, cap, deterministic, hopper=True)
                    assert spec.producer and spec.dq_kernel == (head_dim == 256)
                    assert spec in listed, (manifest, spec.name)


def test_a_score_mods_feature_is_affine_where_its_bias_is_linear_along_the_keys():
    """for_call counts a score_mod as "affine_score_mod" where render.kv_affine finds its bias linear
    in kv_idx (relative position, ALiBi), else as "score_mod" (a bias table, a soft cap), whatever
    the caller listed; with the default TILE80_FEATURES only full calls of the affine ones take the
    80-row tile."""
    from jitattn.variants import gallery
    from jitattn.variants.trace import trace_score_mod

    if 128 not in spec_module.TILE80_HEAD_DIMS or spec_module.TILE80_FEATURES != {"affine_score_mod"}:
        pytest.skip("the module's tile constants are not their defaults")
    plan = lambda features, text: VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True, True,
                                                              frozenset(features), score_mod=text)
    affine = [trace_score_mod(f).key_text for f in (gallery.relative_position, gallery.alibi(torch.rand(4)))]
    other = [trace_score_mod(f).key_text for f in (gallery.bias_table(torch.rand(4, 63), 31), gallery.soft_cap(30.0))]
    for text in affine:
        for listed in ((), ("score_mod",), ("affine_score_mod",)):
            assert plan(listed, text).block_m == 80, text
        assert plan({"window", "score_mod"}, text).block_m == 64 and plan({"window"}, text).persistent
    for text in other:
        for listed in ((), ("score_mod",), ("affine_score_mod",)):  # the text decides, not the list
            assert plan(listed, text).block_m == 64 and plan(listed, text).persistent, text


def test_tile80_features_route_windows_and_variants_onto_the_80_row_tile_one_by_one(rows80, monkeypatch):
    """spec.TILE80_FEATURES: a call takes the 80-row tile when every feature it adds to a full call
    is listed; a soft cap, another head dim or an unknown call (features=None) never does; prewarm
    lists what the plan would take."""
    from jitattn.variants import gallery
    from jitattn.variants.trace import trace_score_mod

    relbias = trace_score_mod(gallery.relative_position).key_text
    plan = lambda features, head_dim=128, soft_cap=False, **chosen: VarlenBackwardSpec.for_call(
        head_dim, "bfloat16", soft_cap, False, True, True, features, **chosen)
    window, both = frozenset({"window"}), frozenset({"window", "score_mod"})
    monkeypatch.setattr(spec_module, "TILE80_FEATURES", frozenset({"window"}))
    assert plan(window).block_m == 80 and not plan(window).persistent
    assert plan(both, score_mod=relbias).block_m == 64  # the score_mod is not listed
    assert plan(frozenset(), score_mod=relbias).block_m == 64
    monkeypatch.setattr(spec_module, "TILE80_FEATURES", frozenset(spec_module.CALL_FEATURES))
    assert plan(both, score_mod=relbias).block_m == 80
    assert plan(frozenset({"mask_mod"}), mask_mod=_causal_mask_text()).block_m == 80
    for other in (plan(None), plan(window, soft_cap=True), plan(window, head_dim=64), plan(window, head_dim=256)):
        assert other.block_m != 80, other.name
    built = [(v["persistent"], v["block_m"]) for v in VarlenBackwardSpec.prewarm_variants(
        {"head_dim": 128, "dtype": "bfloat16", "score_mod": relbias}, ("9.0a",))]
    assert built == [(False, 80)]  # with or without a window, either mode: one spec
    with pytest.raises(ValueError, match="features are some of"):
        plan(frozenset({"causal"}))
