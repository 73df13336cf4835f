"""jitattn.varlen.checks: argument validation (CPU only) and the debug value checks.

Every invalid call raises the documented exception type with a message naming the argument;
valid CPU calls get past every check and stop only at the (last) CUDA-device check."""
import math
import re
from types import SimpleNamespace

import pytest
import torch

from jitattn.kernel import fresh_memos
from jitattn.varlen.checks import AuxRequest, VarlenArgs, check_varlen_args, check_varlen_values
from tests.conftest import missing_names

F16, BF16, I32 = torch.float16, torch.bfloat16, torch.int32


def i32(*values):
    return torch.tensor(values, dtype=I32)


def base(paged=False, h_q=4, h_kv=4, d=64, dtype=F16):
    """A valid call: 2 sequences (3 and 7 query rows; 5 and 7 keys), or a 3-page pool of 4."""
    args = {
        "query": torch.zeros(10, h_q, d, dtype=dtype),
        "key": torch.zeros(12, h_kv, d, dtype=dtype),
        "value": torch.zeros(12, h_kv, d, dtype=dtype),
        "cu_seq_q": i32(0, 3, 10),
        "cu_seq_k": i32(0, 5, 12),
        "max_q": 7,
        "max_k": 7,
        "scale": None,
        "window_size": (-1, -1),
        "enable_gqa": h_q != h_kv,
        "seqused_k": None,
        "block_table": None,
        "num_splits": None,
    }
    if paged:
        args["key"] = torch.zeros(3, 4, h_kv, d, dtype=dtype)
        args["value"] = torch.zeros(3, 4, h_kv, d, dtype=dtype)
        args["seqused_k"] = i32(5, 3)
        args["block_table"] = i32(2, 0, 1, -1).reshape(2, 2)
    return args


def call(paged=False, **overrides):
    args = base(paged)
    for name, value in overrides.items():
        args[name] = value() if callable(value) else value
    return check_varlen_args(**args)


def t(*shape, dtype=F16):
    return lambda: torch.zeros(shape, dtype=dtype)


def gqa(h_q, h_kv, enable, d=64):
    def build():
        args = base(h_q=h_q, h_kv=h_kv, d=d)
        args["enable_gqa"] = enable
        return args
    return build


