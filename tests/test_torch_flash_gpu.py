"""GPU: with jitattn active as torch's flash-attention provider, SDPA's flash path and torch's own
varlen_attn compute jitattn's results (bit for bit those of jitattn.varlen_attn) that match float64
forward and backward; calls jitattn does not compute run torch's kernel; torch.compile(fullgraph)
and CUDA graph capture work. The CPU side (registration, mapping, decisions): test_torch_flash.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import jitattn
from jitattn.integrations import torch_flash
from tests.gpu_utils import assert_close
from tests.test_torch_flash import _varlen_f64, attention_f64

pytestmark = pytest.mark.gpu
registry = torch.nn.attention._registry


@pytest.fixture
def active():
    if not hasattr(registry, "activate_flash_attention_impl"):
        pytest.skip("this torch has no flash-attention registry")
    jitattn.activate()
    torch_flash.CALLS.clear()
    try:
        yield
    finally:
        jitattn.restore()


def _bshd(batch, heads, seqlen, dim, dtype, grad=True):
    """(B, H, S, D) views of (B, S, H, D) storage, as models hand SDPA."""
    t = torch.randn(batch, seqlen, heads, dim, dtype=dtype, device="cuda").transpose(1, 2)
    return t.detach().requires_grad_(grad)


def _grads_f64(q, k, v, grad, scale, left, right):
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, _ = attention_f64(*ref, scale, left, right)
    return out, torch.autograd.grad(out, ref, grad.double())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal, heads_kv, seqlen", [(False, 8, 200), (True, 8, 333), (True, 2, 128)])
def test_sdpa_flash_path_runs_jitattn_forward_and_backward(active, dtype, dim, causal, heads_kv, seqlen):
    q = _bshd(2, 8, seqlen, dim, dtype)
    k, v = _bshd(2, heads_kv, seqlen, dim, dtype), _bshd(2, heads_kv, seqlen, dim, dtype)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads_kv != 8)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), grad)
    assert torch_flash.CALLS["forward"] == 1 and torch_flash.CALLS["backward"] == 1
    assert torch_flash.CALLS["fallback"] == 0
    # jitattn's own result, bit for bit
    packed = [t.detach().transpose(1, 2).reshape(-1, t.shape[1], dim) for t in (q, k, v)]
    cu = torch.arange(0, 3 * seqlen, seqlen, dtype=torch.int32, device="cuda")
    direct = jitattn.varlen_attn(*packed, cu, cu, seqlen, seqlen, window_size=(-1, 0) if causal else (-1, -1),
                                 enable_gqa=heads_kv != 8)
    assert torch.equal(out.detach().transpose(1, 2).reshape_as(direct), direct)
    ref, ref_grads = _grads_f64(q, k, v, grad, 1 / math.sqrt(dim), -1, 0 if causal else -1)
    assert_close(out, ref, 2e-2, 3e-2, "out")
    for name, g, e in zip("qkv", got, ref_grads):
        assert_close(g, e, 3e-2, 1e-1, f"d{name}")


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("seqlen_q, heads_kv", [(1, 2), (1, 8), (5, 2)])
def test_sdpa_decode_on_a_batched_kv_cache_reads_it_in_place(active, dim, seqlen_q, heads_kv):
    """SDPA's decode calls on a (B, H, L, D) cache with room for more keys (a static cache; a
    DynamicCache is the case without room): the provider reads each batch row's slot in place
    (torch_flash.slotted_keys: seqused_k, strides of the cache) and matches float64, the cache's
    unused tail NaN (never read). No is_causal: SDPA gives a causal call with fewer queries than
    keys to another backend (torch 2.11: "Flash attention does not support the is_causal flag when
    seqlen_q != seqlen_k") before any flash kernel, torch's or a provider's, is asked."""
    batch, length, room = 4, 777, 1024
    cache_k, cache_v = (torch.full((batch, heads_kv, room, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    for cache in (cache_k, cache_v):
        cache[:, :, :length].normal_()
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]
    q = torch.randn(batch, 8, seqlen_q, dim, dtype=torch.bfloat16, device="cuda")
    assert torch_flash.slotted_keys(k.transpose(1, 2), v.transpose(1, 2)) is not None
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=heads_kv != 8)
    assert torch_flash.CALLS["forward"] == 1 and torch_flash.CALLS["fallback"] == 0
    ref, _ = attention_f64(q, k, v, 1 / math.sqrt(dim), -1, -1)
    assert not out.isnan().any()
    assert_close(out, ref, 2e-2, 3e-2, "out")


def _torch_varlen_attn(q, k, v, cu, max_len, window):
    """torch's varlen_attn with a window: `window_size` on newer torch, `is_causal` on older."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if "window_size" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window)
    if window not in ((-1, -1), (-1, 0)):
        pytest.skip(f"this torch's varlen_attn has no window_size (window {window})")
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=window == (-1, 0))


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (4, 0), (-1, 4), (8, 2)])
def test_torchs_varlen_attn_runs_jitattn_forward_and_backward(active, window):
    lengths = [64, 128, 17, 100]  # max_q <= 128: torch's varlen_attn takes its flash path, not cuDNN's
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(int(cu[-1]), 8, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
               for _ in range(3))
    out = _torch_varlen_attn(q, k, v, cu, 128, window)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert torch_flash.CALLS["forward"] == 1 and torch_flash.CALLS["backward"] == 1
    direct = jitattn.varlen_attn(q.detach(), k.detach(), v.detach(), cu, cu, 128, 128, window_size=window)
    assert torch.equal(out.detach(), direct)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = _varlen_f64(*ref, cu.cpu(), cu.cpu(), 1 / math.sqrt(128), *window)
    assert_close(out, ref_out, 2e-2, 3e-2, "out")
    for name, g, e in zip("qkv", got, torch.autograd.grad(ref_out, ref, grad.double())):
        assert_close(g, e, 3e-2, 1e-1, f"d{name}")


@pytest.mark.parametrize("case", ["dropout", "head_dim 40"])
def test_calls_jitattn_does_not_compute_run_torchs_kernel(active, case):
    dim, dropout = (40, 0.0) if case == "head_dim 40" else (64, 0.3)
    q, k, v = (_bshd(2, 4, 96, dim, torch.float16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        out.backward(torch.randn_like(out))
    assert torch_flash.CALLS["forward"] == 0 and torch_flash.CALLS["fallback"] == 2
    assert q.grad is not None and torch.isfinite(q.grad).all()
    if not dropout:
        ref, _ = attention_f64(q, k, v, 1 / math.sqrt(dim), -1, 0)
        assert_close(out, ref, 2e-2, 3e-2, "out")


def test_sdpa_flash_path_under_torch_compile_fullgraph(active):
    def block(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (_bshd(2, 8, 256, 128, torch.bfloat16) for _ in range(3))
    compiled = torch.compile(block, fullgraph=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # read when the graph is traced: the flash op goes in
        out = compiled(q, k, v)
        out.sum().backward()
    assert torch_flash.CALLS["forward"] >= 1 and torch_flash.CALLS["backward"] >= 1
    ref, ref_grads = _grads_f64(q, k, v, torch.ones_like(out), 1 / math.sqrt(128), -1, 0)
    assert_close(out, ref, 2e-2, 3e-2, "out")
    assert_close(q.grad, ref_grads[0], 3e-2, 1e-1, "dq")


def test_sdpa_flash_path_forward_and_backward_capture_into_a_cuda_graph(active):
    q, k, v = (_bshd(2, 8, 192, 64, torch.float16) for _ in range(3))
    grad = torch.randn(2, 8, 192, 64, dtype=torch.float16, device="cuda")

    def step():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        dq, = torch.autograd.grad(out, (q,), grad)
        return out, dq

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm: kernels built and loaded, dense cu_seq made
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dq = step()
    with torch.no_grad():
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_grads = _grads_f64(q, k, v, grad, 1 / math.sqrt(64), -1, 0)
    assert_close(out, ref, 2e-2, 3e-2, "replayed out")
    assert_close(dq, ref_grads[0], 3e-2, 1e-1, "replayed dq")
