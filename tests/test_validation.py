"""Input validation of single_decode_with_kv_cache, vector_ready and the kernel capacity (CPU only).

Every invalid call must raise the documented exception type with a message naming the argument,
and must do so before anything is compiled (get_module is patched to fail the test if reached).
Validation puts the CUDA-device check last, so all of this runs on CPU tensors.
"""
import math
import re
import types
from pathlib import Path

import pytest
import torch

import jitattn
import jitattn.decode.api as decode
from jitattn import checks as _checks
from jitattn.kernel import LoadedKernel, fresh_memos
from tests.conftest import missing_names

F16, BF16 = torch.float16, torch.bfloat16
TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@pytest.fixture(autouse=True)
def no_compile(monkeypatch):
    """Reaching get_module would mean an invalid call got as far as compiling: fail loudly."""

    def forbidden(spec):
        pytest.fail(f"get_module({spec!r}) was called: validation must reject the call first")

    monkeypatch.setattr(decode, "get_module", forbidden)
    with fresh_memos():  # the per-call fast-path memo starts empty
        yield


def inputs(num_qo=8, num_kv=2, kv_len=16, head_dim=64, dtype=F16, kv_dtype=None, layout="NHD"):
    q = torch.randn(num_qo, head_dim).to(dtype)
    shape = (kv_len, num_kv, head_dim) if layout == "NHD" else (num_kv, kv_len, head_dim)
    kv_dtype = kv_dtype or dtype
    k = torch.randn(shape).to(kv_dtype)
    v = torch.randn(shape).to(kv_dtype)
    return q, k, v


def call(**overrides):
    """A valid call (8 query heads, 2 kv heads, 16 rows, head_dim 64, NHD) with overrides."""
    q, k, v = inputs()
    args = {"q": q, "k": k, "v": v, **overrides}
    return jitattn.single_decode_with_kv_cache(**args)


def with_tensors(**shape_kwargs):
    """Overrides that swap in q, k, v built by `inputs(**shape_kwargs)`."""
    def build():
        q, k, v = inputs(**shape_kwargs)
        return {"q": q, "k": k, "v": v, "kv_layout": shape_kwargs.get("layout", "NHD")}
    return build


def tensor(*shape, dtype=F16):
    return lambda: torch.zeros(shape, dtype=dtype)