P = {"paged": True}
# (id, overrides (dict, or a zero-arg function returning all arguments), exception, names in message)
INVALID = [
    # -- not tensors / wrong ranks
    ("query-list", {"query": [[0.0]]}, TypeError, ["query", "torch.Tensor"]),
    ("query-none", {"query": None}, TypeError, ["query"]),
    ("key-float", {"key": 1.0}, TypeError, ["key"]),
    ("value-none", {"value": None}, TypeError, ["value"]),
    ("query-rank-2", {"query": t(10, 256)}, ValueError, ["query", "3 dims"]),
    ("query-rank-4", {"query": t(1, 10, 4, 64)}, ValueError, ["query", "3 dims"]),
    ("key-rank-4-without-block-table", {"key": t(3, 4, 4, 64), "value": t(3, 4, 4, 64)}, ValueError,
     ["key", "3 dims", "block_table"]),
    ("value-rank-2", {"value": t(12, 256)}, ValueError, ["value", "3 dims"]),
    ("key-rank-3-with-block-table", {**P, "key": t(12, 4, 64)}, ValueError, ["key", "4 dims", "block_table"]),
    ("value-rank-3-with-block-table", {**P, "value": t(12, 4, 64)}, ValueError, ["value", "4 dims"]),
    ("cu-seq-q-list", {"cu_seq_q": [0, 3, 10]}, TypeError, ["cu_seq_q", "torch.Tensor"]),
    ("cu-seq-k-none-unpaged", {"cu_seq_k": None}, TypeError, ["cu_seq_k", "block_table"]),
    ("cu-seq-q-rank-2", {"cu_seq_q": lambda: i32(0, 3, 10)[None]}, ValueError, ["cu_seq_q", "1 dims"]),
    ("cu-seq-k-rank-0", {"cu_seq_k": lambda: torch.tensor(0, dtype=I32)}, ValueError, ["cu_seq_k", "1 dims"]),
    ("seqused-k-list", {"seqused_k": [5, 7]}, TypeError, ["seqused_k"]),
    ("seqused-k-rank-2", {"seqused_k": lambda: i32(5, 7)[None]}, ValueError, ["seqused_k", "1 dims"]),
    ("block-table-list", {**P, "block_table": [[0, 1], [2, 0]]}, TypeError, ["block_table"]),
    ("block-table-rank-1", {**P, "block_table": lambda: i32(0, 1)}, ValueError, ["block_table", "2 dims"]),
    # -- dtypes
    ("query-float32", {"query": t(10, 4, 64, dtype=torch.float32)}, TypeError, ["query", "float32"]),
    ("query-fp8", {"query": t(10, 4, 64, dtype=torch.float8_e4m3fn)}, TypeError, ["query", "float8_e4m3fn"]),
    ("key-bf16-query-f16", {"key": t(12, 4, 64, dtype=BF16)}, TypeError, ["key", "bfloat16", "float16"]),
    ("value-float32", {"value": t(12, 4, 64, dtype=torch.float32)}, TypeError, ["value", "float32"]),
    ("cu-seq-q-int64", {"cu_seq_q": lambda: torch.tensor([0, 3, 10])}, TypeError, ["cu_seq_q", "int32", "int64"]),
    ("cu-seq-k-float", {"cu_seq_k": lambda: torch.tensor([0.0, 5, 12])}, TypeError, ["cu_seq_k", "int32"]),
    ("seqused-k-int64", {"seqused_k": lambda: torch.tensor([5, 7])}, TypeError, ["seqused_k", "int32"]),
    ("block-table-int64", {**P, "block_table": lambda: torch.tensor([[2, 0], [1, -1]])}, TypeError,
     ["block_table", "int32"]),
    # -- shapes: head_dim and heads
    ("key-value-shape-mismatch", {"value": t(11, 4, 64)}, ValueError, ["key", "value", "(12, 4, 64)", "(11, 4, 64)"]),
    ("pool-shape-mismatch", {**P, "value": t(3, 8, 4, 64)}, ValueError, ["key", "value", "(3, 8, 4, 64)"]),
    ("head-dim-key-128-query-64", {"key": t(12, 4, 128), "value": t(12, 4, 128)}, ValueError,
     ["head_dim", "key", "query", "128", "64"]),
    ("head-dim-40", gqa(4, 4, False, d=40), ValueError, ["head_dim", "40"]),
    ("head-dim-16", gqa(4, 4, False, d=16), ValueError, ["head_dim", "16"]),
    ("head-dim-272", gqa(4, 4, False, d=272), ValueError, ["head_dim", "272"]),
    ("zero-query-heads", {"query": t(10, 0, 64)}, ValueError, ["query", "H_q"]),
    ("zero-kv-heads", {"key": t(12, 0, 64), "value": t(12, 0, 64)}, ValueError, ["key/value", "H_kv"]),
    ("heads-differ-without-gqa", gqa(8, 2, False), ValueError,
     ["Expect query and key/value to have the same number of heads", "enable_gqa", "H_q=8", "H_kv=2"]),
    ("gqa-8-over-3", gqa(8, 3, True), ValueError, ["multiple of kv heads", "enable_gqa", "H_q=8", "H_kv=3"]),
    ("gqa-more-kv-than-query-heads", gqa(2, 4, True), ValueError, ["multiple of kv heads", "H_q=2", "H_kv=4"]),
    ("paged-heads-differ-without-gqa", {**P, "key": t(3, 4, 2, 64), "value": t(3, 4, 2, 64)}, ValueError,
     ["enable_gqa", "H_kv=2"]),
    ("enable-gqa-int", {"enable_gqa": 1}, TypeError, ["enable_gqa", "bool"]),
    ("enable-gqa-none", {"enable_gqa": None}, TypeError, ["enable_gqa", "bool"]),
    ("page-size-0", {**P, "key": t(3, 0, 4, 64), "value": t(3, 0, 4, 64)}, ValueError, ["page_size"]),
    ("page-size-12", {**P, "key": t(3, 12, 4, 64), "value": t(3, 12, 4, 64)}, ValueError, ["page_size", "power of two"]),
    # -- batch metadata
    ("cu-seq-q-one-entry", {"cu_seq_q": lambda: i32(0), "cu_seq_k": lambda: i32(0)}, ValueError,
     ["cu_seq_q", "N+1 >= 2"]),
    ("cu-seq-q-empty", {"cu_seq_q": lambda: i32()}, ValueError, ["cu_seq_q"]),
    ("cu-seq-k-longer", {"cu_seq_k": lambda: i32(0, 5, 12, 12)}, ValueError, ["cu_seq_k", "cu_seq_q", "(4,)"]),
    ("cu-seq-k-shorter", {"cu_seq_k": lambda: i32(0, 12)}, ValueError, ["cu_seq_k", "(2,)"]),
    ("block-table-without-seqused-k", {**P, "seqused_k": None}, ValueError, ["block_table", "seqused_k"]),
    ("seqused-k-length-3", {"seqused_k": lambda: i32(1, 2, 3)}, ValueError, ["seqused_k", "(N,)", "(3,)"]),
    ("seqused-k-length-1-paged", {**P, "seqused_k": lambda: i32(5)}, ValueError, ["seqused_k", "(1,)"]),
    ("block-table-3-rows", {**P, "block_table": lambda: i32(0, 1, 2).reshape(3, 1)}, ValueError,
     ["block_table", "(3, 1)"]),
    # -- scalars
    ("max-q-negative", {"max_q": -1}, ValueError, ["max_q", "-1"]),
    ("max-k-float", {"max_k": 7.0}, TypeError, ["max_k", "int"]),
    ("max-q-bool", {"max_q": True}, TypeError, ["max_q", "int"]),
    ("max-k-tensor", {"max_k": lambda: torch.tensor(7)}, TypeError, ["max_k"]),
    ("max-q-none", {"max_q": None}, TypeError, ["max_q"]),
    ("scale-zero", {"scale": 0.0}, ValueError, ["scale must be greater than 0", "0.0"]),
    ("scale-negative", {"scale": -0.1}, ValueError, ["scale must be greater than 0", "-0.1"]),
    ("scale-nan", {"scale": math.nan}, ValueError, ["scale must be greater than 0", "nan"]),
    ("scale-inf", {"scale": math.inf}, ValueError, ["scale must be finite", "inf"]),
    ("scale-str", {"scale": "0.1"}, TypeError, ["scale"]),
    ("scale-bool", {"scale": True}, TypeError, ["scale"]),
    ("window-int", {"window_size": 3}, TypeError, ["window_size", "int"]),
    ("window-none", {"window_size": None}, TypeError, ["window_size"]),
    ("window-str", {"window_size": "-1,0"}, TypeError, ["window_size"]),
    ("window-three-entries", {"window_size": (-1, 0, 0)}, ValueError, ["window_size", "3"]),
    ("window-one-entry", {"window_size": [4]}, ValueError, ["window_size", "1"]),
    ("window-left-minus-2", {"window_size": (-2, 0)}, ValueError, ["window_size", "left", "-2"]),
    ("window-right-minus-3", {"window_size": (4, -3)}, ValueError, ["window_size", "right", "-3"]),
    ("window-float", {"window_size": (4.0, 0)}, TypeError, ["window_size", "left", "int"]),
    ("window-bool", {"window_size": (-1, False)}, TypeError, ["window_size", "right", "int"]),
    ("num-splits-zero", {"num_splits": 0}, ValueError, ["num_splits", "0"]),
    ("num-splits-negative", {"num_splits": -1}, ValueError, ["num_splits"]),
    ("num-splits-float", {"num_splits": 2.0}, TypeError, ["num_splits", "int"]),
    ("num-splits-bool", {"num_splits": True}, TypeError, ["num_splits", "int"]),
    ("softcap-negative", {"softcap": -1.0}, ValueError, ["softcap", "-1.0"]),
    ("softcap-nan", {"softcap": float("nan")}, ValueError, ["softcap", "nan"]),
    ("softcap-inf", {"softcap": float("inf")}, ValueError, ["softcap", "inf"]),
    ("softcap-str", {"softcap": "50"}, TypeError, ["softcap", "str"]),
    ("softcap-bool", {"softcap": True}, TypeError, ["softcap", "bool"]),
    ("softcap-tensor", {"softcap": lambda: torch.tensor(50.0)}, TypeError, ["softcap", "Tensor"]),
    # -- out
    ("out-list", {"out": [0.0]}, TypeError, ["out", "torch.Tensor"]),
    ("out-wrong-shape", {"out": t(10, 4, 32)}, ValueError, ["out", "(10, 4, 64)", "(10, 4, 32)"]),
    ("out-wrong-rows", {"out": t(9, 4, 64)}, ValueError, ["out", "(9, 4, 64)"]),
    ("out-wrong-dtype", {"out": t(10, 4, 64, dtype=BF16)}, TypeError, ["out", "bfloat16"]),
    ("out-float32", {"out": t(10, 4, 64, dtype=torch.float32)}, TypeError, ["out", "float32"]),
    ("out-other-device", {"out": lambda: torch.empty(10, 4, 64, dtype=F16, device="meta")}, ValueError,
     ["out", "query", "meta", "cpu"]),
    # -- return_aux
    ("return-aux-true", {"return_aux": True}, TypeError, ["return_aux", "AuxRequest"]),
    ("return-aux-dict", {"return_aux": {"lse": True}}, TypeError, ["return_aux"]),
    ("return-aux-lse-int", {"return_aux": AuxRequest(lse=1)}, TypeError, ["return_aux.lse", "bool"]),
    ("return-aux-lse-none", {"return_aux": SimpleNamespace(lse=None)}, TypeError, ["return_aux.lse", "bool"]),
]


