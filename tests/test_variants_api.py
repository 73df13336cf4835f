"""Variants through the varlen API and the JIT, on the CPU (issue 46, items 1 and 4): the
arguments' checks, the spec fields (validated, keyed, named, recorded, prewarmed), the ops'
schemas and their rebuilding of a variant from its text, cache/variants.toml, and a real build of
a variant spec (nvcc, every capture dtype)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jitattn
from jitattn.jit import keys, registry
from jitattn.variants import Variant, gallery, trace_mask_mod, trace_score_mod
from jitattn.varlen import checks
from jitattn.varlen.spec import VarlenBackwardSpec, VarlenSpec
from jitattn.varlen.variant_args import VARIANT_ARGS, op_arguments, texts_and_captures, variants_of
from tests.conftest import require_nvcc

REPO = Path(__file__).resolve().parent.parent
ALIBI = trace_score_mod(gallery.alibi(torch.rand(4)))
DOCUMENT = trace_mask_mod(gallery.document(torch.zeros(2, 8, dtype=torch.int32)))


def _call(monkeypatch, **kw):
    """varlen_call on CPU tensors with the device check stood in for (as test_varlen_validation does)."""
    from jitattn import checks as _checks

    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    q = torch.randn(10, 4, 64, dtype=torch.float16)
    k = torch.randn(12, 2, 64, dtype=torch.float16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return checks.varlen_call(q, k, k.clone(), cu_q, cu_k, 6, 7, enable_gqa=True, **kw)


def test_a_call_carries_its_traced_variants(monkeypatch):
    slopes = torch.rand(4)
    call = _call(monkeypatch, score_mod=gallery.alibi(slopes), mask_mod=gallery.causal)
    assert isinstance(call.score_mod, Variant) and call.score_mod.kind == "score_mod"
    assert call.score_mod.tensors[0] is slopes
    assert call.mask_mod.key_text == trace_mask_mod(gallery.causal).key_text
    assert call.args.score_mod is call.score_mod  # the derived fields carry them too
    assert _call(monkeypatch).score_mod is None


@pytest.mark.parametrize("kw,error,words", [
    ({"score_mod": 3}, TypeError, ["score_mod", "(score, b, h, q_idx, kv_idx)"]),
    ({"mask_mod": "causal"}, TypeError, ["mask_mod", "(b, h, q_idx, kv_idx)"]),
    ({"score_mod": DOCUMENT}, TypeError, ["score_mod", "mask_mod"]),
    ({"softcap": 30.0, "score_mod": gallery.relative_position}, ValueError, ["softcap", "score_mod"]),
    ({"score_mod": lambda s, b, h, q, kv: torch.sin(s)}, ValueError, ["torch.sin"]),
    ({"score_mod": gallery.alibi(torch.rand(4, requires_grad=True))}, ValueError, ["requires grad", "detach"]),
])
def test_bad_variant_arguments_are_refused_by_name(monkeypatch, kw, error, words):
    with pytest.raises(error) as info:
        _call(monkeypatch, **kw)
    for word in words:
        assert word in str(info.value)


def test_a_variant_with_fp32_positions_refuses_sequences_it_cannot_count_exactly(monkeypatch):
    """Rendered positions are fp32 (render.FLOAT_POSITIONS_LIMIT): max_q / max_k at the limit are
    refused by name; a table index (int arithmetic) and the limit minus one are not."""
    from jitattn.variants.render import FLOAT_POSITIONS_LIMIT as limit
    from jitattn.varlen import checks as varlen_checks

    q = torch.randn(10, 4, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    monkeypatch.setattr(__import__("jitattn.checks").checks, "cuda_device", lambda named: torch.device("cuda", 0))
    for name, (max_q, max_k) in (("max_q", (limit, 6)), ("max_k", (6, limit))):
        with pytest.raises(ValueError, match=rf"{name} = {limit}: a score_mod .* float32 .* below {limit}"):
            varlen_checks.varlen_call(q, q, q, cu, cu, max_q, max_k, score_mod=gallery.relative_position)
    varlen_checks.varlen_call(q, q, q, cu, cu, limit - 1, limit - 1, score_mod=gallery.relative_position)
    table = gallery.bias_table(torch.zeros(4, 9), 4)
    varlen_checks.varlen_call(q, q, q, cu, cu, limit, limit, score_mod=table)


def test_captured_tensors_take_part_in_the_device_check():
    q = torch.randn(4, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        checks.varlen_call(q, q, q, cu, cu, 4, 4, score_mod=gallery.alibi(torch.rand(2)))


def test_spec_fields_key_and_name_the_variant():
    plain = VarlenSpec.for_call(128, "bfloat16", False, False, False, False, True)
    varied = VarlenSpec.for_call(128, "bfloat16", False, False, False, False, True, score_mod=ALIBI.key_text,
                                 mask_mod=DOCUMENT.key_text)
    assert {f: getattr(varied, f) for f in ("wgmma", "tma", "persistent")} == \
        {f: getattr(plain, f) for f in ("wgmma", "tma", "persistent")}  # the rule's choice is the same
    assert f"_sm{ALIBI.digest}_mm{DOCUMENT.digest}" in varied.name
    target = keys.BuildTarget(("9.0a",), "13.0", "gcc")
    assert keys.key_of(keys.components(varied, target)) != keys.key_of(keys.components(plain, target))
    again = registry.spec_from_dict(json.loads(json.dumps(varied.to_dict())))
    assert again == varied
    params = varied.params()
    assert params["num_captures"] == 2 and params["score_mod_captures"] == 1
    assert "struct ScoreMod" in params["score_mod_source"] and "struct MaskMod" in params["mask_mod_source"]
    backward = VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True, score_mod=ALIBI.key_text)
    assert f"_sm{ALIBI.digest}" in backward.name and "score_mod_source" not in backward.to_dict()


def test_the_key_follows_the_code_jitattns_renderer_writes_not_only_the_fields(monkeypatch):
    """A changed renderer (a fix in jitattn/variants/render.py, no template touched) must not load
    the entry the old one built: the key hashes the template parameters' digest too."""
    import jitattn.variants as variants

    target = keys.BuildTarget(("9.0a",), "13.0", "gcc")
    specs = [VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True, score_mod=ALIBI.key_text),
             VarlenSpec.for_call(128, "bfloat16", False, False, False, False, True, score_mod=ALIBI.key_text)]
    before = [keys.components(spec, target) for spec in specs]
    real = variants.render_score_mod
    monkeypatch.setattr(variants, "render_score_mod", lambda v, *rest: real(v, *rest) + "// another renderer\n")
    for spec, old in zip(specs, before):
        new = keys.components(spec, target)
        assert keys.differing(new, old) == ["params"], spec.name
        assert keys.key_of(new) != keys.key_of(old)