# (id, overrides: dict of values or zero-arg factories, exception type, names the message must contain)
INVALID = [
    # -- q / k / v must be tensors of the right rank
    ("q-is-a-list", {"q": lambda: [[0.0] * 64] * 8}, TypeError, ["q", "torch.Tensor"]),
    ("q-is-none", {"q": None}, TypeError, ["q"]),
    ("k-is-a-list", {"k": lambda: [[[0.0] * 64] * 2] * 16}, TypeError, ["k"]),
    ("v-is-a-float", {"v": 1.0}, TypeError, ["v"]),
    ("q-rank-1", {"q": tensor(64)}, ValueError, ["q", "2 dims"]),
    ("q-rank-3", {"q": tensor(1, 8, 64)}, ValueError, ["q", "2 dims"]),
    ("k-rank-2", {"k": tensor(16, 128)}, ValueError, ["k", "3 dims"]),
    ("v-rank-4", {"v": tensor(1, 16, 2, 64)}, ValueError, ["v", "3 dims"]),
    # -- string choices
    ("layout-unknown", {"kv_layout": "NDH"}, ValueError, ["kv_layout", "NDH"]),
    ("layout-lowercase", {"kv_layout": "nhd"}, ValueError, ["kv_layout", "nhd"]),
    ("layout-not-str", {"kv_layout": 0}, TypeError, ["kv_layout", "int"]),
    ("pos-unknown", {"pos_encoding_mode": "ROPE"}, ValueError, ["pos_encoding_mode", "ROPE"]),
    ("pos-not-str", {"pos_encoding_mode": None}, TypeError, ["pos_encoding_mode"]),
    # -- booleans
    ("tensor-cores-int", {"use_tensor_cores": 1}, TypeError, ["use_tensor_cores", "bool"]),
    ("return-lse-str", {"return_lse": "yes"}, TypeError, ["return_lse", "bool"]),
    ("return-lse-none", {"return_lse": None}, TypeError, ["return_lse", "bool"]),
    # -- window_left: an int >= -1
    ("window-minus-2", {"window_left": -2}, ValueError, ["window_left", "-2"]),
    ("window-float", {"window_left": 1.5}, TypeError, ["window_left", "int"]),
    ("window-bool", {"window_left": True}, TypeError, ["window_left", "int"]),
    ("window-str", {"window_left": "3"}, TypeError, ["window_left"]),
    # -- logits_soft_cap: None/0 (off) or a finite number > 0
    ("cap-negative", {"logits_soft_cap": -1.0}, ValueError, ["logits_soft_cap"]),
    ("cap-nan", {"logits_soft_cap": math.nan}, ValueError, ["logits_soft_cap", "nan"]),
    ("cap-inf", {"logits_soft_cap": math.inf}, ValueError, ["logits_soft_cap", "inf"]),
    ("cap-str", {"logits_soft_cap": "30"}, TypeError, ["logits_soft_cap"]),
    ("cap-bool", {"logits_soft_cap": True}, TypeError, ["logits_soft_cap"]),
    # -- scales: None or a finite number > 0
    ("sm-scale-zero", {"sm_scale": 0}, ValueError, ["sm_scale"]),
    ("sm-scale-negative", {"sm_scale": -1.0}, ValueError, ["sm_scale"]),
    ("sm-scale-nan", {"sm_scale": math.nan}, ValueError, ["sm_scale"]),
    ("sm-scale-inf", {"sm_scale": math.inf}, ValueError, ["sm_scale"]),
    ("sm-scale-str", {"sm_scale": "x"}, TypeError, ["sm_scale"]),
    ("q-scale-negative", {"q_scale": -1.0}, ValueError, ["q_scale"]),
    ("q-scale-zero", {"q_scale": 0.0}, ValueError, ["q_scale"]),
    ("k-scale-negative", {"k_scale": -0.5}, ValueError, ["k_scale"]),
    ("k-scale-tensor", {"k_scale": lambda: torch.tensor([1.0, 2.0])}, TypeError, ["k_scale"]),
    ("v-scale-nan", {"v_scale": math.nan}, ValueError, ["v_scale"]),
    ("rope-theta-negative", {"rope_theta": -1e4}, ValueError, ["rope_theta"]),
    ("rope-theta-str", {"rope_theta": "1e4"}, TypeError, ["rope_theta"]),
    ("rope-scale-zero", {"rope_scale": 0.0}, ValueError, ["rope_scale"]),
    # -- dtypes
    ("q-float32", {"q": tensor(8, 64, dtype=torch.float32)}, TypeError, ["q", "float32"]),
    ("q-fp8", with_tensors(dtype=torch.float8_e4m3fn), TypeError, ["q", "float8_e4m3fn"]),
    ("k-v-dtype-mismatch", {"v": tensor(16, 2, 64, dtype=BF16)}, TypeError, ["k", "v", "bfloat16"]),
    ("k-v-bf16-with-q-f16", with_tensors(dtype=F16, kv_dtype=BF16), TypeError, ["k/v", "float16", "bfloat16"]),
    ("k-v-float32", with_tensors(dtype=F16, kv_dtype=torch.float32), TypeError, ["k/v", "float32"]),
    # -- shapes
    ("k-v-shape-mismatch", {"v": tensor(17, 2, 64)}, ValueError, ["k", "v", "(16, 2, 64)", "(17, 2, 64)"]),
    ("head-dim-q-64-kv-128", {"k": tensor(16, 2, 128), "v": tensor(16, 2, 128)}, ValueError,
     ["head_dim", "128", "64"]),
    ("head-dim-40", with_tensors(head_dim=40), ValueError, ["head_dim", "40"]),
    ("fp8-head-dim-48", with_tensors(head_dim=48, kv_dtype=torch.float8_e4m3fn), ValueError,
     ["head_dim", "multiple of 32", "fp8", "48"]),
    ("head-dim-8", with_tensors(head_dim=8), ValueError, ["head_dim", "8"]),
    ("head-dim-512", with_tensors(head_dim=512), ValueError, ["head_dim", "512"]),
    ("head-dim-272", with_tensors(head_dim=272), ValueError, ["head_dim", "272"]),
    ("head-dim-0", with_tensors(head_dim=0), ValueError, ["head_dim"]),
    ("gqa-8-over-3-nhd", with_tensors(num_qo=8, num_kv=3), ValueError, ["num_qo_heads", "num_kv_heads", "8", "3"]),
    ("gqa-8-over-3-hnd", with_tensors(num_qo=8, num_kv=3, layout="HND"), ValueError,
     ["num_qo_heads", "num_kv_heads", "8", "3"]),
    ("gqa-more-kv-than-qo-heads", with_tensors(num_qo=2, num_kv=4), ValueError, ["num_qo_heads", "num_kv_heads"]),
    # NHD tensors read as HND: 16 "kv heads" for 8 query heads
    ("nhd-tensors-as-hnd", {"kv_layout": "HND"}, ValueError, ["num_qo_heads", "num_kv_heads", "16"]),
    ("zero-qo-heads", with_tensors(num_qo=0), ValueError, ["num_qo_heads"]),
    ("zero-kv-heads", with_tensors(num_kv=0), ValueError, ["num_kv_heads"]),
    ("kv-len-0-nhd", with_tensors(kv_len=0), ValueError, ["kv_len"]),
    ("kv-len-0-hnd", with_tensors(kv_len=0, layout="HND"), ValueError, ["kv_len"]),
    ("kv-len-2-pow-31", {"k": lambda: torch.zeros(1, 2, 64, dtype=F16).expand(2**31, 2, 64),
                         "v": lambda: torch.zeros(1, 2, 64, dtype=F16).expand(2**31, 2, 64)},
     ValueError, ["kv_len", "2**31"]),
]


