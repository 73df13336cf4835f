"""Tracing score_mod / mask_mod into trees (issue 46 item 2): the acceptance set's trees, the
float64 reference against the user's own function, the whitelist's errors, the trace cache,
and parse_tree as the validator of trees from outside (bounds, fuzzing)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitattn.variants import (Variant, VariantError, parse_tree, reference_mask, reference_score, trace_mask_mod,
                              trace_score_mod)
from jitattn.variants import tree as tree_module

S, B, H, Q, KV = ("arg", "score"), ("arg", "b"), ("arg", "h"), ("arg", "q_idx"), ("arg", "kv_idx")
N_HEADS, N_SEQ, N_TOKENS, TABLE = 6, 3, 24, 64


def acceptance_set():
    """The issue's acceptance variants, written as FlexAttention users write them, with fresh
    captured tensors: name -> (kind, fn, expected tree)."""
    slopes = torch.rand(N_HEADS)
    bias = torch.randn(N_HEADS, TABLE)
    doc_id = torch.sort(torch.randint(0, 4, (N_SEQ, N_TOKENS)), dim=1).values
    prefix = torch.randint(0, N_TOKENS, (N_SEQ,), dtype=torch.int32)
    C, cap, W = TABLE // 2, 30.0, 5
    return {
        "relative_bias": ("score_mod", lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx),
                          ("add", S, ("float", ("sub", Q, KV)))),
        "alibi": ("score_mod", lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx),
                  ("add", S, ("mul", ("load", 0, H), ("float", ("sub", KV, Q))))),
        "bias_table": ("score_mod", lambda score, b, h, q_idx, kv_idx: score + bias[h, q_idx - kv_idx + C],
                       ("add", S, ("load", 0, H, ("add", ("sub", Q, KV), ("const", C))))),
        "soft_cap": ("score_mod", lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap),
                     ("mul", ("const", cap), ("tanh", ("div", S, ("const", cap))))),
        "causal": ("mask_mod", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, ("ge", Q, KV)),
        "sliding_window": ("mask_mod", lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= W),
                           ("and", ("ge", Q, KV), ("le", ("sub", Q, KV), ("const", W)))),
        "document": ("mask_mod", lambda b, h, q_idx, kv_idx: doc_id[b, q_idx] == doc_id[b, kv_idx],
                     ("eq", ("load", 0, B, Q), ("load", 0, B, KV))),
        "prefix_lm": ("mask_mod", lambda b, h, q_idx, kv_idx: (kv_idx < prefix[b]) | (q_idx >= kv_idx),
                      ("or", ("lt", KV, ("load", 0, B)), ("ge", Q, KV))),
    }


NAMES = list(acceptance_set())


def trace(kind, fn):
    return trace_score_mod(fn) if kind == "score_mod" else trace_mask_mod(fn)


def grid():
    """Broadcast index tensors over (b, h, q, kv), as the user's function sees real tensors."""
    b = torch.arange(N_SEQ).view(-1, 1, 1, 1)
    h = torch.arange(N_HEADS).view(1, -1, 1, 1)
    q = torch.arange(N_TOKENS).view(1, 1, -1, 1)
    kv = torch.arange(N_TOKENS).view(1, 1, 1, -1)
    return b, h, q, kv


@pytest.mark.parametrize("name", NAMES)
def test_each_acceptance_variant_traces_to_the_expected_tree(name):
    kind, fn, expected = acceptance_set()[name]
    v = trace(kind, fn)
    assert v.kind == kind and v.tree == expected
    assert json.loads(v.key_text)["tree"] == json.loads(json.dumps(expected))


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_equals_the_users_function_on_real_tensors(name):
    kind, fn, _ = acceptance_set()[name]
    v = trace(kind, fn)
    b, h, q, kv = grid()
    if kind == "score_mod":
        scores = torch.randn(N_SEQ, N_HEADS, N_TOKENS, N_TOKENS, dtype=torch.float64) * 20
        got = reference_score(v, scores, b, h, q, kv)
        want = fn(scores, b, h, q, kv).to(torch.float64)
        assert got.dtype == torch.float64 and got.shape == scores.shape
        torch.testing.assert_close(got, want.expand_as(got), rtol=1e-6, atol=1e-6)
    else:
        got = reference_mask(v, b, h, q, kv)
        want = fn(b, h, q, kv).expand(got.shape)
        assert got.dtype == torch.bool and torch.equal(got, want)
        assert 0 < got.sum() < got.numel()  # the data exercises both outcomes


