"""The custom ops (jitattn/varlen/ops.py, jitattn/decode/ops.py) on a GPU: opcheck, torch.compile(fullgraph=True), CUDA graphs."""
import pytest
import torch

import jitattn
import jitattn.decode.api
import jitattn.varlen.ops  # noqa: F401  (registers torch.ops.jitattn.varlen_attn*)

jitattn.decode.api.ops_registered()  # registers torch.ops.jitattn.single_decode_with_kv_cache
from jitattn.reference import single_decode_reference, varlen_attn_reference
from tests.gpu_utils import assert_close

pytestmark = pytest.mark.gpu


def _batch(lengths_q, lengths_k, heads_q=8, heads_kv=2, head_dim=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q[-1]), heads_q, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(int(cu_k[-1]), heads_kv, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(int(cu_k[-1]), heads_kv, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


def _paged(lengths_k, page_size=16, heads_kv=2, head_dim=128, dtype=torch.bfloat16, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = max(-(-n // page_size) for n in lengths_k)
    total = pages_per_seq * len(lengths_k)
    k = torch.randn(total, page_size, heads_kv, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(total, page_size, heads_kv, head_dim, device="cuda", dtype=dtype, generator=g)
    table = torch.randperm(total, device="cuda", generator=g).to(torch.int32).view(len(lengths_k), pages_per_seq)
    used = torch.tensor(lengths_k, dtype=torch.int32, device="cuda")
    return k, v, table, used


def test_opcheck_varlen_ops():
    q, k, v, cu_q, cu_k, max_q, max_k = _batch([5, 130, 1], [300, 130, 77])
    args = (q, k, v, cu_q, cu_k, max_q, max_k, None, [-1, 0], True, None, None, None, True)
    torch.library.opcheck(torch.ops.jitattn.varlen_attn.default, args)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.jitattn.varlen_attn_out.default, (out,) + args)
    pk, pv, table, used = _paged([300, 130, 77])
    paged = (q, pk, pv, cu_q, None, max_q, max_k, 0.1, [-1, -1], True, used, table, 2, False)
    torch.library.opcheck(torch.ops.jitattn.varlen_attn.default, paged)


def test_opcheck_decode_op():
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(32, 128, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(1000, 8, 128, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(1000, 8, 128, device="cuda", dtype=torch.float16, generator=g)
    args = (q, k, v, "NHD", "NONE", False, None, None, None, -1, None, None, None, None)
    torch.library.opcheck(torch.ops.jitattn.single_decode_with_kv_cache.default, args)


def test_compile_fullgraph_runs_both_apis_without_graph_breaks():
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k, max_q, max_k = _batch([17, 200], [40, 260])
    dq = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    dk = torch.randn(500, 8, 128, device="cuda", dtype=torch.float16)
    dv = torch.randn(500, 8, 128, device="cuda", dtype=torch.float16)

    def model(q, k, v, out, dq, dk, dv):
        o, lse = jitattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True,
                                     return_aux=jitattn.AuxRequest(lse=True))
        jitattn.varlen_attn_out(out, q * 2, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True)
        d = jitattn.single_decode_with_kv_cache(dq, dk, dv)
        return o + 1, lse, d * 2

    out = torch.empty_like(q)
    compiled = torch.compile(model, fullgraph=True)
    o, lse, d = compiled(q, k, v, out, dq, dk, dv)
    ref_o, ref_lse = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True)
    assert_close(o - 1, ref_o, 2e-2, 8e-2, "compiled varlen_attn")
    assert_close(lse, ref_lse, 1e-4, 2e-3, "compiled varlen_attn lse")
    ref_out2, _ = varlen_attn_reference(q * 2, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True)
    assert_close(out, ref_out2, 2e-2, 8e-2, "compiled varlen_attn_out (mutated out)")
    ref_d, _ = single_decode_reference(dq, dk, dv)
    assert_close(d / 2, ref_d, 4e-3, 2e-2, "compiled decode")


def test_cuda_graph_capture_and_replay_match_eager():
    q, k, v, cu_q, cu_k, max_q, max_k = _batch([1] * 8, [100, 2000, 37, 4096, 1, 500, 900, 3000])
    pk, pv, table, used = _paged([100, 2000, 37, 4096, 1, 500, 900, 3000])
    dq = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    dk = torch.randn(3000, 4, 128, device="cuda", dtype=torch.bfloat16)
    dv = torch.randn(3000, 4, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def step():
        a = jitattn.varlen_attn(q, pk, pv, cu_q, None, max_q, max_k, enable_gqa=True, seqused_k=used,
                                block_table=table)
        b = jitattn.varlen_attn_out(out, q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True, window_size=(64, 0))
        c = jitattn.single_decode_with_kv_cache(dq, dk, dv)
        return a, b, c

    eager = [t.clone() for t in step()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up on a side stream, as torch's CUDA-graph docs ask
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for want, got in zip(eager, captured):
        assert torch.equal(want, got)
    # New inputs, same buffers: replay follows them.
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = varlen_attn_reference(q, pk, pv, cu_q, None, max_q, max_k, enable_gqa=True, seqused_k=used, block_table=table)
    assert_close(captured[0], ref, 2e-2, 8e-2, "replayed paged varlen")