def _materialize(overrides):
    if callable(overrides):
        return overrides()
    args = base(overrides.get("paged", False))
    for name, value in overrides.items():
        if name != "paged":
            args[name] = value() if callable(value) else value
    return args


@pytest.mark.parametrize("overrides,exc_type,names", [pytest.param(*c[1:], id=c[0]) for c in INVALID])
def test_invalid_call_raises_naming_the_argument(overrides, exc_type, names):
    with pytest.raises(Exception) as info:
        check_varlen_args(**_materialize(overrides))
    err = info.value
    assert type(err) is exc_type, f"expected {exc_type.__name__}, got {type(err).__name__}: {err}"
    assert "CUDA" not in str(err), f"stopped at the device check, not the intended one: {err}"
    assert not missing_names(str(err), names), f"message {str(err)!r} does not name {missing_names(str(err), names)}"


def test_invalid_table_is_large_and_ids_are_unique():
    ids = [c[0] for c in INVALID]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


VALID = [
    ("default", {}),
    ("paged", P),
    ("paged-cu-seq-k-none", {**P, "cu_seq_k": None}),
    ("paged-page-size-1", {**P, "key": t(9, 1, 4, 64), "value": t(9, 1, 4, 64)}),
    ("seqused-k-unpaged", {"seqused_k": lambda: i32(2, 7)}),
    ("bf16", lambda: base(dtype=BF16)),
    ("gqa-2", gqa(8, 4, True)),
    ("gqa-8", gqa(8, 1, True)),
    ("gqa-flag-with-equal-heads", {"enable_gqa": True}),
    ("paged-gqa", lambda: {**base(paged=True, h_q=4, h_kv=2), "enable_gqa": True}),
    ("head-dim-32", gqa(4, 4, False, d=32)),
    ("head-dim-80", gqa(4, 4, False, d=80)),
    ("head-dim-256", gqa(4, 4, False, d=256)),
    ("causal", {"window_size": (-1, 0)}),
    ("sliding-window-list", {"window_size": [128, 0]}),
    ("general-window", {"window_size": (3, 5)}),
    ("int-scale", {"scale": 1}),
    ("float-scale", {"scale": 0.125}),
    ("num-splits-1", {"num_splits": 1}),
    ("num-splits-16", {"num_splits": 16}),
    ("softcap", {"softcap": 50.0}),
    ("softcap-int", {"softcap": 30}),
    ("softcap-zero-is-none", {"softcap": 0.0}),
    ("max-zero", {"max_q": 0, "max_k": 0}),
    ("out", {"out": t(10, 4, 64)}),
    ("return-aux-lse", {"return_aux": AuxRequest(lse=True)}),
    ("return-aux-default", {"return_aux": AuxRequest()}),
    ("torch-aux-request-like", {"return_aux": SimpleNamespace(lse=False)}),
    ("one-sequence", {"cu_seq_q": lambda: i32(0, 10), "cu_seq_k": lambda: i32(0, 12)}),
    ("empty-query", {"query": t(0, 4, 64), "cu_seq_q": lambda: i32(0, 0, 0)}),
    ("meta-tensors", lambda: {**{n: (v.to("meta") if isinstance(v, torch.Tensor) else v)
                                 for n, v in base().items()}}),
]