@pytest.mark.parametrize("name", NAMES)
def test_key_text_round_trips_through_parse_tree(name):
    kind, fn, _ = acceptance_set()[name]
    v = trace(kind, fn)
    again = parse_tree(v.key_text, kind)
    assert again == v and again.key_text == v.key_text and again.digest == v.digest
    assert len(v.digest) == 12 and int(v.digest, 16) >= 0
    assert again.tensors == ()  # the text carries the key, never the values


def test_captures_are_deduplicated_by_identity_in_order_of_first_use():
    a, c = torch.randn(4), torch.randint(0, 9, (4, 5), dtype=torch.int32)
    v = trace_score_mod(lambda s, b, h, q, kv: s * a[h] + a[h] + c[h, q].float() - a[0].float() * 0 + c[h, kv])
    assert v.captures[:2] == (("float32", 1), ("int32", 2))
    assert v.tensors[0] is a and v.tensors[1] is c
    assert all(t is not None for t in v.tensors) and len(v.tensors) == len(v.captures)


def test_a_zero_dim_captured_tensor_acts_as_a_scalar_on_either_side():
    scale = torch.tensor(0.5)
    v = trace_score_mod(lambda s, b, h, q, kv: scale * s + s * scale)
    assert v.captures == (("float32", 0),)
    assert v.tree == ("add", ("mul", ("load", 0), S), ("mul", S, ("load", 0)))


def test_partial_indexing_reads_the_same_element_as_a_tuple_index():
    bias = torch.randn(3, 4, 5)
    nested = trace_score_mod(lambda s, b, h, q, kv: s + bias[h][q][kv])
    flat = trace_score_mod(lambda s, b, h, q, kv: s + bias[h, q, kv])
    assert nested == flat


def test_mixed_int_and_float_promote_like_torch_and_python_ints_fold_to_floats():
    v = trace_score_mod(lambda s, b, h, q, kv: s * 2 + q / 2 + (q - kv) * 0.5)
    two = ("const", 2.0)
    assert v.tree == ("add", ("add", ("mul", S, two), ("div", ("float", Q), two)),
                      ("mul", ("float", ("sub", Q, KV)), ("const", 0.5)))


def test_powers_expand_to_multiplications():
    v = trace_score_mod(lambda s, b, h, q, kv: s ** 3 + s ** 1 + s ** 0)
    cube = ("mul", ("mul", S, S), S)
    assert v.tree == ("add", ("add", cube, S), ("const", 1.0))