def _materialize(overrides):
    if callable(overrides):
        return overrides()
    return {name: value() if callable(value) else value for name, value in overrides.items()}


def _params(table):
    return [pytest.param(*case[1:4], id=case[0], marks=case[4:]) for case in table]


@pytest.mark.parametrize("overrides,exc_type,names", _params(INVALID))
def test_invalid_call_raises_naming_the_argument_before_compiling(overrides, exc_type, names):
    with pytest.raises(Exception) as info:
        call(**_materialize(overrides))
    err = info.value
    assert type(err) is exc_type, f"expected {exc_type.__name__}, got {type(err).__name__}: {err}"
    message = str(err)
    assert not missing_names(message, names), f"message {message!r} does not name {missing_names(message, names)}"


def test_invalid_table_is_large_and_ids_are_unique():
    ids = [c[0] for c in INVALID]
    assert len(ids) >= 35 and len(set(ids)) == len(ids)


# Valid inputs: every one must get past validation and stop only at the (last) CUDA-device check.
VALID = [
    ("default", {}),
    ("hnd", with_tensors(layout="HND")),
    ("bf16", with_tensors(dtype=BF16)),
    ("mha", with_tensors(num_qo=4, num_kv=4)),
    ("gqa-16", with_tensors(num_qo=16, num_kv=1)),
    ("gqa-3", with_tensors(num_qo=12, num_kv=4)),
    ("kv-len-1", with_tensors(kv_len=1)),
    ("head-dim-32", with_tensors(head_dim=32)),
    ("head-dim-80", with_tensors(head_dim=80)),
    ("head-dim-256", with_tensors(head_dim=256)),
    ("window-0", {"window_left": 0}),
    ("window-beyond-kv-len", {"window_left": 10_000}),
    ("cap-zero-means-off", {"logits_soft_cap": 0}),
    ("cap-positive", {"logits_soft_cap": 30.0}),
    ("int-scales", {"sm_scale": 1, "q_scale": 2, "k_scale": 3, "v_scale": 1}),
    ("rope-args-accepted", {"rope_scale": 2.0, "rope_theta": 5e5}),
    ("return-lse", {"return_lse": True}),
    ("tensor-cores", {"use_tensor_cores": True}),
    ("rope-llama", {"pos_encoding_mode": "ROPE_LLAMA"}),
    ("alibi", {"pos_encoding_mode": "ALIBI"}),
    ("v-scale", {"v_scale": 0.5}),
    ("fp8-e4m3-kv", with_tensors(kv_dtype=torch.float8_e4m3fn)),
    ("fp8-e5m2-kv-bf16-q", with_tensors(dtype=BF16, kv_dtype=torch.float8_e5m2)),
    ("strided-last-dim-is-copied", {"k": lambda: torch.zeros(16, 2, 128, dtype=F16)[..., ::2],
                                    "v": lambda: torch.zeros(16, 2, 128, dtype=F16)[..., ::2]}),
    ("meta-tensors", {"q": tensor(8, 64), "k": lambda: torch.empty(16, 2, 64, dtype=F16, device="meta"),
                      "v": lambda: torch.empty(16, 2, 64, dtype=F16, device="meta")}),
]