@pytest.mark.parametrize("overrides", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_non_cuda_call_stops_at_the_cuda_device_check(overrides):
    with pytest.raises(ValueError) as info:
        check_varlen_args(**_materialize(overrides))
    assert type(info.value) is ValueError
    assert re.match(r"^query must be a CUDA tensor, got a tensor on (cpu|meta)$", str(info.value)), str(info.value)


def test_device_check_names_each_non_cuda_tensor(monkeypatch):
    """With a fake CUDA query, the device check walks to the first non-CUDA tensor and names it."""
    from jitattn import checks as _checks

    real = _checks.cuda_device
    seen = {}

    def spy(named):
        seen.update(named)
        return real(named)

    monkeypatch.setattr(_checks, "cuda_device", spy)
    with pytest.raises(ValueError, match="CUDA"):
        call(paged=True, out=t(10, 4, 64), cu_seq_k=None)
    assert list(seen) == ["query", "key", "value", "cu_seq_q", "seqused_k", "block_table", "out"]


def test_valid_call_returns_derived_arguments(monkeypatch):
    from jitattn import checks as _checks

    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    got = call(paged=True, window_size=[5, 0], num_splits=2, return_aux=AuxRequest(lse=True))
    assert got == VarlenArgs(num_seqs=2, total_q=10, num_heads_q=4, num_heads_kv=4, head_dim=64,
                             scale=1 / 8, window_left=5, window_right=0, paged=True, page_size=4,
                             num_splits=2, return_lse=True, device=torch.device("cuda", 0), softcap=0.0)
    assert call(scale=2).scale == 2.0 and call().paged is False and call().page_size == 0
    assert call().return_lse is False and call().num_splits is None
    assert call(softcap=30).softcap == 30.0 and call(softcap=0).softcap == 0.0


def test_aux_request_matches_torch():
    assert AuxRequest().lse is False and AuxRequest(lse=True).lse is True
    with pytest.raises(AttributeError):
        AuxRequest().lse = True
    assert AuxRequest(True) == AuxRequest(lse=True) and hash(AuxRequest(True)) == hash(AuxRequest(lse=True))
    torch_aux = getattr(getattr(torch.nn.attention, "varlen", None), "AuxRequest", None)
    if torch_aux is not None:
        assert list(AuxRequest._fields) == list(torch_aux._fields)
        assert AuxRequest._field_defaults == torch_aux._field_defaults


def test_check_does_not_read_tensor_values():
    """Values are for check_varlen_values: nonsense metadata on meta tensors still reaches the device check."""
    args = base(paged=True)
    args.update(cu_seq_q=torch.empty(3, dtype=I32, device="meta"), seqused_k=torch.empty(2, dtype=I32, device="meta"),
                block_table=torch.empty(2, 2, dtype=I32, device="meta"))
    with pytest.raises(ValueError, match="query must be a CUDA tensor"):
        check_varlen_args(**args)


# ------------------------------------------------------------------ check_varlen_values

def values(paged=False, **overrides):
    args = base(paged)
    kept = {n: args[n] for n in ("query", "key", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "seqused_k", "block_table")}
    kept.update({n: (v() if callable(v) else v) for n, v in overrides.items()})
    return check_varlen_values(kept.pop("query"), kept.pop("key"), kept.pop("cu_seq_q"), kept.pop("cu_seq_k"),
                               kept.pop("max_q"), kept.pop("max_k"), **kept)


VALUES_INVALID = [
    ("cu-seq-q-starts-at-1", {"cu_seq_q": lambda: i32(1, 3, 10)}, ["cu_seq_q[0]", "0"]),
    ("cu-seq-k-starts-at-2", {"cu_seq_k": lambda: i32(2, 5, 12)}, ["cu_seq_k[0]"]),
    ("cu-seq-q-decreasing", {"cu_seq_q": lambda: i32(0, 6, 5)}, ["cu_seq_q", "non-decreasing", "cu_seq_q[1] = 6"]),
    ("cu-seq-k-decreasing", {"cu_seq_k": lambda: i32(0, 5, 4)}, ["cu_seq_k", "non-decreasing"]),
    ("cu-seq-q-past-t-q", {"cu_seq_q": lambda: i32(0, 3, 11)}, ["cu_seq_q[-1]", "11", "T_q", "10"]),
    ("cu-seq-k-past-t-k", {"cu_seq_k": lambda: i32(0, 5, 13)}, ["cu_seq_k[-1]", "13", "T_k", "12"]),
    ("seqused-k-negative", {"seqused_k": lambda: i32(-1, 3)}, ["seqused_k[0]", "-1"]),
    ("seqused-k-above-slot", {"seqused_k": lambda: i32(5, 8)}, ["seqused_k[1]", "8", "[0, 7]"]),
    ("seqused-k-above-pages", {**P, "seqused_k": lambda: i32(9, 3)}, ["seqused_k[0]", "9", "[0, 8]"]),
    ("page-id-negative", {**P, "block_table": lambda: i32(2, -1, 1, -1).reshape(2, 2)}, ["block_table[0, 1]", "-1"]),
    ("page-id-past-pool", {**P, "block_table": lambda: i32(2, 0, 3, -1).reshape(2, 2)},
     ["block_table[1, 0]", "3", "[0, 3)"]),
    ("max-q-too-small", {"max_q": 6}, ["max_q", "7"]),
    ("max-k-too-small", {"max_k": 6}, ["max_k", "7"]),
    ("max-k-below-seqused-k", {**P, "max_k": 4}, ["max_k", "5"]),
]


@pytest.mark.parametrize("overrides,names", [pytest.param(*c[1:], id=c[0]) for c in VALUES_INVALID])
def test_check_varlen_values_rejects_bad_values_naming_the_argument(overrides, names):
    paged = overrides.get("paged", False)
    with pytest.raises(ValueError) as info:
        values(paged, **{n: v for n, v in overrides.items() if n != "paged"})
    assert type(info.value) is ValueError
    assert not missing_names(str(info.value), names), f"{str(info.value)!r} does not name {missing_names(str(info.value), names)}"


@pytest.mark.parametrize("paged,overrides", [
    (False, {}),
    (True, {}),
    (True, {"cu_seq_k": None}),
    (False, {"seqused_k": lambda: i32(0, 7), "max_k": 7}),
    (False, {"cu_seq_q": lambda: i32(0, 0, 4), "max_q": 4}),  # zero-length sequence and padding rows
    (False, {"cu_seq_k": lambda: i32(0, 0, 0), "max_k": 0}),
    (True, {"seqused_k": lambda: i32(0, 0), "block_table": lambda: i32(-1, 99, -5, 7).reshape(2, 2), "max_k": 0}),
    (True, {"seqused_k": lambda: i32(8, 4), "block_table": lambda: i32(2, 0, 1, 7).reshape(2, 2), "max_k": 8}),
    (False, {"max_q": 100, "max_k": 100}),
], ids=["default", "paged", "paged-no-cu-seq-k", "seqused-k-zero-and-full", "empty-seq-and-padding",
        "no-keys", "paged-no-keys-ignores-padding", "paged-full-pages", "max-above-longest"])
def test_check_varlen_values_accepts_valid_values(paged, overrides):
    assert values(paged, **overrides) is None


# ------------------------------------------------------------------ the public API (issue 6)
# The same invalid calls through jitattn.varlen_attn / jitattn.varlen_attn_out with CPU tensors:
# each raises the table's exception naming the argument, before anything is compiled
# (jitattn.varlen.forward.get_module is patched to fail the test if reached).

POSITIONAL = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")
SPEC_KEYWORDS = {"return_aux": None, "scale": None, "window_size": (-1, -1), "enable_gqa": False,
                 "seqused_k": None, "block_table": None, "num_splits": None}
EXTENSIONS = {"softcap": None, "score_mod": None, "mask_mod": None}  # jitattn's keywords beyond torch's, after all of torch's


@pytest.fixture
def api(monkeypatch):
    """The jitattn package, with every path to a compile patched to fail the test."""
    import jitattn
    import jitattn.varlen.forward as varlen
    from jitattn.jit import loader

    def forbidden(spec):
        pytest.fail(f"get_module({spec!r}) was called: validation must reject the call first")

    monkeypatch.setattr(varlen, "get_module", forbidden)  # forward.py: `from jitattn.jit.loader import get_module`
    monkeypatch.setattr(loader, "get_module", forbidden)
    with fresh_memos():  # the per-call fast-path memo starts empty
        yield jitattn


def public_call(jitattn, function, args):
    """Call jitattn.<function> with `args` (check_varlen_args' names; `out` only for varlen_attn_out).
    varlen_attn_out without an `out` in args gets a valid one: zeros like query."""
    args = dict(args)
    positional = [args.pop(name) for name in POSITIONAL]
    if function == "varlen_attn":
        assert "out" not in args
        return jitattn.varlen_attn(*positional, **args)
    query = positional[0]
    out = args.pop("out") if "out" in args else (
        torch.zeros_like(query) if isinstance(query, torch.Tensor) else torch.zeros(10, 4, 64, dtype=F16))
    return jitattn.varlen_attn_out(out, *positional, **args)


PUBLIC_ONLY = [
    ("out-none", {"out": None}, TypeError, ["out"]),
    ("out-int", {"out": 0}, TypeError, ["out", "torch.Tensor"]),
    ("out-int32", {"out": t(10, 4, 64, dtype=I32)}, TypeError, ["out", "int32"]),
    ("out-rank-2", {"out": t(10, 256)}, ValueError, ["out", "(10, 256)"]),
    ("out-missing-head", {"out": t(10, 3, 64)}, ValueError, ["out", "(10, 3, 64)"]),
    ("out-paged-wrong-shape", {**P, "out": t(10, 4, 128)}, ValueError, ["out", "(10, 4, 128)"]),
    ("return-aux-str", {"return_aux": "lse"}, TypeError, ["return_aux"]),
    ("return-aux-tuple-str", {"return_aux": ("yes",)}, TypeError, ["return_aux"]),
]
PUBLIC_CASES = [
    pytest.param(fn, overrides, exc, names, id=f"{fn}-{case_id}")
    for case_id, overrides, exc, names in INVALID + PUBLIC_ONLY
    for fn in ("varlen_attn", "varlen_attn_out")
    if fn == "varlen_attn_out" or not (isinstance(overrides, dict) and "out" in overrides)
]


@pytest.mark.parametrize("function,overrides,exc_type,names", PUBLIC_CASES)
def test_public_invalid_call_raises_naming_the_argument(api, function, overrides, exc_type, names):
    with pytest.raises(Exception) as info:
        public_call(api, function, _materialize(overrides))
    err = info.value
    assert type(err) is exc_type, f"expected {exc_type.__name__}, got {type(err).__name__}: {err}"
    assert "CUDA" not in str(err), f"stopped at the device check, not the intended one: {err}"
    assert not missing_names(str(err), names), f"message {str(err)!r} does not name {missing_names(str(err), names)}"


def test_public_invalid_table_is_large():
    assert len(PUBLIC_CASES) >= 30
    assert len({p.id for p in PUBLIC_CASES}) == len(PUBLIC_CASES)


@pytest.mark.parametrize("function", ["varlen_attn", "varlen_attn_out"])
@pytest.mark.parametrize("overrides", [c[1] for c in VALID if c[0] != "meta-tensors"],
                         ids=[c[0] for c in VALID if c[0] != "meta-tensors"])
def test_public_valid_cpu_call_stops_at_the_cuda_device_check(api, function, overrides):
    """Valid arguments on the CPU: the only error is the device check (nothing compiled)."""
    args = _materialize(overrides)
    if function == "varlen_attn":
        args.pop("out", None)
    with pytest.raises(ValueError) as info:
        public_call(api, function, args)
    assert type(info.value) is ValueError
    assert "CUDA" in str(info.value) and "query" in str(info.value), str(info.value)


def test_public_signatures_match_the_spec():
    import inspect

    import jitattn

    for name, leading in (("varlen_attn", POSITIONAL), ("varlen_attn_out", ("out",) + POSITIONAL)):
        params = inspect.signature(getattr(jitattn, name)).parameters
        assert tuple(params)[: len(leading)] == leading, f"{name} positional parameters: {tuple(params)}"
        for p in leading:
            assert params[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name}({p}) must be positional"
            assert params[p].default is inspect.Parameter.empty, f"{name}({p}) must have no default"
        keywords = {n: p for n, p in params.items() if n not in leading}
        assert set(keywords) == set(SPEC_KEYWORDS) | set(EXTENSIONS), f"{name} keyword parameters: {sorted(keywords)}"
        assert list(keywords)[-len(EXTENSIONS):] == list(EXTENSIONS), f"{name}: jitattn's extensions come last"
        for n, p in keywords.items():
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"{name}: {n} must be keyword-only"
            assert p.default == {**SPEC_KEYWORDS, **EXTENSIONS}[n], f"{name}: {n} defaults to {p.default!r}"
        torch_fn = getattr(getattr(torch.nn.attention, "varlen", None), name, None)
        if torch_fn is not None and "block_table" in inspect.signature(torch_fn).parameters:
            ours = [n for n in params if n not in EXTENSIONS]
            assert ours == list(inspect.signature(torch_fn).parameters), f"{name} differs from torch's"


def test_public_aux_request_is_exported():
    import jitattn

    assert jitattn.AuxRequest is AuxRequest
    assert jitattn.AuxRequest(lse=True).lse is True and jitattn.AuxRequest().lse is False


@pytest.mark.parametrize("name", ["query", "key"])
def test_2_31_rows_are_rejected_before_any_launch(name):
    """Kernels index tokens with 32-bit ints: 2**31 rows (an expanded view, no memory) is a
    ValueError naming the tensor, from the checks and from the public function."""
    import jitattn

    args = base()
    big = torch.zeros(1, *args[name].shape[1:], dtype=args[name].dtype).expand(2**31, *args[name].shape[1:])
    args[name] = big
    if name == "key":
        args["value"] = big
    for fn in (lambda: check_varlen_args(**args), lambda: jitattn.varlen_attn(**args)):
        with pytest.raises(ValueError, match=rf"{name} has 2147483648 rows"):
            fn()
