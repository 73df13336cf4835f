"""jitattn as torch's flash-attention provider (jitattn/integrations/torch_flash.py), on the CPU.

Registration and activation use torch's own registry. The argument mapping (dense -> varlen
cu_seq, lse layouts, windows, scale, GQA, output strides) runs end to end through aten's ops and
torch's own varlen_attn: the provider is installed for the CPU dispatch key with a float64 stand-in
for jitattn's kernels (the `use_kernels` seam), and results are compared with an independent
float64 autograd reference. The GPU tests (test_torch_flash_gpu.py) run jitattn's real kernels.
"""
from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jitattn
from jitattn.integrations import torch_flash, torch_registry
from jitattn.kernel import fresh_memos
from jitattn.reference import varlen_attn_reference
from jitattn.reference_backward import varlen_attn_backward

ROOT = Path(__file__).resolve().parents[1]
registry = torch.nn.attention._registry
pytestmark = pytest.mark.skipif(not hasattr(registry, "register_flash_attention_impl"),
                                reason="this torch has no flash-attention registry")


def _torch_varlen_has(name: str) -> bool:
    """Whether this torch's torch.nn.attention.varlen has `name`, as a function or as a keyword
    of varlen_attn: torch 2.11 (the GPU host's) has neither varlen_attn_out nor enable_gqa."""
    import inspect

    try:
        from torch.nn.attention import varlen
    except ImportError:  # a torch before varlen_attn
        return False
    return hasattr(varlen, name) or name in inspect.signature(varlen.varlen_attn).parameters


# ----------------------------------------------------------------------------- a float64 stand-in
def _reference_forward(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, enable_gqa,
                       seqused_k, block_table, num_splits):
    result, lse = varlen_attn_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                        window_size=window, enable_gqa=enable_gqa, seqused_k=seqused_k,
                                        block_table=block_table)
    out.copy_(result)
    return lse.float()


def _reference_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, scale, window):
    return varlen_attn_backward(grad_out, None, query, key, value, out, lse, cu_seq_q, cu_seq_k, scale=scale,
                                window_size=window, compute_dtype=torch.float64)


STAND_IN = torch_flash.Kernels(_reference_forward, _reference_backward, lambda device: None)


