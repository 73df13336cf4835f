"""From a variant's tree to C++ (issue 46 item 2): the derivative against autograd on the float64
reference, classify's interval analysis against brute force (sound; exact for causal, sliding
window and prefix-LM), rendering that prints only validated nodes, and real nvcc builds: the
acceptance set compiles for sm_90a, and a host build of the same rendered code agrees with the
Python mirror and the reference."""
from __future__ import annotations

import math
import re
import subprocess

import pytest
import torch

from jitattn.variants import (Variant, derivative, reference_mask, reference_score, render_mask_mod, render_score_mod,
                              trace_mask_mod, trace_score_mod)
from jitattn.variants import gallery, interval, render
from jitattn.variants.tree import INT32_MAX, INT32_MIN, Shared
from tests.conftest import require_nvcc
from tests.test_variants_trace import N_HEADS, N_SEQ, N_TOKENS, acceptance_set, grid

TEMPLATES = render.__file__.rsplit("/jitattn/", 1)[0] + "/templates/varlen"


def extra_score_mods():
    """Score variants beyond the acceptance set that reach every derivative rule."""
    w = torch.rand(N_HEADS) + 0.5
    return {
        "masked_causal": lambda s, b, h, q, kv: torch.where(q >= kv, s, float("-inf")),
        "exp_sigmoid": lambda s, b, h, q, kv: torch.exp(s * 0.1) * torch.sigmoid(s - w[h]),
        "log_sqrt": lambda s, b, h, q, kv: torch.log(s * s + 1.0) + torch.sqrt(s * s + w[h]),
        "exp2_div": lambda s, b, h, q, kv: torch.exp2(s / 8.0) / (1.0 + s * s) + w[h] / (2.0 + s.abs()),
        "abs_min_max": lambda s, b, h, q, kv: torch.minimum(s.abs(), (q - kv).float()) + torch.maximum(s, -s * 0.5),
        "poly": lambda s, b, h, q, kv: s ** 3 * 0.01 - s ** 2 * 0.1 + (q % 3).float() * s,
        "nested_cap": lambda s, b, h, q, kv: 20.0 * torch.tanh((s + w[h] * (kv - q)) / 20.0) - 1.5,
    }


def score_variants():
    out = {name: fn for name, (kind, fn, _) in acceptance_set().items() if kind == "score_mod"}
    return {**out, **extra_score_mods()}


SCORE_NAMES = list(score_variants())
MASK_NAMES = [name for name, (kind, _, _) in acceptance_set().items() if kind == "mask_mod"]