@pytest.mark.parametrize("text,words", [
    ('{"kind":"score_mod","tree":["sin",["arg","score"]],"captures":[]}', ["score_mod", "sin"]),
    ('{"kind":"score_mod","tree":["arg","b"],"captures":[]}', ["score_mod"]),
    ("#include <evil>", ["score_mod"]),
    ("x" * 40000, ["score_mod"]),
])
def test_a_spec_from_a_record_or_manifest_validates_the_tree(text, words):
    with pytest.raises(ValueError) as info:
        registry.spec_from_dict({"family": "varlen", "head_dim": 64, "score_mod": text})
    for word in words:
        assert word in str(info.value)
    with pytest.raises(TypeError, match="mask_mod"):
        VarlenSpec(64, mask_mod=["eq"])


def test_soft_cap_and_a_score_mod_are_one_hook():
    with pytest.raises(ValueError, match="soft_cap"):
        VarlenSpec(64, soft_cap=True, score_mod=ALIBI.key_text)
    with pytest.raises(ValueError, match="exact_soft_cap"):
        VarlenSpec(64, exact_soft_cap=True)
    # poly_tanh picks the soft cap's tanh too, and not beside the exact one
    for spec_class in (VarlenSpec, VarlenBackwardSpec):
        for fields in ({"poly_tanh": True}, {"poly_tanh": True, "soft_cap": True, "exact_soft_cap": True}):
            with pytest.raises(ValueError, match="poly_tanh=True picks the soft cap's tanh"):
                spec_class(64, **fields)
        assert spec_class(64, soft_cap=True, poly_tanh=True).name != spec_class(64, soft_cap=True).name