@pytest.fixture
def provider_on_cpu():
    """The provider installed for the CPU key (aten's flash ops have no CPU kernel of their own)
    with the float64 stand-in; removed afterwards."""
    handle = torch_flash.install("CPU")
    torch_flash.CALLS.clear()
    try:
        with torch_flash.use_kernels(STAND_IN):
            yield
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- the oracle
def attention_f64(q, k, v, scale, left, right):
    """(out, lse) of (B, H, Sq, D) attention in float64 with bottom-right aligned windows (-1:
    unbounded); GQA by repeating kv heads."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    rows = torch.arange(sq, device=q.device)[:, None] + sk - sq
    cols = torch.arange(sk, device=q.device)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.softmax(logits, -1) @ v, lse


def _inputs(shape_q, shape_kv, dtype, layout="bhsd"):
    """Fresh random q, k, v requiring grad; `layout` "bshd" makes (B, H, S, D) views of (B, S, H, D)
    storage, as models that transpose their projections hand SDPA."""
    def make(shape):
        if layout == "bshd":
            b, h, s, d = shape
            return torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2).detach().requires_grad_()
        return torch.randn(shape, dtype=dtype, requires_grad=True)
    return make(shape_q), make(shape_kv), make(shape_kv)


def _assert_close(actual, expected, what, tol=2e-2):
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs().max().item()
    bound = tol * max(1.0, expected.abs().max().item())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


# ----------------------------------------------------------------------------- registration
def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_import_registers_jitattn_inactive_whichever_is_imported_first():
    after_torch = _run("import torch, jitattn; from torch.nn import attention as a; "
                       "print('jitattn' in a.list_flash_attention_impls(), a.current_flash_attention_impl())")
    before_torch = _run("import jitattn, sys; t = 'torch' in sys.modules; import torch; from torch.nn import "
                        "attention as a; print(t, 'jitattn' in a.list_flash_attention_impls(), "
                        "a.current_flash_attention_impl())")
    assert after_torch == "True None"
    assert before_torch == "False True None"  # import jitattn alone does not import torch


def test_a_torch_without_the_registry_gets_nothing_and_no_error():
    import types

    assert torch_registry.register(types.ModuleType("torch.nn.attention._registry")) is False


def test_activate_and_restore_round_trip_through_torchs_registry():
    assert "jitattn" in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() is None
    try:
        jitattn.activate()
        assert torch.nn.attention.current_flash_attention_impl() == "jitattn" and torch_registry.is_active()
        jitattn.restore()
        assert torch.nn.attention.current_flash_attention_impl() is None and not torch_registry.is_active()
        torch.nn.attention.activate_flash_attention_impl("jitattn")
        assert torch_registry.is_active()
        torch.nn.attention.restore_flash_attention_impl()
        assert not torch_registry.is_active()
    finally:
        jitattn.restore()


def test_restore_when_another_impl_is_active_leaves_it_alone(monkeypatch):
    class Handle:
        removed = False

        def remove(self):
            Handle.removed = True

    monkeypatch.setitem(registry._FLASH_ATTENTION_IMPLS, "other", lambda: Handle())
    try:
        torch.nn.attention.activate_flash_attention_impl("other")
        jitattn.restore()
        assert torch.nn.attention.current_flash_attention_impl() == "other" and not Handle.removed
    finally:
        torch.nn.attention.restore_flash_attention_impl()


def test_removing_the_handle_gives_the_ops_back():
    handle = torch_flash.install("CPU")
    q = torch.randn(1, 2, 4, 32, dtype=torch.float16)
    with torch_flash.use_kernels(STAND_IN):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)
    handle.remove()
    with pytest.raises(NotImplementedError):  # aten has no CPU kernel for it: ours is gone
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)


# ----------------------------------------------------------------------------- the mapping, end to end
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(causal=False, scale=None, heads_kv=4, sq=7, sk=7, layout="bhsd"),
    dict(causal=True, scale=0.3, heads_kv=4, sq=9, sk=9, layout="bshd"),
    dict(causal=True, scale=None, heads_kv=2, sq=5, sk=11, layout="bhsd"),   # GQA, bottom-right causal
    dict(causal=False, scale=0.05, heads_kv=1, sq=3, sk=8, layout="bshd"),   # MQA
    dict(causal=False, scale=None, heads_kv=2, sq=1, sk=9, layout="bhsd", batch=1),  # a decode step
    dict(causal=True, scale=None, heads_kv=4, sq=6, sk=6, layout="bhsd", batch=1),
])
def test_sdpa_flash_op_matches_float64_forward_and_backward(provider_on_cpu, dtype, case):
    batch, heads, dim = case.get("batch", 2), 4, 64
    q, k, v = _inputs((batch, heads, case["sq"], dim), (batch, case["heads_kv"], case["sk"], dim), dtype,
                      case["layout"])
    result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, case["causal"], False,
                                                               scale=case["scale"])
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = result
    scale = case["scale"] or 1 / math.sqrt(dim)
    ref_out, ref_lse = attention_f64(q, k, v, scale, -1, 0 if case["causal"] else -1)
    # what aten's meta kernel promises
    assert out.shape == q.shape and out.stride() == torch.empty_like(q).stride() and out.dtype == dtype
    assert lse.shape == (batch, heads, case["sq"]) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert (cum_q, cum_k, max_q, max_k) == (None, None, case["sq"], case["sk"])
    assert seed.shape == (2,) and seed.dtype == torch.uint64 and offset.shape == () and debug.numel() == 0
    _assert_close(out, ref_out, "out")
    _assert_close(lse, ref_lse, "lse", 1e-3)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_q, ref_k, ref_v = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(attention_f64(ref_q, ref_k, ref_v, scale, -1, 0 if case["causal"] else -1)[0],
                                   (ref_q, ref_k, ref_v), grad.double())
    for name, g, e, t in zip("qkv", got, expected, (q, k, v)):
        assert g.shape == t.shape and g.stride() == torch.empty_like(t).stride()
        _assert_close(g, e, f"d{name}")
    assert torch_flash.CALLS == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (3, True)])
def test_a_batched_kv_cache_is_read_in_place_from_its_slots(provider_on_cpu, seqlen_q, causal):
    """SDPA's decode calls on a (B, H, L, D) KV cache with room for more keys (a static cache):
    key and value reach the kernel as views of the cache's storage, each batch row a slot of
    which seqused_k keys take part, never a copy of the cache; the result is float64's."""
    batch, heads_q, heads_kv, length, room, dim = 3, 4, 2, 11, 16, 64
    cache_k, cache_v = (torch.randn(batch, heads_kv, room, dim, dtype=torch.float16) for _ in range(2))
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]
    q = torch.randn(batch, heads_q, seqlen_q, dim, dtype=torch.float16)
    seen = []

    def recording(out, query, key, value, *rest):
        seen.append((key, value, rest[-3]))  # rest[-3]: seqused_k
        return _reference_forward(out, query, key, value, *rest)

    with torch_flash.use_kernels(STAND_IN._replace(forward=recording)):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[:2]
    key, value, used = seen[-1]
    assert key.untyped_storage().data_ptr() == cache_k.untyped_storage().data_ptr()
    assert value.untyped_storage().data_ptr() == cache_v.untyped_storage().data_ptr()
    assert used.tolist() == [length] * batch
    ref_out, ref_lse = attention_f64(q, k, v, 1 / math.sqrt(dim), -1, 0 if causal else -1)
    _assert_close(out, ref_out, "out")
    _assert_close(lse, ref_lse, "lse", 1e-3)
    assert torch_flash.slotted_keys(k.transpose(1, 2)[:, :, :1], v.transpose(1, 2)[:, :, :1]) is not None
    assert torch_flash.slotted_keys(k.transpose(1, 2), v.transpose(1, 2).contiguous()) is None, \
        "key and value laid out alike, or no slots"
    assert torch_flash.slotted_keys(k.transpose(1, 2), cache_v[:, :, :length - 1].transpose(1, 2)) is None, \
        "key and value of one shape, or no slots (the checks then refuse the call)"