# ---------------------------------------------------------------- the derivative
@pytest.mark.parametrize("name", SCORE_NAMES)
def test_derivative_matches_autograd_on_the_float64_reference(name):
    v = trace_score_mod(score_variants()[name])
    b, h, q, kv = grid()
    scores = (torch.randn(N_SEQ, N_HEADS, N_TOKENS, N_TOKENS, dtype=torch.float64) * 6).requires_grad_()
    value = reference_score(v, scores, b, h, q, kv)
    (autograd,) = torch.autograd.grad(value, scores, torch.ones_like(value))
    slope = reference_score(derivative(v), scores.detach(), b, h, q, kv)
    torch.testing.assert_close(slope, autograd, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(slope).all()


def test_derivatives_are_simplified():
    cases = acceptance_set()
    relative = trace_score_mod(cases["relative_bias"][1])
    assert derivative(relative).tree == ("const", 1.0)
    masked = trace_score_mod(extra_score_mods()["masked_causal"])
    assert derivative(masked).tree == ("where", ("ge", ("arg", "q_idx"), ("arg", "kv_idx")), ("const", 1.0),
                                       ("const", 0.0))
    cap = trace_score_mod(cases["soft_cap"][1])
    t = cap.tree[2]  # tanh(score / cap): the cap's constants cancel in the slope
    assert derivative(cap).tree == ("sub", ("const", 1.0), ("mul", t, t))


def test_dscore_of_the_soft_cap_reuses_the_forward_value_and_recomputes_no_tanh():
    source = render_score_mod(trace_score_mod(acceptance_set()["soft_cap"][1]))
    dscore = source[source.index("float dscore("):]
    assert "vtanh" not in dscore and "sc * scale" in dscore
    assert source.count("vtanh") == 1


# ---------------------------------------------------------------- classify: intervals
def brute_force(v, b, kv_head, pack, q_lo, q_hi, kv_lo, kv_hi):
    h = torch.arange(kv_head * pack, kv_head * pack + pack).view(-1, 1, 1)
    q = torch.arange(q_lo, q_hi + 1).view(1, -1, 1)
    kv = torch.arange(kv_lo, kv_hi + 1).view(1, 1, -1)
    visible = reference_mask(v, b, h, q, kv)
    return bool(visible.any()), bool((~visible).any())


def random_box(rng, pack, span=N_TOKENS):
    q_lo, kv_lo = rng.randrange(-2, span), rng.randrange(-2, span)
    return (rng.randrange(N_SEQ), rng.randrange(N_HEADS // pack), pack, q_lo, q_lo + rng.randrange(0, 9),
            kv_lo, kv_lo + rng.randrange(0, 9))


@pytest.mark.parametrize("name", MASK_NAMES)
def test_classify_is_sound_and_exact_where_the_issue_asks(name, rng):
    v = trace_mask_mod(acceptance_set()[name][1])
    exact = name in ("causal", "sliding_window", "prefix_lm")
    verdicts = set()
    for _ in range(400):
        box = random_box(rng, rng.choice([1, 2, 3]))
        verdict = interval.classify(v, *box)
        any_visible, any_hidden = brute_force(v, *box)
        assert not (verdict == interval.EMPTY and any_visible), (name, box)
        assert not (verdict == interval.FULL and any_hidden), (name, box)
        if exact:
            want = interval.EMPTY if not any_visible else interval.FULL if not any_hidden else interval.PARTIAL
            assert verdict == want, (name, box)
        verdicts.add(verdict)
    if exact:
        assert verdicts == {interval.EMPTY, interval.PARTIAL, interval.FULL}


def test_classify_reads_exact_loads_and_calls_document_tiles_inside_one_document_full():
    doc_id = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    v = trace_mask_mod(lambda b, h, q, kv: doc_id[b, q] == doc_id[b, kv])
    assert interval.classify(v, 0, 0, 1, 2, 2, 5, 5) == interval.EMPTY  # one element, exact reads
    assert interval.classify(v, 0, 0, 1, 1, 1, 2, 2) == interval.FULL
    assert interval.classify(v, 0, 0, 1, 0, 3, 0, 3) == interval.PARTIAL  # not exact: unknown, safe


def test_an_exact_index_that_leaves_int32_wraps_as_the_kernels_int_and_is_read_exactly():
    """INT32_MIN - INT32_MAX is 1 in the kernel's wrapping ints: classify reads table[0, 1] exactly,
    as preload(b) does, instead of widening the index to all of int32 (the CI failure of the
    fifteenth session: classify PARTIAL, classify(preload(b), ...) EMPTY)."""
    table = torch.tensor([[0, 7, 0]], dtype=torch.int32)
    index = ("sub", ("const", INT32_MIN), ("const", INT32_MAX))
    for limit, want in ((5, interval.EMPTY), (9, interval.FULL)):
        tree = ("lt", ("load", 0, ("const", 0), index), ("const", limit))
        v = Variant("mask_mod", tree, (("int32", 2),), (table,))
        assert interval.classify(v, 0, 0, 1, 0, 7, 0, 7) == want
        assert brute_force(v, 0, 0, 1, 0, 7, 0, 7) == (want == interval.FULL, want == interval.EMPTY)


def test_classify_with_range_reads_settles_tiles_inside_and_between_documents():
    """classify_warp's reads (ranges=True) take a read over an index range as its elements' span:
    one document id on both sides is FULL, disjoint ids EMPTY, overlapping ones PARTIAL; past the
    limit, or with two inexact indices, a read stays unknown."""
    doc_id = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]])
    v = trace_mask_mod(lambda b, h, q, kv: doc_id[b, q] == doc_id[b, kv])
    assert interval.classify(v, 0, 0, 1, 0, 3, 0, 3, ranges=True) == interval.FULL
    assert interval.classify(v, 0, 0, 1, 0, 3, 4, 9, ranges=True) == interval.EMPTY
    assert interval.classify(v, 0, 0, 1, 0, 5, 4, 7, ranges=True) == interval.PARTIAL
    assert interval.classify(v, 0, 0, 1, 0, 3, 0, 3) == interval.PARTIAL  # classify(): exact reads only
    assert interval.classify(v, 0, 0, 1, 8, 12, 8, 9, ranges=True) == interval.PARTIAL  # 0 read past the end
    big = torch.zeros(1, interval.RANGE_READS + 1, dtype=torch.int32)
    w = trace_mask_mod(lambda b, h, q, kv: big[b, q] == big[b, kv])
    assert interval.classify(w, 0, 0, 1, 0, interval.RANGE_READS - 1, 0, 0, ranges=True) == interval.FULL
    assert interval.classify(w, 0, 0, 1, 0, interval.RANGE_READS, 0, 0, ranges=True) == interval.PARTIAL
    table = torch.zeros(4, 4, dtype=torch.int32)
    two = trace_mask_mod(lambda b, h, q, kv: table[q, kv] == 0)
    assert interval.classify(two, 0, 0, 1, 0, 1, 0, 1, ranges=True) == interval.PARTIAL
    flags = torch.tensor([[True, True, False]])
    u = trace_mask_mod(lambda b, h, q, kv: flags[b, kv])
    assert interval.classify(u, 0, 0, 1, 0, 5, 0, 1, ranges=True) == interval.FULL
    assert interval.classify(u, 0, 0, 1, 0, 5, 2, 2, ranges=True) == interval.EMPTY
    assert interval.classify(u, 0, 0, 1, 0, 5, 1, 2, ranges=True) == interval.PARTIAL