def test_the_ops_carry_variants_as_text_and_a_tensor_list():
    import jitattn.varlen.ops  # noqa: F401

    for name in ("varlen_attn", "varlen_attn_out", "varlen_attn_backward"):
        schema = str(getattr(torch.ops.jitattn, name).default._schema)
        assert VARIANT_ARGS.replace("captures=None", "captures=None)") in schema, schema  # the last arguments
    slopes, doc = torch.rand(4), torch.zeros(2, 8, dtype=torch.int32)
    score_text, mask_text, captures = op_arguments(gallery.alibi(slopes), gallery.document(doc))
    assert captures[0] is slopes and captures[1] is doc
    score, mask = variants_of(score_text, mask_text, captures)
    assert score.key_text == ALIBI.key_text and score.tensors == (slopes,) and mask.tensors == (doc,)
    assert texts_and_captures(score, mask) == (score_text, mask_text, captures)
    assert variants_of(None, None, None) == (None, None)
    with pytest.raises(ValueError, match="fewer"):
        variants_of(score_text, mask_text, [slopes])
    with pytest.raises(ValueError, match="more tensors"):
        variants_of(score_text, None, [slopes, doc])


def test_the_acceptance_manifest_is_current_and_prewarms_on_a_cpu_box(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import variants_manifest
    finally:
        sys.path.remove(str(REPO / "tools"))
    written = (REPO / "cache" / "variants.toml").read_text()
    assert variants_manifest.manifest_text(4096, [128], ["bfloat16"], []).split("\n", 3)[3] == written.split("\n", 3)[3]
    result = subprocess.run([sys.executable, "-m", "jitattn", "prewarm", str(REPO / "cache" / "variants.toml"),
                             "--arch", "9.0", "--dry-run"], capture_output=True, text=True, cwd=REPO,
                            env={**__import__("os").environ, "JITATTN_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  varlen")]
    # 8 variants, forward and backward each; causal and sliding-window masks are windows: both run
    # the built-in kernels (jitattn/variants/window.py), listed once; the affine score_mods
    # (relative position, ALiBi) have two backwards: full calls on the 80-row tile
    # (spec.TILE80_FEATURES), causal ones on the persistent 64-row kernel
    assert len(names) == 16 and len(set(names)) == 16
    assert sum("_mm" not in name and "_sm" not in name for name in names) == 2


BIAS_TABLE = trace_score_mod(gallery.bias_table(torch.rand(4, 63), 31))


def test_unit_slope_marks_score_mods_whose_slope_is_one():
    """ScoreMod::UNIT_SLOPE (score.cuh): a bias of the indices alone, KV_AFFINE or not; never a soft cap."""
    from jitattn.variants import render_score_mod

    for variant, unit in ((BIAS_TABLE, True), (ALIBI, True), (trace_score_mod(gallery.relative_position), True),
                          (trace_score_mod(gallery.soft_cap(30.0)), False)):
        assert f"UNIT_SLOPE = {'true' if unit else 'false'};" in render_score_mod(variant), variant.key_text


def test_early_unit_slope_probs_is_a_parameter_of_score_mod_backwards_in_their_keys(monkeypatch):
    """spec.EARLY_UNIT_SLOPE_PROBS: on by default; off, a score_mod's backward renders without it (a
    new key, through the parameters' digest), a backward without one is the same kernel."""
    from jitattn.varlen import spec as spec_module

    target = keys.BuildTarget(("9.0a",), "13.0", "gcc")
    table = VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True, score_mod=BIAS_TABLE.key_text)
    plain = VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True)
    assert table.params()["early_unit_slope_probs"] and not plain.params()["early_unit_slope_probs"]
    before = [keys.key_of(keys.components(spec, target)) for spec in (table, plain)]
    monkeypatch.setattr(spec_module, "EARLY_UNIT_SLOPE_PROBS", False)
    assert not table.params()["early_unit_slope_probs"]
    after = [keys.key_of(keys.components(spec, target)) for spec in (table, plain)]
    assert after[0] != before[0] and after[1] == before[1]