def test_minus_infinity_in_where_traces_as_an_infinite_constant():
    v = trace_score_mod(lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")))
    assert v.tree == ("where", ("ge", Q, KV), S, ("const", "-inf"))
    assert parse_tree(v.key_text, "score_mod") == v
    scores = torch.randn(4, 4, dtype=torch.float64)
    ref = reference_score(v, scores, 0, 0, torch.arange(4).view(-1, 1), torch.arange(4).view(1, -1))
    assert torch.isinf(ref).sum() == 6 and torch.equal(ref.tril(), scores.tril())


def test_torch_mask_combinators_trace():
    from torch.nn.attention.flex_attention import and_masks, or_masks

    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    window = lambda b, h, q, kv: q - kv <= 4  # noqa: E731
    both = trace_mask_mod(and_masks(causal, window))
    either = trace_mask_mod(or_masks(causal, window))
    b, h, q, kv = grid()
    assert torch.equal(reference_mask(both, b, h, q, kv), (causal(b, h, q, kv) & window(b, h, q, kv)).expand(
        N_SEQ, N_HEADS, N_TOKENS, N_TOKENS))
    assert torch.equal(reference_mask(either, b, h, q, kv), (causal(b, h, q, kv) | window(b, h, q, kv)).expand(
        N_SEQ, N_HEADS, N_TOKENS, N_TOKENS))


def test_functions_and_methods_of_the_whitelist_trace_and_match_torch():
    w = torch.randn(N_HEADS).abs() + 0.1
    def fn(s, b, h, q, kv):
        x = torch.sigmoid(s) + torch.exp(-s.abs()) + torch.exp2(s * 0.1) + torch.sqrt(s * s + 1) + torch.log(w[h])
        y = torch.minimum(s, q.float()) - torch.maximum(s, torch.clamp(kv - q, -3, 3).float())
        z = torch.where(torch.logical_and(q % 3 == 0, ~(kv // 2 > 5)) | torch.logical_not(q < kv), x, y)
        return z.tanh() + (-s).sigmoid() * (q - kv).abs()
    v = trace_score_mod(fn)
    b, h, q, kv = grid()
    scores = torch.randn(N_SEQ, N_HEADS, N_TOKENS, N_TOKENS, dtype=torch.float64) * 4
    torch.testing.assert_close(reference_score(v, scores, b, h, q, kv), fn(scores, b, h, q, kv), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- what is refused, by name
REFUSED = [
    ("torch.sin", lambda s, b, h, q, kv: torch.sin(s)),
    ("Tensor.cos", lambda s, b, h, q, kv: s.cos()),
    ("torch.softmax", lambda s, b, h, q, kv: torch.softmax(s, 0)),
    ("torch.nn.functional.relu", lambda s, b, h, q, kv: torch.nn.functional.relu(s)),
    ("xor", lambda s, b, h, q, kv: torch.where((q > 1) ^ (kv > 1), s, 0.0)),
    ("bitwise", lambda s, b, h, q, kv: torch.where((q & 1) == 0, s, 0.0)),
    ("torch.where", lambda s, b, h, q, kv: torch.where(q, s, 0.0)),
    ("// and %", lambda s, b, h, q, kv: s // 2),
    ("exponent", lambda s, b, h, q, kv: s ** 0.5),
    ("exponent", lambda s, b, h, q, kv: s ** 9),
    ("traced power", lambda s, b, h, q, kv: 2 ** s),
    ("control flow", lambda s, b, h, q, kv: s if q > kv else s * 0),
    ("control flow", lambda s, b, h, q, kv: max(s, q)),
    ("Python index", lambda s, b, h, q, kv: s + [1.0, 2.0][h]),
    ("int()", lambda s, b, h, q, kv: s + int(q)),
    ("bool", lambda s, b, h, q, kv: q > kv),
    ("torch.where", lambda s, b, h, q, kv: s + (q > kv)),
]


@pytest.mark.parametrize("needle,fn", REFUSED, ids=[f"{i}-{n}" for i, (n, _) in enumerate(REFUSED)])
def test_each_refused_operation_is_named_in_the_error(needle, fn):
    with pytest.raises(VariantError) as error:
        trace_score_mod(fn)
    assert needle in str(error.value) and str(error.value).startswith("score_mod")


def test_unsupported_torch_function_lists_what_is_supported():
    message = r"torch\.sin, which jitattn variants do not support; supported: .*torch\.where"
    with pytest.raises(VariantError, match=message):
        trace_score_mod(lambda s, b, h, q, kv: torch.sin(s))


def test_mask_mod_errors_name_mask_mod_and_its_result_must_be_a_bool():
    with pytest.raises(VariantError, match=r"^mask_mod returned a int"):
        trace_mask_mod(lambda b, h, q, kv: q - kv)
    with pytest.raises(VariantError, match=r"^mask_mod uses torch\.cos"):
        trace_mask_mod(lambda b, h, q, kv: torch.cos(q) > 0)
    with pytest.raises(VariantError, match="Python control flow"):
        trace_mask_mod(lambda b, h, q, kv: (q >= kv) and (q - kv < 4))


@pytest.mark.parametrize("make,needle", [
    (lambda: torch.randn(4, dtype=torch.float64), "float64"),
    (lambda: torch.zeros(1, 1, 1, 1, 2), "5-d"),
    (lambda: torch.randn(4, 4), "shape (4, 4) as a value"),
])
def test_captures_of_unsupported_dtype_rank_or_use_are_refused(make, needle):
    t = make()
    fn = (lambda s, b, h, q, kv: s * t) if "value" in needle else (lambda s, b, h, q, kv: s + t[(h,) * t.dim()])
    with pytest.raises(VariantError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        trace_score_mod(fn)


def test_indexing_rules_refuse_slices_negative_constants_float_indices_and_extra_dims():
    t = torch.randn(4, 4)
    for fn, needle in [(lambda s, b, h, q, kv: s + t[h, :], "slice"),
                       (lambda s, b, h, q, kv: s + t[h, -1], "negative constant"),
                       (lambda s, b, h, q, kv: s + t[h, s], "indices must be ints"),
                       (lambda s, b, h, q, kv: s + t[h, q, kv], "2-d captured tensor with 3 indices"),
                       (lambda s, b, h, q, kv: s + t[h], "partly indexed")]:
        with pytest.raises(VariantError, match=needle):
            trace_score_mod(fn)


def test_more_than_eight_captures_are_refused():
    tensors = [torch.randn(2) for _ in range(9)]
    def fn(s, b, h, q, kv):
        for t in tensors:
            s = s + t[h]
        return s
    with pytest.raises(VariantError, match="more than 8"):
        trace_score_mod(fn)


def test_out_of_int32_python_constants_are_refused():
    with pytest.raises(VariantError, match="int32"):
        trace_mask_mod(lambda b, h, q, kv: q - kv < 2 ** 31)


# ---------------------------------------------------------------- the trace cache
def test_the_trace_cache_returns_the_same_variant_while_nothing_changed():
    bias = torch.randn(4, 8)
    fn = lambda s, b, h, q, kv: s + bias[h, q]  # noqa: E731
    first = trace_score_mod(fn)
    assert trace_score_mod(fn) is first
    bias.add_(1.0)  # values change in place: read at call time, nothing to retrace
    assert trace_score_mod(fn) is first


def make_biased(bias):
    return lambda s, b, h, q, kv: s + bias[h, q]


def test_a_new_tensor_object_retraces_to_the_same_key_with_the_new_tensor():
    first_bias, second_bias = torch.randn(4, 8), torch.randn(4, 8)
    first = trace_score_mod(make_biased(first_bias))
    second = trace_score_mod(make_biased(second_bias))
    assert second is not first and second.key_text == first.key_text
    assert second.tensors[0] is second_bias and first.tensors[0] is first_bias
    assert trace_score_mod(make_biased(first_bias)).tensors[0] is first_bias  # a fresh lambda, a cache hit


GLOBAL_SLOPES = torch.rand(4)
GLOBAL_WINDOW = 3


def alibi_from_global(s, b, h, q, kv):
    return s + GLOBAL_SLOPES[h] * (kv - q)


def window_from_global(b, h, q, kv):
    return q - kv <= GLOBAL_WINDOW


def test_a_reassigned_global_retraces(monkeypatch):
    first = trace_score_mod(alibi_from_global)
    replacement = torch.rand(4)
    monkeypatch.setattr(f"{__name__}.GLOBAL_SLOPES", replacement)
    second = trace_score_mod(alibi_from_global)
    assert second.tensors[0] is replacement and second.key_text == first.key_text
    narrow = trace_mask_mod(window_from_global)
    monkeypatch.setattr(f"{__name__}.GLOBAL_WINDOW", 7)
    wide = trace_mask_mod(window_from_global)
    assert narrow.tree[2] == ("const", 3) and wide.tree[2] == ("const", 7)


def test_a_replaced_module_buffer_retraces():
    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(4, 8))

    module = Bias()
    fn = lambda s, b, h, q, kv: s + module.table[h, q]  # noqa: E731
    first = trace_score_mod(fn)
    module.table = torch.randn(4, 8)
    second = trace_score_mod(fn)
    assert second.tensors[0] is module.table and first.tensors[0] is not module.table


def test_callable_objects_are_traced_each_call():
    class Mask:
        def __call__(self, b, h, q, kv):
            return q >= kv

    mask = Mask()
    first, second = trace_mask_mod(mask), trace_mask_mod(mask)
    assert first == second and first is not second


# ---------------------------------------------------------------- parse_tree: the validator
def valid_text(tree, captures=(), kind="score_mod"):
    return json.dumps({"kind": kind, "tree": tree, "captures": captures}, separators=(",", ":"))


BAD_TREES = [
    (["sin", ["arg", "score"]], "unknown operation"),
    (["add", ["arg", "score"]], "add takes 2"),
    (["add", ["arg", "score"], ["arg", "q_idx"]], "types (float, int)"),
    (["div", ["arg", "q_idx"], ["arg", "kv_idx"]], "div does not take"),
    (["arg", "bias"], "argument is one of"),
    (["const", float("nan")], "finite"),
    (["const", 2 ** 31], "int32"),
    (["const", "1.5"], "not a number"),
    (["const", [1]], "not a number"),
    (["load", 0, ["arg", "h"]], "capture number"),
    (["float", ["arg", "q_idx"], ["arg", "q_idx"]], "float takes 1"),
    ([], "a node must be a list"),
    ("score", "a node must be a list"),
    ([7, 1], "a node must be a list"),
    (["where", ["arg", "score"], ["arg", "score"], ["arg", "score"]], "where does not take"),
    (["float", ["ge", ["arg", "q_idx"], ["arg", "kv_idx"]]], None),  # valid: a float cast of a bool
]


@pytest.mark.parametrize("tree,needle", BAD_TREES, ids=[str(i) for i in range(len(BAD_TREES))])
def test_parse_tree_refuses_bad_trees_naming_the_problem(tree, needle):
    text = json.dumps({"kind": "score_mod", "tree": tree, "captures": []}, allow_nan=True)
    if needle is None:
        assert parse_tree(text, "score_mod").tree == tree_module._as_tuples(tree)
        return
    with pytest.raises(VariantError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_tree(text, "score_mod")


def test_parse_tree_checks_kind_result_type_captures_and_index_counts():
    with pytest.raises(VariantError, match="expected a mask_mod"):
        parse_tree(valid_text(["arg", "score"]), "mask_mod")
    with pytest.raises(VariantError, match="must give a bool"):
        parse_tree(valid_text(["arg", "q_idx"], kind="mask_mod"), "mask_mod")
    with pytest.raises(VariantError, match="argument is one of"):
        parse_tree(valid_text(["gt", ["arg", "score"], ["const", 0.0]], kind="mask_mod"), "mask_mod")
    with pytest.raises(VariantError, match="ndim 2.* has 1 indices"):
        parse_tree(valid_text(["load", 0, ["arg", "h"]], [["float32", 2]]), "score_mod")
    with pytest.raises(VariantError, match="dtype 'float64'"):
        parse_tree(valid_text(["load", 0], [["float64", 0]]), "score_mod")
    with pytest.raises(VariantError, match="ndim 5"):
        parse_tree(valid_text(["load", 0], [["float32", 5]]), "score_mod")
    with pytest.raises(VariantError, match="indices must be ints"):
        parse_tree(valid_text(["load", 0, ["arg", "score"]], [["float32", 1]]), "score_mod")
    with pytest.raises(VariantError, match="exactly"):
        parse_tree(json.dumps({"kind": "score_mod", "tree": ["arg", "score"]}), "score_mod")
    with pytest.raises(VariantError, match="kind must be one of"):
        parse_tree(valid_text(["arg", "score"]), "other")


def test_parse_tree_bounds_text_depth_nodes_and_captures():
    deep = ["arg", "score"]
    for _ in range(tree_module.MAX_DEPTH):
        deep = ["neg", deep]
    with pytest.raises(VariantError, match="deeper than 48"):
        parse_tree(valid_text(deep), "score_mod")
    wide = ["arg", "b"]
    for _ in range(9):
        wide = ["add", wide, wide]  # 1023 nodes
    wide = ["float", ["neg", ["neg", wide]]]  # 1026 nodes, compact text under 16 KiB
    assert len(valid_text(wide)) <= 16384
    with pytest.raises(VariantError, match="more than 1024 nodes"):
        parse_tree(valid_text(wide), "score_mod")
    with pytest.raises(VariantError, match="at most 8"):
        parse_tree(valid_text(["arg", "score"], [["float32", 0]] * 9), "score_mod")
    with pytest.raises(VariantError, match="16384 bytes"):
        parse_tree(valid_text(["arg", "score"]) + " " * 16384, "score_mod")
    with pytest.raises(VariantError, match="not valid JSON"):
        parse_tree("[" * 16000, "score_mod")
    ok = ["arg", "score"]
    for _ in range(tree_module.MAX_DEPTH - 1):
        ok = ["neg", ok]
    assert parse_tree(valid_text(ok), "score_mod").tree[0] == "neg"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.floats(allow_nan=True) |
    st.sampled_from(["arg", "const", "load", "score", "q_idx", "inf", "-inf", "add", "where", "float32", "kind",
                     "tree", "captures", "score_mod", "mask_mod", "mul", "tanh", "ge", "and"]),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.sampled_from(["kind", "tree", "captures"]),
                                                                      children, max_size=3),
    max_leaves=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=JSON, captures=JSON, kind=st.sampled_from(["score_mod", "mask_mod"]))
def test_arbitrary_json_never_raises_anything_but_variant_error(tree, captures, kind):
    for text in (json.dumps({"kind": kind, "tree": tree, "captures": captures}), json.dumps(tree)):
        try:
            v = parse_tree(text, kind)
        except VariantError:
            continue
        assert parse_tree(v.key_text, kind) == v


def random_valid_tree(rng: random.Random, kind: str, depth: int = 0):
    """A random well-typed tree of the wanted type (captures: one float32 1-d, one int32 2-d)."""
    def of(t, d):
        if d > 4 or rng.random() < 0.25:
            if t == "float":
                return rng.choice([("arg", "score"), ("const", rng.uniform(-3, 3)), ("load", 0, of("int", d + 1))])
            if t == "int":
                return rng.choice([("arg", "q_idx"), ("arg", "kv_idx"), ("arg", "h"), ("const", rng.randint(-9, 9))])
            return ("const", rng.random() < 0.5)
        if t == "float":
            op = rng.choice(["add", "mul", "div", "tanh", "exp", "where", "float", "neg", "max"])
            if op in ("add", "mul", "div", "max"):
                return (op, of("float", d + 1), of("float", d + 1))
            if op == "where":
                return (op, of("bool", d + 1), of("float", d + 1), of("float", d + 1))
            if op == "float":
                return (op, of("int", d + 1))
            return (op, of("float", d + 1))
        if t == "int":
            op = rng.choice(["add", "sub", "mul", "floordiv", "mod", "abs", "load"])
            if op == "abs":
                return (op, of("int", d + 1))
            if op == "load":
                return ("load", 1, of("int", d + 1), of("int", d + 1))
            return (op, of("int", d + 1), of("int", d + 1))
        op = rng.choice(["lt", "ge", "eq", "and", "or", "not"])
        if op in ("and", "or"):
            return (op, of("bool", d + 1), of("bool", d + 1))
        if op == "not":
            return (op, of("bool", d + 1))
        return (op, of("int", d + 1), of("int", d + 1))
    tree = of("float" if kind == "score_mod" else "bool", depth)
    if kind == "mask_mod":
        tree = _without_score(tree)
    return tree


def _without_score(node):
    if node == ("arg", "score"):
        return ("const", 1.0)
    if node[0] in ("arg", "const"):
        return node
    if node[0] == "load":
        return node[:2] + tuple(_without_score(c) for c in node[2:])
    return (node[0], *(_without_score(c) for c in node[1:]))


@pytest.mark.parametrize("kind", ["score_mod", "mask_mod"])
def test_random_valid_trees_round_trip_and_any_single_corruption_is_caught_or_still_valid(kind, rng):
    captures = (("float32", 1), ("int32", 2))
    for _ in range(200):
        v = Variant(kind, random_valid_tree(rng, kind), captures)
        assert parse_tree(v.key_text, kind) == v
        text = v.key_text
        at = rng.randrange(len(text))
        corrupted = text[:at] + rng.choice('[]",0aZ-9.') + text[at + 1:]
        try:
            parse_tree(corrupted, kind)
        except VariantError:
            pass


def test_a_trace_that_shares_subtrees_is_bounded_by_its_expanded_size_without_expanding_it():
    def squares(n):
        def fn(s, b, h, q, kv):
            for _ in range(n):
                s = s * s
            return s
        return fn
    assert trace_score_mod(squares(9)).tree[0] == "mul"  # 1023 nodes expanded: within the bound
    with pytest.raises(VariantError, match="more than 1024 nodes"):
        trace_score_mod(squares(40))  # 2**41 nodes expanded at depth 41: refused at once, never walked


def test_torch_where_takes_its_keyword_names():
    v = trace_score_mod(lambda s, b, h, q, kv: torch.where(condition=q >= kv, input=s, other=0.0))
    assert v.tree == ("where", ("ge", Q, KV), S, ("const", 0.0))


def test_numpy_scalars_are_constants_like_python_numbers():
    import numpy as np

    v = trace_score_mod(lambda s, b, h, q, kv: np.float32(2.0) * s + np.int64(3))
    assert v.tree == ("add", ("mul", ("const", 2.0), S), ("const", 3.0))
    m = trace_mask_mod(lambda b, h, q, kv: (q >= kv) & np.bool_(True))
    assert m.tree == ("and", ("ge", Q, KV), ("const", True))


def test_bind_attaches_matching_tensors_to_a_parsed_variant_and_refuses_others():
    table = torch.randn(N_HEADS, TABLE)
    parsed = parse_tree(trace(*acceptance_set()["bias_table"][:2]).key_text, "score_mod")
    bound = parsed.bind([table])
    assert bound == parsed and bound.tensors[0] is table and parsed.tensors == ()
    for wrong in ([], [table.double()], [table[0]], [table, table]):
        with pytest.raises(VariantError, match="capture|capture slots"):
            parsed.bind(wrong)


def test_a_trace_that_captured_a_copy_it_made_is_not_cached_but_views_are():
    bias = torch.randn(4, 8, dtype=torch.float64)
    converted = lambda s, b, h, q, kv: s + bias.float()[h, q]  # noqa: E731
    first, second = trace_score_mod(converted), trace_score_mod(converted)
    assert first == second and first is not second and first.tensors[0] is not second.tensors[0]
    table = torch.randn(4, 8)
    viewed = lambda s, b, h, q, kv: s + table[1][q] + table.t()[kv, h]  # noqa: E731
    assert trace_score_mod(viewed) is trace_score_mod(viewed)


def test_the_trace_cache_keeps_no_captured_tensor_alive():
    import gc
    import weakref

    def make(bias):
        return lambda s, b, h, q, kv: s + bias[h, q]

    bias = torch.randn(4, 8)
    alive = weakref.ref(bias)
    v = trace_score_mod(make(bias))
    assert v.tensors[0] is bias
    del v, bias
    gc.collect()
    assert alive() is None
    fresh = torch.randn(4, 8)
    assert trace_score_mod(make(fresh)).tensors[0] is fresh
    def make_from_list(tables):
        return lambda s, b, h, q, kv: s + tables[0][h, q]

    tables = [torch.randn(4, 8)]
    alive = weakref.ref(tables[0])
    v = trace_score_mod(make_from_list(tables))
    del v, tables
    gc.collect()
    assert alive() is None  # held in a list the function saw: not kept by the cache either


def test_a_cached_variant_dropped_by_the_caller_comes_back_with_the_same_tensors():
    import gc

    table = torch.randn(4, 8)
    fn = lambda s, b, h, q, kv: s + table[h, q]  # noqa: E731
    key = trace_score_mod(fn).key_text
    gc.collect()
    again = trace_score_mod(fn)
    assert again.key_text == key and again.tensors[0] is table


def test_a_variant_reads_as_an_expression_in_logs():
    kind, fn, _ = acceptance_set()["prefix_lm"]
    v = trace(kind, fn)
    assert repr(v) == f"Variant(mask_mod {v.digest}: (kv_idx < c0[b]) | (q_idx >= kv_idx); captures: 1-d int32)"
    long = Variant("score_mod", ("add", S, ("const", 1.5)))
    assert repr(long).endswith("score + 1.5)")
    deep = S
    for _ in range(47):
        deep = ("add", deep, ("const", 123456.789))
    assert len(tree_module.expression(deep, limit=100)) == 100
