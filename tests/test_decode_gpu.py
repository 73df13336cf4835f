"""single_decode_with_kv_cache on a GPU against the float64 reference (skipped without a GPU)."""
import itertools

import pytest
import torch

import jitattn
from jitattn.reference import single_decode_reference
from tests.gpu_utils import assert_close, poison_allocator

pytestmark = pytest.mark.gpu

TOL = {torch.float16: (4e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative, max abs) on out
HEADS = [(4, 4), (8, 2), (16, 2), (12, 4), (16, 1)]  # group sizes 1, 4, 8, 3, 16
KV_LENS = [1, 7, 255, 4096, 32768]


def make_inputs(num_qo, num_kv, kv_len, head_dim, dtype, layout, seed, q_gain=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(num_qo, head_dim, device="cuda", dtype=dtype, generator=g) * q_gain
    shape = (kv_len, num_kv, head_dim) if layout == "NHD" else (num_kv, kv_len, head_dim)
    k = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def check_decode(q, k, v, layout, window, cap, want_lse, what):
    poison_allocator(q.numel() * q.element_size())
    result = jitattn.single_decode_with_kv_cache(
        q, k, v, kv_layout=layout, window_left=window, logits_soft_cap=cap, return_lse=want_lse
    )
    ref_out, ref_lse = single_decode_reference(q, k, v, kv_layout=layout, window_left=window, logits_soft_cap=cap)
    out, lse = result if want_lse else (result, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    rel, abs_ = TOL[q.dtype]
    assert_close(out, ref_out, rel, abs_, what)
    if want_lse:
        assert lse.shape == (q.shape[0],) and lse.dtype == torch.float32
        assert_close(lse, ref_lse, 1e-4, 2e-3, what + " lse")


# Every head_dim x dtype x layout x GQA x kv_len; cap/window/lse rotate through their 8
# combinations so each value of each meets every shape dimension.
GRID = list(itertools.product([64, 128, 256], [torch.float16, torch.bfloat16], ["NHD", "HND"], HEADS, KV_LENS))


@pytest.mark.parametrize("case", range(len(GRID)))
def test_decode_matches_reference_on_grid(case):
    head_dim, dtype, layout, (num_qo, num_kv), kv_len = GRID[case]
    cap_on, window_on, want_lse = ((case >> b) & 1 for b in range(3))
    window = [-1, max(0, kv_len // 3)][window_on]
    cap = 30.0 if cap_on else None
    q, k, v = make_inputs(num_qo, num_kv, kv_len, head_dim, dtype, layout, seed=case, q_gain=2.0)
    what = f"d{head_dim} {dtype} {layout} {num_qo}/{num_kv} L={kv_len} cap={cap} win={window} lse={want_lse}"
    check_decode(q, k, v, layout, window, cap, bool(want_lse), what)


@pytest.mark.parametrize("cap,window,want_lse", list(itertools.product([None, 50.0], [-1, 0, 1, 100, 5000], [False, True])))
def test_decode_cap_window_lse_combinations(cap, window, want_lse):
    q, k, v = make_inputs(32, 8, 3000, 128, torch.float16, "NHD", seed=7)
    check_decode(q, k, v, "NHD", window, cap, want_lse, f"cap={cap} win={window}")


@pytest.mark.parametrize("head_dim", [32, 48, 96, 160, 256])
def test_decode_unusual_head_dims(head_dim):
    q, k, v = make_inputs(8, 2, 777, head_dim, torch.bfloat16, "HND", seed=head_dim)
    check_decode(q, k, v, "HND", -1, None, True, f"d{head_dim}")


def test_decode_non_contiguous_and_misaligned_inputs():
    q_full, k_full, v_full = make_inputs(16, 8, 1000, 128, torch.float16, "NHD", seed=3)
    # Strided views the kernel reads in place (every other kv head) ...
    k, v = k_full[:, ::2], v_full[:, ::2]
    q = q_full[::2]
    check_decode(q, k, v, "NHD", -1, None, True, "strided views")
    # ... and views it must copy (unit last stride missing; base not 16-byte aligned).
    kt = k_full.transpose(0, 2).contiguous().transpose(0, 2)[:, :4]
    check_decode(q, kt, v[:, :4].contiguous(), "NHD", -1, None, False, "last-dim strided")
    flat = torch.randn(1 + 1000 * 4 * 128, device="cuda", dtype=torch.float16)
    k_odd = flat[1:].view(1000, 4, 128)
    check_decode(q, k_odd, v[:, :4], "NHD", -1, None, False, "misaligned base")


def test_decode_default_scale_and_explicit_scales():
    q, k, v = make_inputs(8, 8, 513, 128, torch.float16, "NHD", seed=11)
    out = jitattn.single_decode_with_kv_cache(q, k, v, sm_scale=0.05, q_scale=2.0, k_scale=0.5)
    ref, _ = single_decode_reference(q, k, v, sm_scale=0.05, q_scale=2.0, k_scale=0.5)
    assert_close(out, ref, 4e-3, 2e-2, "explicit scales")


def test_decode_large_logits_are_stable():
    # Logits of magnitude ~1e3: the online softmax must not overflow.
    q, k, v = make_inputs(4, 4, 4096, 64, torch.float16, "NHD", seed=5, q_gain=30.0)
    check_decode(q, k, v, "NHD", -1, None, True, "large logits")


def test_decode_is_deterministic():
    q, k, v = make_inputs(32, 8, 20000, 128, torch.bfloat16, "NHD", seed=9)
    first = jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True)
    for _ in range(3):
        again = jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_decode_runs_on_the_current_stream():
    q, k, v = make_inputs(32, 32, 8192, 128, torch.float16, "NHD", seed=13)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = jitattn.single_decode_with_kv_cache(q, k, v)
    stream.synchronize()
    ref, _ = single_decode_reference(q, k, v)
    assert_close(out, ref, 4e-3, 2e-2, "side stream")


def test_decode_cuda_graph_replay_matches_eager():
    q, k, v = make_inputs(32, 8, 4096, 128, torch.float16, "NHD", seed=17)
    eager = jitattn.single_decode_with_kv_cache(q, k, v)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        jitattn.single_decode_with_kv_cache(q, k, v)  # warm up (loads the module) off-graph
        with torch.cuda.graph(graph):
            captured = jitattn.single_decode_with_kv_cache(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = single_decode_reference(q, k, v)
    assert_close(captured, ref, 4e-3, 2e-2, "graph replay with new q")
    assert not torch.equal(captured, eager)