def _packed_batch(lengths_q, lengths_k, heads_q, heads_kv, dim, dtype):
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads_q, dim, dtype=dtype, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), heads_kv, dim, dtype=dtype, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), heads_kv, dim, dtype=dtype, requires_grad=True)
    return q, k, v, cu_q, cu_k


def _varlen_f64(q, k, v, cu_q, cu_k, scale, left, right):
    """Per-sequence attention_f64 over packed rows: (out (T, H, D), lse (H, T))."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        keys = slice(int(cu_k[i]), int(cu_k[i + 1]))
        o, l = attention_f64(q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None],
                             v[keys].transpose(0, 1)[None], scale, left, right)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (-1, 4), (2, 2), (1025, 1025)])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_torchs_varlen_attn_runs_the_provider_forward_and_backward(provider_on_cpu, window, heads_kv):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    if heads_kv != 4 and not _torch_varlen_has("enable_gqa"):
        pytest.skip("this torch's varlen_attn takes no enable_gqa")
    lengths = [5, 12, 1, 9]
    q, k, v, cu, _ = _packed_batch(lengths, lengths, 4, heads_kv, 32, torch.bfloat16)
    scale = 0.2
    kwargs = {"enable_gqa": True} if heads_kv != 4 else {}
    out, lse = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), scale=scale, window_size=window,
                           return_aux=AuxRequest(lse=True), **kwargs)
    ref_out, ref_lse = _varlen_f64(q, k, v, cu, cu, scale, *window)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    _assert_close(out, ref_out, "out")
    _assert_close(lse, ref_lse, "lse", 1e-3)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(_varlen_f64(*ref, cu, cu, scale, *window)[0], ref, grad.double())
    for name, g, e in zip("qkv", got, expected):
        _assert_close(g, e, f"d{name}")
    assert torch_flash.CALLS == {"forward": 1, "backward": 1}


def test_varlen_with_unequal_query_and_key_lengths_aligns_windows_bottom_right(provider_on_cpu):
    q, k, v, cu_q, cu_k = _packed_batch([2, 3], [6, 4], 2, 2, 48, torch.float16)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, 3, 6, 0.0, True, False,
                                                            window_size_left=2)
    ref_out, ref_lse = _varlen_f64(q, k, v, cu_q, cu_k, 1 / math.sqrt(48), 2, 0)
    _assert_close(out, ref_out, "out")
    _assert_close(lse, ref_lse, "lse", 1e-3)


@pytest.mark.skipif(not _torch_varlen_has("varlen_attn_out"), reason="this torch has no varlen_attn_out")
def test_torchs_varlen_attn_out_writes_through_the_inplace_op(provider_on_cpu):
    from torch.nn.attention.varlen import varlen_attn_out

    q, k, v, cu, _ = _packed_batch([3, 7], [3, 7], 2, 2, 32, torch.float16)
    out = torch.full_like(q, float("nan")).detach()
    with torch.no_grad():
        result = varlen_attn_out(out, q, k, v, cu, cu, 7, 7, window_size=(-1, 0))
    assert result is out or result.data_ptr() == out.data_ptr()
    _assert_close(out, _varlen_f64(q, k, v, cu, cu, 1 / math.sqrt(32), -1, 0)[0], "out")


def test_dense_flash_op_takes_bshd_and_returns_bhs_lse(provider_on_cpu):
    q, k, v = (torch.randn(3, 6, 2, 32, dtype=torch.float16) for _ in range(3))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 6, 6, 0.0, False, False, scale=0.4)
    ref_out, ref_lse = attention_f64(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.4, -1, -1)
    assert out.shape == q.shape and lse.shape == (3, 2, 6)
    _assert_close(out, ref_out.transpose(1, 2), "out")
    _assert_close(lse, ref_lse, "lse", 1e-3)


def test_sdpa_flash_op_under_torch_compile_fullgraph(provider_on_cpu):
    def attend(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0].float().sum()

    q, k, v = _inputs((1, 2, 8, 32), (1, 2, 8, 32), torch.float16, "bshd")
    loss = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = attention_f64(*ref, 1 / math.sqrt(32), -1, 0)[0]
    ref_loss = ref_out.sum()
    # The loss sums fp16 outputs: each is off by up to half an ulp (2^-11 relative), so the sum by
    # up to 2^-11 * sum |out|; twice that allows for the kernel's own rounding.
    bound = 2.0**-10 * ref_out.abs().sum().item()
    assert abs(loss.double().item() - ref_loss.item()) <= bound, (loss.item(), ref_loss.item(), bound)
    for name, g, e in zip("qkv", got, torch.autograd.grad(ref_loss, ref)):
        _assert_close(g, e, f"d{name}")
    assert torch_flash.CALLS["forward"] >= 1 and torch_flash.CALLS["backward"] >= 1


def test_this_torch_lays_out_varlen_lse_as_jitattn_does():
    assert torch_flash.varlen_lse_is_packed()  # else every varlen call would fall back


def test_dense_cu_seq_is_made_once_per_shape_and_device():
    first = torch_flash.dense_cu_seq(3, 5, torch.device("cpu"))
    assert first.tolist() == [0, 5, 10, 15] and first.dtype == torch.int32
    assert torch_flash.dense_cu_seq(3, 5, torch.device("cpu")) is first
    assert torch_flash.dense_cu_seq(3, 6, torch.device("cpu")).tolist() == [0, 6, 12, 18]


@pytest.mark.parametrize("is_causal, left, right, expected", [
    (False, None, None, (-1, -1)), (True, None, None, (-1, 0)), (True, 8, 3, (8, 0)), (False, 4, 2, (4, 2)),
])
def test_aten_window_maps_causal_and_none(is_causal, left, right, expected):
    assert torch_flash.aten_window(is_causal, left, right) == expected


# ----------------------------------------------------------------------------- fallback decisions
def _dense(dtype=torch.float16, dim=64, heads_q=4, heads_kv=4, device="cpu"):
    q = torch.empty(2, 8, heads_q, dim, dtype=dtype, device=device)
    kv = torch.empty(2, 8, heads_kv, dim, dtype=dtype, device=device)
    return q, kv, kv.clone()


def _varlen(dtype=torch.float16):
    q = torch.empty(10, 4, 64, dtype=dtype)
    return q, q.clone(), q.clone(), torch.tensor([0, 4, 10], dtype=torch.int32)


FORWARD_FALLBACKS = {
    "dropout": lambda: torch_flash.forward_fallback_reason(*_dense(), None, None, 0.1, False),
    "debug mask": lambda: torch_flash.forward_fallback_reason(*_dense(), None, None, 0.0, True),
    "alibi": lambda: torch_flash.forward_fallback_reason(*_dense(), None, None, 0.0, False,
                                                         alibi_slopes=torch.ones(4)),
    "float32": lambda: torch_flash.forward_fallback_reason(*_dense(torch.float32), None, None, 0.0, False),
    "float8": lambda: torch_flash.forward_fallback_reason(*_dense(torch.float8_e4m3fn), None, None, 0.0, False),
    "mixed dtypes": lambda: torch_flash.forward_fallback_reason(
        _dense()[0], *_dense(torch.bfloat16)[1:], None, None, 0.0, False),
    "head_dim 40": lambda: torch_flash.forward_fallback_reason(*_dense(dim=40), None, None, 0.0, False),
    "head_dim 16": lambda: torch_flash.forward_fallback_reason(*_dense(dim=16), None, None, 0.0, False),
    "head_dim 512": lambda: torch_flash.forward_fallback_reason(*_dense(dim=512), None, None, 0.0, False),
    "heads 6 over 4": lambda: torch_flash.forward_fallback_reason(*_dense(heads_q=6), None, None, 0.0, False),
    "int64 cum_seq": lambda: torch_flash.forward_fallback_reason(*_varlen()[:3], _varlen()[3].long(),
                                                                 _varlen()[3].long(), 0.0, False),
    "window below -1": lambda: torch_flash.forward_fallback_reason(*_dense(), None, None, 0.0, False,
                                                                   window_size_left=-2),
    "negative scale": lambda: torch_flash.forward_fallback_reason(*_dense(), None, None, 0.0, False, scale=-1.0),
    "nan scale": lambda: torch_flash.forward_fallback_reason(*_dense(), None, None, 0.0, False, scale=math.nan),
    "page size 3": lambda: torch_flash.forward_fallback_reason(
        _varlen()[0], torch.empty(5, 3, 4, 64, dtype=torch.float16), torch.empty(5, 3, 4, 64, dtype=torch.float16),
        _varlen()[3], None, 0.0, False, seqused_k=torch.tensor([4, 6], dtype=torch.int32),
        block_table=torch.zeros(2, 3, dtype=torch.int32)),
    "block_table without seqused_k": lambda: torch_flash.forward_fallback_reason(
        _varlen()[0], torch.empty(5, 4, 4, 64, dtype=torch.float16), torch.empty(5, 4, 4, 64, dtype=torch.float16),
        _varlen()[3], None, 0.0, False, block_table=torch.zeros(2, 3, dtype=torch.int32)),
    "3D dense query": lambda: torch_flash.forward_fallback_reason(*_varlen()[:3], None, None, 0.0, False),
    "empty batch": lambda: torch_flash.forward_fallback_reason(
        torch.empty(0, 8, 4, 64, dtype=torch.float16), *_dense()[1:], None, None, 0.0, False),
}


@pytest.mark.parametrize("case", sorted(FORWARD_FALLBACKS))
def test_forward_falls_back_for(case):
    with torch_flash.use_kernels(STAND_IN):
        assert FORWARD_FALLBACKS[case]() is not None


def test_forward_falls_back_off_cuda_and_below_sm80(monkeypatch):
    q, k, v = _dense()
    assert "not CUDA" in torch_flash.forward_fallback_reason(q, k, v, None, None, 0.0, False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    torch_flash._cuda_device_error.cache_clear()
    try:
        meta = torch.device("cuda", 5)  # any CUDA device id: the capability comes from the stub
        assert "sm_80" in torch_flash.JITATTN_KERNELS.device_error(meta)
    finally:
        torch_flash._cuda_device_error.cache_clear()


def test_supported_calls_do_not_fall_back():
    with torch_flash.use_kernels(STAND_IN):
        assert torch_flash.forward_fallback_reason(*_dense(), None, None, 0.0, False, scale=0.1,
                                                   window_size_left=8, window_size_right=0) is None
        assert torch_flash.forward_fallback_reason(*_dense(torch.bfloat16, 256, 8, 2), None, None, 0.0, False) is None
        q, k, v, cu = _varlen()
        assert torch_flash.forward_fallback_reason(q, k, v, cu, cu, 0.0, False) is None
        assert torch_flash.backward_fallback_reason(q, q, k, v, q, torch.empty(4, 10), cu, cu, 0.0) is None


@pytest.mark.parametrize("case", ["dropout", "float16 lse", "padded lse", "missing cum_seq_k", "float32 grad"])
def test_backward_falls_back_for(case):
    q, k, v, cu = _varlen()
    lse = torch.empty(4, 10)
    args = dict(grad_out=q, query=q, key=k, value=v, out=q, logsumexp=lse, cum_seq_q=cu, cum_seq_k=cu, dropout_p=0.0)
    if case == "dropout":
        args["dropout_p"] = 0.5
    elif case == "float16 lse":
        args["logsumexp"] = lse.half()
    elif case == "padded lse":
        args["logsumexp"] = torch.empty(2, 4, 6)
    elif case == "missing cum_seq_k":
        args["cum_seq_k"] = None
    else:
        args["grad_out"] = q.float()
    with torch_flash.use_kernels(STAND_IN):
        assert torch_flash.backward_fallback_reason(**args) is not None


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_fallback_runs_the_original_kernel_and_logs_once():
    calls = []

    class Original:
        def call_boxed(self, keyset, *args, **kwargs):
            calls.append((keyset, args, kwargs))
            return "aten's result"

    kernel = torch_flash.dispatching_kernel("_flash_attention_forward", Original())
    q, k, v = _dense()
    torch_flash.CALLS.clear()
    logger, records = logging.getLogger("jitattn.torch_flash"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        with torch_flash.use_kernels(STAND_IN):
            for _ in range(2):
                assert kernel("keyset", q, k, v, None, None, 8, 8, 0.25, False, False, scale=0.5) == "aten's result"
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert len(calls) == 2 and calls[0][0] == "keyset" and calls[0][1][7] == 0.25 and calls[0][2] == {"scale": 0.5}
    assert torch_flash.CALLS == {"fallback": 2}
    assert records.messages == ["aten::_flash_attention_forward runs torch's own kernel: dropout_p > 0 (logged once)"]


def test_flash_ops_that_torchs_kernel_calls_in_a_fallback_go_straight_to_torch():
    """SDPA's flash op falls back (dropout) and torch's kernel for it calls _flash_attention_forward:
    that inner call runs torch's kernel too, without a second decision, count or log line."""
    inner_calls = []

    class InnerOriginal:
        def call_boxed(self, keyset, *args, **kwargs):
            inner_calls.append(args[7])  # its dropout_p
            return "aten's inner result"

    inner = torch_flash.dispatching_kernel("_flash_attention_forward", InnerOriginal())
    q, k, v = _dense()

    class OuterOriginal:
        def call_boxed(self, keyset, *args, **kwargs):
            # what torch's SDPA flash kernel does: the varlen-capable flash op underneath, here one
            # jitattn would compute on its own (dropout 0)
            return inner(keyset, q, k, v, None, None, 8, 8, 0.0, False, False)

    outer = torch_flash.dispatching_kernel("_flash_attention_forward", OuterOriginal())
    torch_flash.CALLS.clear()
    with torch_flash.use_kernels(STAND_IN):
        assert outer("keyset", q, k, v, None, None, 8, 8, 0.25, False, False) == "aten's inner result"
        assert inner("keyset", q, k, v, None, None, 8, 8, 0.25, False, False) == "aten's inner result"
    assert inner_calls == [0.0, 0.25]
    assert torch_flash.CALLS == {"fallback": 2}  # one per outermost call