@pytest.mark.parametrize("overrides", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_non_cuda_call_stops_at_the_cuda_device_check(overrides):
    with pytest.raises(ValueError, match="CUDA") as info:
        call(**_materialize(overrides))
    assert type(info.value) is ValueError
    # the first non-CUDA tensor is named, with its device
    assert re.match(r"^(q|k|v) must be a CUDA tensor, got a tensor on (cpu|meta)", str(info.value)), str(info.value)


def test_cpu_call_names_q_and_its_device():
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor, got a tensor on cpu"):
        call()


# ------------------------------------------------------------------ vector_ready


@pytest.mark.parametrize("dtype", [F16, BF16, torch.float8_e4m3fn], ids=str)
def test_vector_ready_returns_aligned_unit_stride_views_unchanged(dtype):
    base = torch.zeros(16, 4, 80, dtype=torch.float16).to(dtype)  # rows of 80 elements: 16-byte multiples
    for view in (base, base[:, :, :64], base[3:9], base[:, 1:3], base.transpose(0, 1)):
        assert view.stride(-1) == 1 and view.data_ptr() % 16 == 0
        assert _checks.vector_ready(view) is view


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_vector_ready_copies_a_non_unit_last_stride(dtype):
    view = torch.arange(16 * 2 * 128, dtype=torch.float32).reshape(16, 2, 128).to(dtype)[..., ::2]
    ready = _checks.vector_ready(view)
    assert ready is not view
    assert ready.is_contiguous() and ready.stride(-1) == 1
    assert torch.equal(ready, view)


def test_vector_ready_copies_when_the_storage_offset_breaks_16_byte_alignment():
    base = torch.arange(8 * 72, dtype=torch.float32).reshape(8, 72).half()
    assert base.data_ptr() % 16 == 0
    view = base[:, 1:65]  # 2-byte offset: unit stride but misaligned
    assert view.stride(-1) == 1 and view.data_ptr() % 16 == 2
    ready = _checks.vector_ready(view)
    assert ready is not view
    assert ready.data_ptr() % 16 == 0 and ready.is_contiguous()
    assert torch.equal(ready, view)
    aligned = base[:, 8:72]  # 16-byte offset: fine as is
    assert _checks.vector_ready(aligned) is aligned


def test_vector_ready_copies_when_a_row_stride_is_not_a_16_byte_multiple():
    view = torch.zeros(8, 66, dtype=F16)[:, :64]  # rows 132 bytes apart
    ready = _checks.vector_ready(view)
    assert ready is not view and ready.is_contiguous()


# ------------------------------------------------------------------ kernel capacity
# capacity is the CTAs one wave holds (SMs x resident CTAs per SM); an H200 has 132 SMs.

SMS = 132
CTAS_PER_SM = 4
WAVE = SMS * CTAS_PER_SM


class _FakeOp:
    def __init__(self, fn):
        self.default = fn


def _fake_module(ctas_per_sm):
    calls = []

    def occupancy(device):
        calls.append(device)
        return ctas_per_sm

    ops = types.SimpleNamespace(run=_FakeOp(lambda *a: None), ctas_per_sm=_FakeOp(occupancy))
    return types.SimpleNamespace(ops=ops), calls


def test_kernel_capacity_is_sms_times_occupancy_and_is_memoized_per_device(monkeypatch):
    module, occupancy_calls = _fake_module(CTAS_PER_SM)
    props_calls = []

    def props(index):
        props_calls.append(index)
        return types.SimpleNamespace(multi_processor_count=SMS)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    kernel = LoadedKernel(module)
    device = torch.device("cuda", 0)
    assert kernel.capacity(device) == WAVE
    assert kernel.capacity(device) == WAVE  # memoized: no second CUDA query
    assert props_calls == [0] and occupancy_calls == [0]
    assert kernel.capacity(torch.device("cuda", 1)) == WAVE and props_calls == [0, 1]


# ------------------------------------------------------------------ RoPE frequencies
def _kernel_angle(turns0: float, ratio: float, i: int, pos: int) -> float:
    """What templates/common/posenc.cuh computes from decode._rope_frequencies' two numbers:
    turns0 * ratio^i by squaring in doubles, as a 64-bit fixed-point fraction of a turn, then the
    angle of `pos` from 32-bit integer products, in radians in [-pi, pi)."""
    turns, r = turns0, ratio
    for bit in range(8):
        if (i >> bit) & 1:
            turns *= r
        r *= r
    scaled = (turns - math.floor(turns)) * 2.0**32
    hi = math.floor(scaled)
    lo = math.floor((scaled - hi) * 2.0**32)
    frac = (pos * hi + ((pos * lo) >> 32)) & 0xFFFFFFFF
    return (frac - 2**32 if frac >= 2**31 else frac) * (2 * math.pi / 2**32)


@pytest.mark.parametrize("head_dim", [48, 64, 128, 256])
@pytest.mark.parametrize("theta, scale", [(None, None), (5e5, 2.0), (1e6, 4.0), (1e4, 0.25)])
def test_rope_frequencies_give_the_spec_angles_at_long_positions(head_dim, theta, scale):
    """The kernel's angle for dim pair i at position p is p * theta^(-2i/D) / rope_scale
    (spec/decode.md) modulo one turn, to ~1e-6 rad even at positions near 2^31."""
    turns0, ratio = decode._rope_frequencies(head_dim, theta, scale)
    t, s = (1e4 if theta is None else theta), (1.0 if scale is None else scale)
    for i in range(head_dim // 2):
        freq = math.pow(t, -2.0 * i / head_dim) / s
        for pos in (0, 1, 7, 4095, 131071, 2**20 + 3, 2**31 - 2):
            exact = math.remainder(pos * freq, 2 * math.pi)  # double product: error << 1e-6 rad
            got = _kernel_angle(turns0, ratio, i, pos)
            diff = abs(math.remainder(got - exact, 2 * math.pi))
            assert diff < 2e-6 * max(1.0, pos * freq / 2**25), (i, pos, got, exact)