@pytest.mark.compile
@pytest.mark.parametrize("early", [True, False])
def test_a_bias_tables_backward_builds_with_its_probs_under_the_dp_gemm_or_after_it(cache_root, monkeypatch, early):
    """A real build (nvcc, in this process) of the bias table's wgmma backward with
    spec.EARLY_UNIT_SLOPE_PROBS on (the default: the rung's P^T-only walk, scored_probs_to_dscores<false>)
    and off (P^T and dS^T after both GEMMs, what JITATTN_TEST_BACKWARD_EARLY_PROBS=0 runs)."""
    require_nvcc()
    from jitattn.jit import prewarm
    from jitattn.varlen import spec as spec_module

    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(spec_module, "EARLY_UNIT_SLOPE_PROBS", early)
    spec = VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True, score_mod=BIAS_TABLE.key_text)
    outcome = prewarm.build_one(spec, force=True)
    assert outcome.status == "built", outcome
    sources = [path.read_text() for path in cache_root.rglob("kernels.cu")]
    assert len(sources) == 1 and f"constexpr bool EARLY_UNIT_SLOPE_PROBS = {str(early).lower()};" in sources[0]


@pytest.mark.compile
def test_a_variant_spec_with_every_capture_dtype_builds(tmp_path, monkeypatch):
    """A real build (nvcc, torch's flags) of a forward and a backward whose variants read a capture
    of every dtype: the rendered hooks, variant.cuh and the bindings' capture arguments compile, and
    the forward's C entry takes the params Python packs with six captures (VarlenKernel compares
    sizes on load)."""
    require_nvcc()
    tables = {dtype: torch.zeros(4, 4, dtype=dtype) for dtype in
              (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)}
    flags = torch.zeros(4, dtype=torch.bool)

    def score_mod(score, b, h, q_idx, kv_idx):
        bias = tables[torch.float32][h, q_idx % 4] + tables[torch.float16][h, kv_idx % 4]
        return score + bias * tables[torch.bfloat16][b, h] + (tables[torch.int32][b, 0] - tables[torch.int64][b, 1])

    def mask_mod(b, h, q_idx, kv_idx):
        return flags[b] | (q_idx >= kv_idx)

    score, mask = trace_score_mod(score_mod), trace_mask_mod(mask_mod)
    specs = [VarlenSpec.for_call(64, "float16", False, False, False, False, True, score_mod=score.key_text,
                                 mask_mod=mask.key_text),
             VarlenBackwardSpec.for_call(64, "float16", False, False, True, score_mod=score.key_text,
                                         mask_mod=mask.key_text)]
    args = [sys.executable, "-m", "jitattn", "prewarm", "--arch", "9.0", "-j", "2"]
    for spec in specs:
        args += ["--spec", json.dumps(spec.to_dict())]
    env = {**__import__("os").environ, "JITATTN_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "built 2" in result.stdout, result.stdout[-2000:]
    # the forward's mask map is a unit of its own (linked into the same library); the backward's is not
    assert [path.parent.name.startswith(specs[0].name) for path in tmp_path.rglob("mask_map.cu")] == [True]
    from jitattn.jit.loader import get_module
    from jitattn.kernel import fresh_memos
    from jitattn.varlen.launch import VarlenKernel

    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")  # what prewarm built, not a new build
    with fresh_memos():
        assert len(score.tensors) + len(mask.tensors) == 6
        VarlenKernel(get_module(specs[0]), specs[0])