def test_a_call_jitattn_refuses_after_the_decision_still_runs_torchs_kernel():
    def refusing_forward(*args):
        raise ValueError("cu_seq_q must be contiguous")

    class Original:
        def call_boxed(self, keyset, *args, **kwargs):
            return "aten's result"

    kernel = torch_flash.dispatching_kernel("_flash_attention_forward", Original())
    torch_flash.CALLS.clear()
    with torch_flash.use_kernels(STAND_IN._replace(forward=refusing_forward)):
        assert kernel("keyset", *_dense(), None, None, 8, 8, 0.0, False, False) == "aten's result"
    assert torch_flash.CALLS == {"fallback": 1}


def test_the_fallback_decision_is_made_once_per_argument_facts(monkeypatch):
    """A model's layers repeat one call: its decision (forward_fallback_reason) is made once per
    op, kernel seam and arguments' shapes, dtypes, devices and values, and anew when any differ."""
    decided = []
    reason_for = torch_flash.forward_fallback_reason
    monkeypatch.setattr(torch_flash, "forward_fallback_reason",
                        lambda *a, **kw: decided.append(a[5]) or reason_for(*a, **kw))

    class Original:
        def call_boxed(self, keyset, *args, **kwargs):
            return "aten's result"

    kernel = torch_flash.dispatching_kernel("_flash_attention_forward", Original())
    torch_flash.CALLS.clear()
    with fresh_memos():  # no decision from an earlier test
        with torch_flash.use_kernels(STAND_IN):
            for _ in range(3):  # fresh tensors, the same facts: another layer
                out = kernel("keyset", *_dense(), None, None, 8, 8, 0.0, False, False, scale=0.5)[0]
                assert out.shape == _dense()[0].shape
            assert decided == [0.0]
            assert kernel("keyset", *_dense(), None, None, 8, 8, 0.25, False, False, scale=0.5) == "aten's result"
            q, k, v = _dense()
            kernel("keyset", q[:, :4], k[:, :4], v[:, :4], None, None, 4, 4, 0.0, False, False, scale=0.5)
            kernel("keyset", q.float(), k.float(), v.float(), None, None, 8, 8, 0.0, False, False, scale=0.5)
        assert decided == [0.0, 0.25, 0.0, 0.0], "another dropout, shape or dtype is decided anew"
        assert torch_flash.CALLS == {"forward": 4, "fallback": 2}
        with torch_flash.use_kernels(STAND_IN._replace(device_error=lambda device: "not this device")):
            assert kernel("keyset", *_dense(), None, None, 8, 8, 0.0, False, False, scale=0.5) == "aten's result"
        assert len(decided) == 5, "another kernel seam is decided anew"