def random_mask_tree(rng, depth=0):
    """A random bool tree over int arithmetic (wrapping, floor division, loads of capture 0, an
    int32 (N_HEADS, N_TOKENS) table, read out of range too) and the odd float comparison."""
    def integer(d):
        if d > 3 or rng.random() < 0.3:
            return rng.choice([("arg", "q_idx"), ("arg", "kv_idx"), ("arg", "h"), ("arg", "b"),
                               ("const", rng.randint(-7, 7)), ("const", rng.choice([2 ** 31 - 1, -2 ** 31]))])
        op = rng.choice(["add", "sub", "mul", "floordiv", "mod", "abs", "neg", "min", "max", "where", "load"])
        if op in ("abs", "neg"):
            return (op, integer(d + 1))
        if op == "where":
            return (op, boolean(d + 1), integer(d + 1), integer(d + 1))
        if op == "load":
            return ("load", 0, integer(d + 1), integer(d + 1))
        return (op, integer(d + 1), integer(d + 1))

    def boolean(d):
        if d > 3 or rng.random() < 0.15:
            return ("const", rng.random() < 0.5)
        op = rng.choice(["lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "beq", "fcmp"])
        if op in ("and", "or"):
            return (op, boolean(d + 1), boolean(d + 1))
        if op == "not":
            return (op, boolean(d + 1))
        if op == "beq":
            return ("eq", boolean(d + 1), boolean(d + 1))
        if op == "fcmp":
            return ("lt", ("float", integer(d + 1)), ("const", 3.5))
        return (op, integer(d + 1), integer(d + 1))

    return boolean(depth)


def test_classify_is_sound_on_random_masks(rng):
    table = torch.randint(-6, 30, (N_HEADS, N_TOKENS), dtype=torch.int32)
    checked = 0
    for _ in range(150):
        v = Variant("mask_mod", random_mask_tree(rng), (("int32", 2),), (table,))
        for _ in range(8):
            box = random_box(rng, rng.choice([1, 2]))
            any_visible, any_hidden = brute_force(v, *box)
            for ranges in (False, True):  # classify, classify_warp
                verdict = interval.classify(v, *box, ranges=ranges)
                assert not (verdict == interval.EMPTY and any_visible), (v.key_text, box, ranges)
                assert not (verdict == interval.FULL and any_hidden), (v.key_text, box, ranges)
                checked += verdict != interval.PARTIAL
    assert checked > 0  # the analysis decides some tiles, not only PARTIAL


def test_interval_arithmetic_widens_a_range_to_int32_on_overflow_wraps_a_value_and_floors_like_python():
    assert interval.iv_add((2 ** 31 - 2, 2 ** 31 - 1), (1, 1)) == interval.FULL_INT
    assert interval.iv_add((2 ** 31 - 1, 2 ** 31 - 1), (1, 1)) == (-2 ** 31, -2 ** 31)  # as the kernel's int
    assert interval.iv_floordiv((-2 ** 31, -2 ** 31), (-1, -1)) == (-2 ** 31, -2 ** 31)  # variant.cuh's floordiv
    assert interval.iv_neg((-2 ** 31, 0)) == interval.FULL_INT
    for a in [(-7, 5), (3, 3), (-9, -2)]:
        for d in [(-3, 2), (2, 2), (-4, -1), (0, 0), (1, 5)]:
            values = [x // y if y else 0 for x in range(a[0], a[1] + 1) for y in range(d[0], d[1] + 1)]
            lo, hi = interval.iv_floordiv(a, d)
            assert lo <= min(values) and max(values) <= hi and lo in values and hi in values
            mods = [x % y if y else 0 for x in range(a[0], a[1] + 1) for y in range(d[0], d[1] + 1)]
            lo, hi = interval.iv_mod(a, d)
            assert lo <= min(mods) and max(mods) <= hi


# ---------------------------------------------------------------- the rendered text
def test_constants_print_exactly():
    assert render.float_literal(0.1) == "0.100000001f"
    assert render.float_literal(2.0) == "2.0f" and render.float_literal(-0.5) == "(-0.5f)"
    assert render.float_literal(math.inf) == "INFINITY" and render.float_literal(-1e300) == "(-INFINITY)"
    assert render.int_literal(-2 ** 31) == "(-2147483647 - 1)" and render.int_literal(-3) == "(-3)"
    for value in (0.1, 1 / 3, 12345.678, -7e-20, 1e-30, 3.4e38):
        printed = render.float_literal(value).strip("()").rstrip("f")
        as_fp32 = torch.tensor(float(printed), dtype=torch.float32)  # what the C++ compiler reads
        assert as_fp32.item() == torch.tensor(value, dtype=torch.float32).item()


def test_common_subexpressions_are_emitted_once():
    bias = torch.randn(N_HEADS, N_TOKENS)
    v = trace_score_mod(lambda s, b, h, q, kv: s + bias[h, q - kv] * bias[h, q - kv] + (q - kv))
    source = render_score_mod(v)
    score = source[source.index("float score("):source.index("float dscore(")]
    assert score.count("load_float32") == 1 and score.count("isub") == 1


def test_positions_are_fp32_arithmetic_and_a_bias_is_one_fma_on_the_logit():
    """float(q_idx - kv_idx + c) becomes float(q_idx) - float(kv_idx) + c (no int to float
    conversion per element), and score + g becomes fmaf(g, inv_scale, s); an index into a table
    stays an int. The calls bound positions so that the fp32 arithmetic is exact."""
    def score_body(fn):
        source = render_score_mod(trace_score_mod(fn))
        return source[source.index("float score("):source.index("float dscore(")]

    relative = score_body(gallery.relative_position)
    assert "(float(q_idx) - float(kv_idx))" in relative and "isub" not in relative
    assert "fmaf(t0, inv_scale, s)" in relative and "s * scale" not in relative
    shifted = score_body(lambda s, b, h, q, kv: (kv + 3 - q) * 0.5 + s)
    assert "(float(kv_idx) - float(q_idx) + 3.0f)" in shifted and "fmaf(" in shifted
    assert "fmaf(t0, -inv_scale, s)" in score_body(lambda s, b, h, q, kv: s - q)
    for fn in (lambda s, b, h, q, kv: q - s, lambda s, b, h, q, kv: s * (q - kv)):
        assert "fmaf(" not in score_body(fn) and "* inv_scale;" in score_body(fn)  # not a bias
    assert "float(kv_idx) - float(q_idx)" not in score_body(lambda s, b, h, q, kv: s + (2 * kv - q))
    assert render.float_positions(trace_score_mod(gallery.relative_position))
    table = trace_score_mod(gallery.bias_table(torch.zeros(2, 9), 4))
    assert not render.float_positions(table) and "iadd" in render_score_mod(table)


def test_a_bias_affine_in_kv_idx_renders_its_slope_per_row_and_others_none():
    """kv_affine: score +- g with g = A * kv_idx + (free of kv_idx) gives (sign, A), which the
    forward's tile loop uses as one FMA per logit (templates/varlen/fwd_softmax.cuh); anything
    else (a table read at kv_idx, |q - kv|, a product with the score) is not affine."""
    slopes = torch.rand(4)
    table = torch.rand(4, 9)
    cases = {
        gallery.relative_position: (1, ("const", -1.0)),
        (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)): (1, ("load", 0, ("arg", "h"))),
        (lambda s, b, h, q, kv: s - slopes[h] * (q - kv) / 2): (-1, ("div", ("neg", ("load", 0, ("arg", "h"))),
                                                                     ("const", 2.0))),
        (lambda s, b, h, q, kv: s + (kv - q) * slopes[h] * 0.5): (1, ("mul", ("load", 0, ("arg", "h")),
                                                                        ("const", 0.5))),
        (lambda s, b, h, q, kv: s + (2 * kv - q) * slopes[h]): None,  # kv_idx only through +-, as _float_positions
        (lambda s, b, h, q, kv: s + slopes[h] * q): None,  # free of kv_idx: nothing to factor
        (lambda s, b, h, q, kv: s + table[h, q - kv + 4]): None,
        (lambda s, b, h, q, kv: s - slopes[h] * (q - kv).abs()): None,
        (lambda s, b, h, q, kv: s * (q - kv)): None,
        (lambda s, b, h, q, kv: s + (kv - q) * (kv - q)): None,
    }
    for fn, want in cases.items():
        v = trace_score_mod(fn)
        assert render.kv_affine(v) == want, v.key_text
        source = render_score_mod(v)
        assert f"KV_AFFINE = {'true' if want else 'false'};" in source
    alibi = render_score_mod(trace_score_mod(lambda s, b, h, q, kv: s - slopes[h] * (q - kv)))
    slope_body = alibi[alibi.index("kv_slope("):]
    assert "load_float32(caps[0], h)" in slope_body and "kv_idx" not in slope_body and "-inv_scale" in slope_body


def test_pair_reads_marks_a_table_read_at_both_positions_only():
    slopes, table, per_key = torch.rand(4), torch.rand(4, 9), torch.rand(64)
    cases = {
        (lambda s, b, h, q, kv: s + table[h, q - kv + 4]): True,
        (lambda s, b, h, q, kv: s + table[h, (q - kv).abs().clamp(max=8)]): True,
        (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)): False,  # positions outside the read
        (lambda s, b, h, q, kv: s + per_key[kv] + slopes[q % 4]): False,  # each read varies along one side
        (lambda s, b, h, q, kv: s * 2): False,
    }
    for fn, want in cases.items():
        v = trace_score_mod(fn)
        assert render.pair_reads(v) is want, v.key_text
        assert f"PAIR_READS = {'true' if want else 'false'};" in render_score_mod(v)


ALLOWED_WORDS = set("""
struct static constexpr bool ACTIVE KV_AFFINE PAIR_READS UNIT_SLOPE kv_slope true false const jitattn_variant Capture caps float int scale
inv_scale template
class Params __device__ __forceinline__ __host__ explicit p captures nullptr score s b h q_idx kv_idx return dscore sc
MaskMod ScoreMod DATA_DEPENDENT USES_HEAD pack visible TileClass classify kv_head q_lo q_hi kv_lo kv_hi TILE_EMPTY TILE_FULL TILE_PARTIAL
may_true may_false lo hi long INFINITY IInt IBool IFloat The user s score_mod mask_mod rendered by jitattn variants
render py from the tree returns f scale dscore per element tile interval analysis sound e fmaf
classify_warp also reads captures over index ranges by the whole warp mask map i0 i1 i2 i3 iv_read iv_bool_of
Preloaded preload pre
""".split()) | {f"load_{d}" for d in ("float32", "float16", "bfloat16", "int32", "int64", "bool")} | \
    set(render.INT_FUNCTIONS.values()) | set(render.FLOAT_FUNCTIONS.values()) | {"fminimum", "fmaximum"} | \
    {f"iv_{op}" for op in ("exact", "full", "is_exact", "bool", "unknown", "add", "sub", "mul", "neg", "abs", "min",
                           "max", "floordiv", "mod", "where", "bwhere", "lt", "le", "gt", "ge", "eq", "ne", "beq",
                           "bne", "and", "or", "not")}


def test_rendered_code_uses_only_jitattns_own_words_on_random_trees(rng):
    from tests.test_variants_trace import random_valid_tree

    for _ in range(100):
        for kind in ("score_mod", "mask_mod"):
            v = Variant(kind, random_valid_tree(rng, kind), (("float32", 1), ("int32", 2)))
            source = render_score_mod(v) if kind == "score_mod" else render_mask_mod(v)
            comments = [line for line in source.splitlines() if line.startswith("//")]
            assert f"// {v.digest}: " in source and len(comments) == (3 if kind == "mask_mod" else 2)
            code = "\n".join(line for line in source.splitlines() if not line.startswith("//"))
            words = set(re.findall(r"[A-Za-z_]\w*", code))
            stray = {w for w in words - ALLOWED_WORDS if not re.fullmatch(r"[tdvar]\d+|f|e\d*", w)}
            assert not stray, (stray, v.key_text)


def test_render_refuses_the_wrong_kind():
    with pytest.raises(TypeError):
        render_score_mod(trace_mask_mod(lambda b, h, q, kv: q >= kv))
    with pytest.raises(TypeError):
        render_mask_mod(trace_score_mod(lambda s, b, h, q, kv: s))


# ---------------------------------------------------------------- real builds
def every_op_variants():
    """One score_mod and one mask_mod that use every op and every capture dtype."""
    f16, bf16, i64 = torch.randn(4, dtype=torch.float16), torch.randn(2, 3, dtype=torch.bfloat16), torch.arange(5)
    flags, scalar = torch.rand(3, 4, 5, 6) > 0.5, torch.tensor(2, dtype=torch.int32)

    def score(s, b, h, q, kv):
        i = (q // 3) % scalar - abs(kv - q) * 2 + torch.minimum(q, kv) - torch.maximum(-q, kv)
        x = torch.exp(s) + torch.exp2(s) + torch.log(s) + torch.tanh(s) + torch.sigmoid(s) + torch.sqrt(s)
        y = torch.where(flags[b, h, q, kv] & ~(i > 1) | (q != kv), f16[h] / s, bf16[b, i] - s)
        return torch.minimum(x, y) * torch.maximum(-x, abs(y)) + i64[h] * 0.5 + (q == kv).float() - 2147483647
    def mask(b, h, q, kv):
        return (flags[b, h, q, kv] == (q < kv)) | (i64[q % 5] // (kv + 1) >= -2147483647 - 1) & (f16[h] > 0.5)
    return trace_score_mod(score), trace_mask_mod(mask)


def all_rendered(qualifiers="__device__ __forceinline__"):
    variants = [trace_score_mod(fn) for fn in score_variants().values()]
    variants += [trace_mask_mod(fn) for name, (kind, fn, _) in acceptance_set().items() if kind == "mask_mod"]
    variants += list(every_op_variants())
    sources = [render_score_mod(v, qualifiers) if v.kind == "score_mod" else render_mask_mod(v, qualifiers)
               for v in variants]
    return variants, sources


PRELUDE = """#include "variant.cuh"
enum TileClass { TILE_EMPTY, TILE_PARTIAL, TILE_FULL };
struct Params { jitattn_variant::Capture captures[8]; float scale; int pack; };
"""


def nvcc():
    require_nvcc()
    from jitattn.jit import toolchain

    home, _ = toolchain.resolve_cuda_home()
    return str(home / "bin" / "nvcc")


@pytest.mark.compile
def test_every_rendered_variant_compiles_for_sm90a(tmp_path):
    compiler = nvcc()
    variants, sources = all_rendered()
    calls = []
    for i, v in enumerate(variants):
        if v.kind == "score_mod":
            calls.append(f"{{ const v{i}::ScoreMod m(p); const float x = m.score(s, b, h, q, kv); "
                         f"out[{i}] = x + m.dscore(s, x, b, h, q, kv); }}")
        else:
            calls.append(f"{{ const v{i}::MaskMod m(p); out[{i}] = m.visible(b, h, q, kv) + "
                         f"int(m.classify(b, h, q, q + 63, kv, kv + 63)) + "
                         f"int(m.classify(m.preload(b), b, h, q, q + 63, kv, kv + 63)); }}")
    body = "".join(f"namespace v{i} {{\n{source}}}\n" for i, source in enumerate(sources))
    kernel = ("__global__ void probe(const Params p, float* out, float s, int b, int h, int q, int kv) {\n"
              + "\n".join(calls) + "\n}\n")
    (tmp_path / "probe.cu").write_text(PRELUDE + body + kernel)
    result = subprocess.run([compiler, "-arch=sm_90a", "-std=c++17", "-Werror", "all-warnings", "-I", TEMPLATES,
                             "-c", "probe.cu", "-o", "probe.o"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "probe.o").stat().st_size > 0


def c_array(tensor):
    flat = tensor.contiguous().view(-1)
    if tensor.dtype == torch.bool:
        return "uint8_t", [str(int(x)) for x in flat.tolist()]
    if tensor.dtype in (torch.float16, torch.bfloat16):
        bits = flat.view(torch.int16).tolist()
        return "uint16_t", [str(x & 0xFFFF) for x in bits]
    ctype = {torch.float32: "float", torch.int32: "int32_t", torch.int64: "int64_t"}[tensor.dtype]
    return ctype, [repr(float(x)) + "f" if ctype == "float" else f"{int(x)}LL" for x in flat.tolist()]


@pytest.mark.compile
def test_a_host_build_of_the_rendered_code_agrees_with_the_mirror_and_the_reference(tmp_path, rng):
    """The rendered visible/classify/score/dscore and variant.cuh's helpers, compiled by nvcc
    for the host and run: classify equals interval.py's verdict, visible the reference, score and
    dscore the float64 reference within fp32 error."""
    compiler = nvcc()
    variants, sources = all_rendered("__host__ __device__ __forceinline__")
    table = torch.randint(-6, 30, (N_HEADS, N_TOKENS), dtype=torch.int32)
    randoms = [Variant("mask_mod", random_mask_tree(rng), (("int32", 2),), (table,)) for _ in range(40)]
    # the transformers padding mask's shape: a per-sequence flag (bool), then a per-row start
    whole = torch.rand(N_SEQ) < 0.5
    first = torch.randint(0, 4, (N_SEQ,), dtype=torch.int32)
    keys = torch.rand(N_SEQ, N_TOKENS + 4) < 0.7
    randoms += [trace_mask_mod(lambda b, h, q_idx, kv_idx: whole[b] | keys[b // 2, first[b] + kv_idx]),
                trace_mask_mod(lambda b, h, q_idx, kv_idx: ~whole[b // 2] & (q_idx >= kv_idx))]
    variants += randoms
    sources += [render_mask_mod(v, "__host__ __device__ __forceinline__") for v in randoms]
    parts, setup = [PRELUDE, "#include <cstdio>\n"], []
    for i, (v, source) in enumerate(zip(variants, sources)):
        parts.append(f"namespace v{i} {{\n{source}}}\n")
        for slot, t in enumerate(v.tensors):
            ctype, values = c_array(t)
            parts.append(f"static const {ctype} c{i}_{slot}[] = {{{', '.join(values) or '0'}}};\n")
            sizes = list(t.shape) + [1] * (4 - t.dim())
            strides = list(t.contiguous().stride()) + [0] * (4 - t.dim())
            setup.append(f"  params[{i}].captures[{slot}] = jitattn_variant::Capture{{c{i}_{slot}, "
                         f"{{{', '.join(map(str, strides))}}}, {{{', '.join(map(str, sizes))}}}}};")
    cases = []
    for i, v in enumerate(variants):
        if v.kind == "score_mod":
            # The KV_AFFINE split: s + kv_slope * (kv - origin) per logit, score(0, ..., origin) once
            # per row. The forward's origin is near the row's q_idx (fwd_softmax.cuh: q - 3 here),
            # the backward's the key tile's first key (backward_common.cuh: kv rounded down to 128).
            split = ("fmaf(float(kv - ORIGIN), m.kv_slope(b, h, q), s) + m.score(0.f, b, h, q, ORIGIN)")
            cases.append(f"    case {i}: {{ const v{i}::ScoreMod m(params[{i}]);"
                         " const float y = m.score(s, b, h, q, kv);"
                         f" const bool affine = v{i}::ScoreMod::KV_AFFINE;"
                         f" const float fwd = affine ? {split.replace('ORIGIN', '(q - 3)')} : y;"
                         f" const float bwd = affine ? {split.replace('ORIGIN', '(kv & ~127)')} : y;"
                         f" printf(\"%.9g %.9g %.9g %.9g\\n\", y, m.dscore(s, y, b, h, q, kv), fwd, bwd); break; }}")
        else:
            cases.append(f"    case {i}: {{ const v{i}::MaskMod m(params[{i}]); printf(\"%d %d %d %d\\n\", "
                         f"int(m.visible(b, h, q, kv)), int(m.classify(b, kvh, qlo, qhi, kvlo, kvhi)), "
                         f"int(m.classify_warp(b, kvh, qlo, qhi, kvlo, kvhi)), "
                         f"int(m.classify(m.preload(b), b, kvh, qlo, qhi, kvlo, kvhi))); break; }}")
    parts.append(f"static Params params[{len(variants)}];\nint main() {{\n" + "\n".join(setup) + """
  int i, b, h, q, kv, kvh, pack, qlo, qhi, kvlo, kvhi; float s, scale;
  while (scanf("%d %f %f %d %d %d %d %d %d %d %d %d %d", &i, &s, &scale, &b, &h, &q, &kv, &kvh, &pack, &qlo, &qhi,
               &kvlo, &kvhi) == 13) {
    params[i].scale = scale; params[i].pack = pack;
    switch (i) {
""" + "\n".join(cases) + "\n    }\n  }\n  return 0;\n}\n")
    (tmp_path / "host.cu").write_text("".join(parts))
    built = subprocess.run([compiler, "-std=c++17", "-I", TEMPLATES, "host.cu", "-o", "host"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]

    queries, expected = [], []
    for i, v in enumerate(variants):
        for _ in range(60):
            scale = rng.choice([1.0, 0.125, 0.0883883476])
            s = rng.uniform(-40, 40) if rng.random() < 0.9 else rng.uniform(-0.3, 0.3)
            s = float(torch.tensor(s, dtype=torch.float32))
            pack = rng.choice([1, 2, 3])
            box = random_box(rng, pack)
            b, kvh = box[0], box[1]
            h = kvh * pack + rng.randrange(pack)
            q, kv = rng.randrange(-2, N_TOKENS + 2), rng.randrange(-2, N_TOKENS + 2)
            if v.kind == "mask_mod":
                q, kv = rng.randint(box[3], box[4]), rng.randint(box[5], box[6])
            queries.append(f"{i} {s!r} {scale!r} {b} {h} {q} {kv} {kvh} {pack} {' '.join(map(str, box[3:]))}")
            expected.append((v, s, scale, b, h, q, kv, box))
    ran = subprocess.run([str(tmp_path / "host")], input="\n".join(queries) + "\n", capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert len(lines) == len(queries)
    affine_checked = preloads = 0
    for line, (v, s, scale, b, h, q, kv, box) in zip(lines, expected):
        first, second, *split = line.split()
        if v.kind == "mask_mod":
            assert bool(int(first)) == bool(reference_mask(v, b, h, q, kv)), (v.key_text, b, h, q, kv)
            for ranges, got in ((False, second), (True, split[0])):  # classify, classify_warp
                verdict = [interval.EMPTY, interval.PARTIAL, interval.FULL][int(got)]
                assert verdict == interval.classify(v, *box, ranges=ranges), (v.key_text, box, ranges)
            # classify(preload(b), ...): the sequence's own reads made ahead, the same verdict
            assert split[1] == second, (v.key_text, box)
            preloads += bool(render.sequence_reads(Shared(v.tree, v.captures)))
            continue
        x = torch.tensor(s * scale, dtype=torch.float64)
        want = reference_score(v, x, b, h, q, kv).item()
        slope = reference_score(derivative(v), x, b, h, q, kv).item()
        got, got_slope = float(first) * scale, float(second)
        for g, w in ((got, want), (got_slope, slope)):
            if math.isnan(w):
                assert math.isnan(g), (v.key_text, s, w, g)
            elif math.isinf(w):
                assert g == w, (v.key_text, s, w, g)
            else:
                assert abs(g - w) <= 2e-5 * abs(w) + 2e-5 * max(1.0, abs(s * scale)), (v.key_text, s, w, g)
        if render.kv_affine(v) is not None and math.isfinite(want):
            # the split scores what score() does, within fp32 rounding of the larger terms
            affine_checked += 1
            bias = abs(float(first) - s) + abs(q - kv) + 3 + abs(kv) % 128
            for value in split:  # the forward's, then the backward's
                assert abs(float(value) - float(first)) <= 4e-6 * (abs(float(first)) + bias / scale) + 1e-5, \
                    (v.key_text, s, q, kv, first, split)
    assert affine_checked >= 60  # the gallery's relative position and ALiBi at least
    assert preloads >= 60  # document masks, prefix-LM and random trees read b's own values


@pytest.mark.compile
def test_variant_math_helpers_are_accurate_to_a_few_ulp_on_the_host(tmp_path, rng):
    """vtanh (polynomial below 1/4, exp2 form above), vsigmoid, vexp and the floor division / modulo
    helpers, built by nvcc for the host (where vexp2 is exp2f: the device's ex2.approx is the GPU
    suite's to check), against float64 and Python."""
    compiler = nvcc()
    program = """#include "variant.cuh"
#include <cstdio>
int main() {
  float x; int a, d;
  while (scanf("%f %d %d", &x, &a, &d) == 3)
    printf("%.9g %.9g %.9g %d %d\\n", jitattn_variant::vtanh(x), jitattn_variant::vsigmoid(x), jitattn_variant::vexp(x),
           jitattn_variant::floordiv(a, d), jitattn_variant::mod(a, d));
  return 0;
}
"""
    (tmp_path / "math.cu").write_text(program)
    built = subprocess.run([compiler, "-std=c++17", "-I", TEMPLATES, "math.cu", "-o", "math"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    xs = torch.cat([torch.randn(3000) * 3, torch.randn(1000) * 0.2, torch.randn(500) * 1e-4,
                    torch.tensor([0.0, -0.0, 0.25, -0.25, 0.2499999, 20.0, -20.0, 88.0, -100.0])]).tolist()
    any_int = lambda: rng.randint(-2 ** 31, 2 ** 31 - 1)  # noqa: E731
    pairs = [(any_int(), rng.choice([0, -1, 1, 7, -7, any_int()])) for _ in xs]
    pairs[:3] = [(-2 ** 31, -1), (-2 ** 31, 0), (-7, 2)]
    text = "\n".join(f"{x!r} {a} {d}" for x, (a, d) in zip(xs, pairs)) + "\n"
    ran = subprocess.run([str(tmp_path / "math")], input=text, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0
    rows = [line.split() for line in ran.stdout.splitlines()]
    assert len(rows) == len(xs)
    for x, (a, d), (tanh, sigmoid, exp, floordiv, mod) in zip(xs, pairs, rows):
        x64 = torch.tensor(x, dtype=torch.float64)
        ulp = lambda v: max(abs(v), 1e-30) * 2.0 ** -23  # noqa: E731
        want = math.tanh(x)
        assert abs(float(tanh) - want) <= 4 * ulp(want) + 1e-37, (x, tanh, want)
        want = torch.sigmoid(x64).item()  # for x < 0 it is about e^x: e^x's |x| ulp apply
        assert abs(float(sigmoid) - want) <= (4 + max(0.0, -x)) * ulp(want) + 1e-37, (x, sigmoid, want)
        want = math.exp(x) if x < 88 else math.inf
        assert abs(float(exp) - want) <= (4 + abs(x)) * ulp(want) or float(exp) == want, (x, exp, want)
        want_div = 0 if d == 0 else (a // d + 2 ** 31) % 2 ** 32 - 2 ** 31
        want_mod = 0 if d == 0 else a % d
        assert (int(floordiv), int(mod)) == (want_div, want_mod), (a, d)


def test_variant_cuh_reads_the_same_through_the_templates_jinja_environment():
    """The kernels pull variant.cuh in with a Jinja include: it must hold no Jinja syntax."""
    import jinja2

    from jitattn.jit import render as jit_render

    root = jit_render.templates_dir()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(root)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    text = (root / "varlen" / "variant.cuh").read_text()
    assert env.get_template("varlen/variant.cuh").render() == text
    assert not re.search(r"\{\{|\{%|\{#", text)


def test_a_mask_that_reads_captured_tensors_asks_for_a_mask_map():
    """Interval analysis cannot see tensor values: a mask_mod reading a capture is classified on the
    device (templates/varlen/mask_map.cuh), per KV head only when it reads h."""
    from jitattn.variants import gallery, mask_map_needs, trace_mask_mod

    doc = torch.zeros(2, 8, dtype=torch.int32)
    head_flags = torch.ones(4, dtype=torch.bool)
    cases = {"causal": (gallery.causal, (False, False)),
             "document": (gallery.document(doc), (True, False)),
             "prefix": (gallery.prefix_lm(torch.ones(2, dtype=torch.int32)), (True, False)),
             "by head": (lambda b, h, q_idx, kv_idx: head_flags[h] & (q_idx >= kv_idx), (True, True)),
             "index by head": (lambda b, h, q_idx, kv_idx: (h % 2 == 0) | (q_idx >= kv_idx), (False, True))}
    for name, (fn, want) in cases.items():
        v = trace_mask_mod(fn)
        assert mask_map_needs(v) == want, name
        source = render_mask_mod(v)
        assert f"DATA_DEPENDENT = {'true' if want[0] else 'false'};" in source, name
        assert f"USES_HEAD = {'true' if want[1] else 'false'};" in source, name


def test_the_kernels_that_take_a_mask_map():
    """A data-dependent mask_mod gives the prefill forward and the backward a mask map; the decode
    tile (generation: a launch per call would cost more than it saves) and masks interval
    analysis decides take none."""
    from jitattn.variants import gallery, trace_mask_mod
    from jitattn.varlen.spec import VarlenBackwardSpec, VarlenSpec

    document = trace_mask_mod(gallery.document(torch.zeros(2, 8, dtype=torch.int32))).key_text
    causal = trace_mask_mod(gallery.causal).key_text
    assert VarlenSpec(head_dim=128, dtype="bfloat16", mask_mod=document).params()["mask_map"]
    assert not VarlenSpec(head_dim=128, dtype="bfloat16", decode=True, mask_mod=document).params()["mask_map"]
    assert VarlenBackwardSpec(head_dim=128, dtype="bfloat16", mask_mod=document).params()["mask_map"]
    assert not VarlenSpec(head_dim=128, dtype="bfloat16", mask_mod=causal).params()["mask_map"]
    assert not VarlenBackwardSpec(head_dim=128, dtype="bfloat16", mask_mod=causal).params()["mask_map"]


def test_a_call_builds_its_mask_map_only_where_it_pays_and_stays_bounded():
    """mask_map_flag: () for kernels without a map; else build it from MASK_MAP_MIN_TILES tiles on
    the scanned side, and never past MASK_MAP_MAX_BYTES (16 bytes a work unit, per KV head when
    the mask reads h)."""
    from jitattn.variants import gallery, trace_mask_mod
    from jitattn.varlen.spec import MASK_MAP_MAX_BYTES, MASK_MAP_MIN_TILES, VarlenSpec, mask_map_flag, mask_map_layout

    document = trace_mask_mod(gallery.document(torch.zeros(2, 8, dtype=torch.int32))).key_text
    flags = torch.ones(8, dtype=torch.bool)
    by_head = trace_mask_mod(lambda b, h, q, kv: flags[h] | (q >= kv)).key_text
    spec = mask_map_layout(VarlenSpec(head_dim=128, dtype="bfloat16", mask_mod=document))
    tile = VarlenSpec(head_dim=128, dtype="bfloat16", mask_mod=document).block_n
    assert mask_map_flag(mask_map_layout(VarlenSpec(head_dim=128, dtype="bfloat16")), 10 ** 6, tile, 8, 8) == ()
    assert mask_map_flag(spec, MASK_MAP_MIN_TILES * tile + 1, tile, 256, 8) == (True,)
    assert mask_map_flag(spec, MASK_MAP_MIN_TILES * tile, tile, 256, 8) == (False,)
    units = MASK_MAP_MAX_BYTES // 16
    assert mask_map_flag(spec, 10 ** 6, tile, units, 8) == (True,)
    assert mask_map_flag(spec, 10 ** 6, tile, units + 1, 8) == (False,)
    per_head = mask_map_layout(VarlenSpec(head_dim=128, dtype="bfloat16", mask_mod=by_head))
    assert mask_map_flag(per_head, 10 ** 6, tile, units // 8, 8) == (True,)
    assert mask_map_flag(per_head, 10 ** 6, tile, units // 8 + 1, 8) == (False,)


@pytest.mark.compile
def test_a_shared_memory_limit_the_runtime_refuses_is_an_error_naming_the_kernel(tmp_path):
    """common/launch.cuh's allow_dynamic_smem, which the varlen kernels call instead of ignoring
    cudaFuncSetAttribute's result (a template that outgrew its shared memory failed at launch with
    a bare "invalid argument"): built and run on this GPU-less host, the runtime refuses and the
    error names the kernel and the runtime's reason."""
    compiler = nvcc()
    (tmp_path / "probe.cu").write_text("""#include "common/launch.cuh"
#include <cstdio>
__global__ void probe_kernel() {}
int main() {
  try {
    jitattn::allow_dynamic_smem(probe_kernel, 300 * 1024, "probe's kernel", 0);
    std::printf("no error\\n");
  } catch (const std::runtime_error& e) {
    std::printf("%s\\n", e.what());
  }
  return 0;
}
""")
    built = subprocess.run([compiler, "-std=c++17", "-I", TEMPLATES.rsplit("/", 1)[0], "probe.cu", "-o", "probe"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    message = ran.stdout.strip()
    assert message.startswith("probe's kernel") and message != "no error", message
    assert len(message) > len("probe's kernel: "), message  # the runtime's reason (no device here), or the sizes
