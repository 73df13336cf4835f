"""User variants through jitattn.varlen_attn on the GPU (issue 46): every variant of the acceptance
set (jitattn/variants/gallery.py) against the float64 reference built from the same user function,
forward (out, lse) and gradients, across the kernels a call can take (mma.sync, the wgmma rungs at
D64 / D128 / D256 with the producer, the dQ kernel, the decode shape, splits, paged keys), with GQA,
windows on top, uneven lengths and an empty sequence; a causal / sliding-window mask against the
built-in window; deterministic mode; CUDA graphs (new captured values replay without a recompile);
torch.compile with a traced variant (fullgraph) and with a function."""
from __future__ import annotations

import math

import pytest
import torch

import jitattn
from jitattn.reference import varlen_attn_reference
from jitattn.variants import gallery
from tests.gpu_utils import rel_error
from tests.varlen_utils import DEVICE, TOL, check, make_batch

pytestmark = pytest.mark.gpu
BF16, F16 = torch.bfloat16, torch.float16
GRAD_REL = {F16: 1e-2, BF16: 3e-2}
GRAD_ABS = {F16: 1e-2, BF16: 4e-2}
LEN_Q = [37, 0, 300, 129]
LEN_K = [37, 5, 300, 200]  # q_len < k_len in the last: bottom-right alignment matters


def _variants(h_q: int, max_len: int, n: int, device=DEVICE) -> dict:
    slopes = jitattn.reference.alibi_slopes(h_q).to(device, torch.float32)
    gen = torch.Generator(device=device).manual_seed(7)
    bias = torch.randn(h_q, 2 * max_len + 1, device=device, generator=gen)
    doc_id = (torch.arange(max_len, device=device) // 50).to(torch.int32).repeat(n, 1)
    doc_id[1::2] = (torch.arange(max_len, device=device) // 77).to(torch.int32)
    prefix = torch.tensor([5, 0, 100, 64][:n] + [3] * max(0, n - 4), dtype=torch.int32, device=device)
    return {
        "relative": (gallery.relative_position, None),
        "alibi": (gallery.alibi(slopes), None),
        "bias_table": (gallery.bias_table(bias, max_len), None),
        "softcap": (gallery.soft_cap(20.0), None),
        "causal": (None, gallery.causal),
        "sliding": (None, gallery.sliding_window(40)),
        "document": (None, gallery.document(doc_id)),
        "prefix_lm": (None, gallery.prefix_lm(prefix)),
        "alibi+document": (gallery.alibi(slopes), gallery.document(doc_id)),
    }


def _reference(b, score_mod, mask_mod, window=(-1, -1), grad_out=None):
    """float64 (out, lse) and, with grad_out, (dq, dk, dv) by autograd through the reference."""
    q, k, v = (t.detach().double().requires_grad_(grad_out is not None) for t in (b.query, b.key, b.value))
    out, lse = varlen_attn_reference(q, k, v, b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k, window_size=window,
                                     enable_gqa=b.enable_gqa, seqused_k=b.seqused_k, block_table=b.block_table,
                                     score_mod=score_mod, mask_mod=mask_mod)
    if grad_out is None:
        return out.detach(), lse.detach(), None
    grads = torch.autograd.grad(out, (q, k, v), grad_out.double(), allow_unused=True)
    return out.detach(), lse.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


def _check_grads(got, want, dtype, what):
    scale = max(w.abs().max().item() if w.numel() else 0.0 for w in want)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g is not None and not torch.isnan(g).any(), f"{what}: NaN or no {name}"
        if not g.numel():
            continue
        max_abs = (g.double() - w).abs().max().item()
        assert max_abs <= GRAD_ABS[dtype] * max(scale, 1e-6), f"{what}: {name} max abs {max_abs:.3e} (scale {scale:.3e})"
        if w.norm().item() > 1e-6 * max(scale, 1e-30) * math.sqrt(w.numel()):
            err = rel_error(g, w)
            assert err < GRAD_REL[dtype], f"{what}: {name} relative error {err:.2e}"


def _check_forward_and_backward(b, score_mod, mask_mod, dtype, what):
    """varlen_attn with the variants on batch b against float64: out and lse, then the gradients
    of a random upstream gradient."""
    query, key, value = (t.detach().requires_grad_(True) for t in (b.query, b.key, b.value))
    out, lse = jitattn.varlen_attn(query, key, value, *b.args()[3:], enable_gqa=b.enable_gqa, score_mod=score_mod,
                                   mask_mod=mask_mod, return_aux=jitattn.AuxRequest(lse=True))
    grad_out = torch.randn_like(out)
    ref_out, ref_lse, ref_grads = _reference(b, score_mod, mask_mod, grad_out=grad_out)
    with torch.no_grad():
        check(b, out.detach(), lse.detach(), (ref_out, ref_lse), f"{what} forward")
    got = torch.autograd.grad(out, (query, key, value), grad_out)
    _check_grads(got, ref_grads, dtype, f"{what} backward")


NAMES = ["relative", "alibi", "bias_table", "softcap", "causal", "sliding", "document", "prefix_lm",
         "alibi+document"]
CASES = [  # (head_dim, dtype, h_q, h_kv)
    (64, BF16, 4, 2), (128, BF16, 4, 4), (128, F16, 8, 2), (256, BF16, 2, 1), (96, F16, 2, 2)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("head_dim,dtype,h_q,h_kv", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_variant_matches_float64_forward_and_backward(name, head_dim, dtype, h_q, h_kv):
    b = make_batch(LEN_Q, LEN_K, h_q, h_kv, head_dim, dtype, seed=head_dim + h_q)
    score_mod, mask_mod = _variants(h_q, max(LEN_K), len(LEN_Q))[name]
    _check_forward_and_backward(b, score_mod, mask_mod, dtype, f"{name} d{head_dim} {dtype}")


@pytest.mark.parametrize("window", [(-1, 0), (30, 0), (16, 16)])
@pytest.mark.parametrize("name", ["alibi", "document", "prefix_lm"])
def test_variants_compose_with_windows_splits_and_seqused_k(name, window):
    b = make_batch(LEN_Q, LEN_K, 4, 2, 128, BF16, seed=3, use_seqused=True, slack=5, fill=float("nan"))
    score_mod, mask_mod = _variants(4, max(LEN_K) + 5, len(LEN_Q))[name]
    ref_out, ref_lse, _ = _reference(b, score_mod, mask_mod, window)
    for splits in (None, 1, 3):
        out, lse = jitattn.varlen_attn(*b.args(), window_size=window, num_splits=splits, score_mod=score_mod,
                                       mask_mod=mask_mod, return_aux=jitattn.AuxRequest(lse=True), **b.kwargs())
        check(b, out, lse, (ref_out, ref_lse), f"{name} window={window} num_splits={splits}")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_variants_on_the_decode_shape_and_paged_keys(head_dim):
    len_q, len_k = [1, 1, 2, 1], [300, 0, 77, 1000]
    for paged in (False, True):
        b = make_batch(len_q, len_k, 8, 2, head_dim, BF16, seed=11, paged=paged, page_size=16)
        for name in ("alibi", "sliding", "prefix_lm"):
            score_mod, mask_mod = _variants(8, max(len_k), len(len_q))[name]
            ref_out, ref_lse, _ = _reference(b, score_mod, mask_mod)
            out, lse = jitattn.varlen_attn(*b.args(), score_mod=score_mod, mask_mod=mask_mod,
                                           return_aux=jitattn.AuxRequest(lse=True), **b.kwargs())
            check(b, out, lse, (ref_out, ref_lse), f"{name} decode paged={paged}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_causal_and_sliding_masks_equal_the_built_in_window(head_dim, monkeypatch):
    """Through the mask hook (JITATTN_LOWER_WINDOWS=0: by default such masks run as the built-in
    window itself, jitattn/variants/window.py), and lowered."""
    b = make_batch([512, 300], [512, 700], 4, 4, head_dim, BF16, seed=5)
    rel, abs_ = TOL[BF16]
    for lower in ("0", "1"):
        monkeypatch.setenv("JITATTN_LOWER_WINDOWS", lower)
        for mask_mod, window in ((gallery.causal, (-1, 0)), (gallery.sliding_window(100), (100, 0))):
            masked = jitattn.varlen_attn(*b.args(), mask_mod=mask_mod)
            built_in = jitattn.varlen_attn(*b.args(), window_size=window)
            assert (masked.float() - built_in.float()).abs().max().item() < abs_ / 4, \
                f"mask vs window {window}, JITATTN_LOWER_WINDOWS={lower}"


def test_deterministic_backward_with_a_mask_is_bitwise_reproducible():
    b = make_batch([700, 300], [700, 900], 8, 2, 128, BF16, seed=9)
    mask_mod = gallery.document((torch.arange(900, device=DEVICE) // 128).to(torch.int32).repeat(2, 1))
    grad_out = torch.randn(b.query.shape, device=DEVICE, dtype=BF16)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            q, k, v = (t.detach().clone().requires_grad_(True) for t in (b.query, b.key, b.value))
            out = jitattn.varlen_attn(q, k, v, *b.args()[3:], enable_gqa=True, window_size=(-1, 0),
                                      mask_mod=mask_mod)
            runs.append(torch.autograd.grad(out, (q, k, v), grad_out))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, c in zip(*runs):
        assert torch.equal(a, c)
    _, _, want = _reference(b, None, mask_mod, (-1, 0), grad_out)
    _check_grads(runs[0], want, BF16, "deterministic document mask")


def test_new_captured_values_replay_in_a_cuda_graph_without_a_recompile():
    b = make_batch([256, 128], [256, 128], 4, 4, 128, BF16, seed=2)
    slopes = torch.rand(4, device=DEVICE)
    score_mod = gallery.alibi(slopes)
    jitattn.varlen_attn(*b.args(), score_mod=score_mod)  # compile and trace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = jitattn.varlen_attn(*b.args(), score_mod=score_mod)
    for _ in range(2):
        slopes.copy_(torch.rand(4, device=DEVICE) * 4)
        graph.replay()
        ref, _, _ = _reference(b, score_mod, None)
        check(b, out, None, (ref, torch.zeros(4, b.query.shape[0], dtype=torch.float64, device=DEVICE)),
              "graph replay with new slopes")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_mask_maps_of_masks_reading_captures_match_float64(head_dim):
    """The mask map (templates/varlen/mask_map.cuh) of masks that read captured tensors: documents
    whose ids are not sorted (a row block's visible key tiles are not contiguous: empty tiles
    inside its span), and a mask reading h (a map slot per KV head), GQA, several key tiles per
    sequence, an empty query sequence and q_len < k_len; forward and gradients against float64."""
    len_q, len_k = [700, 0, 513, 1000], [700, 300, 900, 1000]
    b = make_batch(len_q, len_k, 8, 2, head_dim, BF16, seed=11 + head_dim)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    shuffled = (torch.arange(1000, device=DEVICE) // 96).to(torch.int32)
    doc_id = torch.stack([shuffled[torch.randperm(1000, device=DEVICE, generator=gen)] % 3 if i % 2 else shuffled
                          for i in range(4)])
    head_causal = torch.tensor([True, False] * 4, device=DEVICE)
    masks = {"unsorted documents": gallery.document(doc_id),
             "by head": lambda b_, h, q_idx, kv_idx: (head_causal[h] & (q_idx >= kv_idx)) | (q_idx - kv_idx > 600)}
    for name, mask_mod in masks.items():
        _check_forward_and_backward(b, None, mask_mod, BF16, f"{name} d{head_dim}")


def test_a_document_mask_replays_in_a_cuda_graph_with_new_ids():
    """The mask map is built on the device in every call: a captured graph replayed with other
    document ids follows them (no stale map, no host read), forward and backward."""
    b = make_batch([640, 384], [640, 384], 4, 4, 128, BF16, seed=4)
    doc_id = torch.zeros(2, 640, dtype=torch.int32, device=DEVICE)
    mask_mod = gallery.document(doc_id)
    q, k, v = (t.detach().requires_grad_(True) for t in (b.query, b.key, b.value))
    grad_out = torch.randn_like(b.query)

    def step():
        out = jitattn.varlen_attn(q, k, v, *b.args()[3:], mask_mod=mask_mod)
        return (out,) + torch.autograd.grad(out, (q, k, v), grad_out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile, trace and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    for width in (64, 200, 1000):
        doc_id.copy_((torch.arange(640, device=DEVICE) // width).to(torch.int32).repeat(2, 1))
        graph.replay()
        ref_out, _, ref_grads = _reference(b, None, mask_mod, grad_out=grad_out)
        assert (results[0].double() - ref_out).abs().max().item() < 2e-2, f"graph replay, documents of {width}"
        _check_grads(results[1:], ref_grads, BF16, f"graph replay, documents of {width}")


def test_torch_compile_with_a_traced_variant_fullgraph_and_with_a_function():
    from jitattn.variants import trace_score_mod

    b = make_batch([200, 64], [200, 64], 4, 2, 64, F16, seed=4)
    slopes = torch.rand(4, device=DEVICE)
    traced = trace_score_mod(gallery.alibi(slopes))

    @torch.compile(fullgraph=True)
    def step(q, k, v, cu_q, cu_k):
        return jitattn.varlen_attn(q, k, v, cu_q, cu_k, 200, 200, enable_gqa=True, score_mod=traced) * 2

    ref, _, _ = _reference(b, gallery.alibi(slopes), None)
    out = step(*b.args()[:5])
    assert rel_error(out.double() / 2, ref) < TOL[F16][0]

    @torch.compile
    def step_fn(q, k, v, cu_q, cu_k):
        return jitattn.varlen_attn(q, k, v, cu_q, cu_k, 200, 200, enable_gqa=True, score_mod=gallery.alibi(slopes))

    assert rel_error(step_fn(*b.args()[:5]).double(), ref) < TOL[F16][0]


def test_capture_on_another_device_or_requiring_grad_is_refused():
    b = make_batch([16], [16], 2, 2, 64, BF16, seed=1)
    with pytest.raises(ValueError, match="captured tensor"):
        jitattn.varlen_attn(*b.args(), score_mod=gallery.alibi(torch.rand(2)))  # a CPU tensor
    with pytest.raises(ValueError, match="requires grad"):
        jitattn.varlen_attn(*b.args(), score_mod=gallery.alibi(torch.rand(2, device=DEVICE, requires_grad=True)))
    with pytest.raises(ValueError, match="softcap and score_mod"):
        jitattn.varlen_attn(*b.args(), softcap=30.0, score_mod=gallery.relative_position)


def test_reads_outside_a_capture_and_of_an_empty_one_are_zeros():
    """A table read past its ends (a band of 2 * 5 + 1, keys up to 300 apart) and reads of an
    empty capture (the binding passes its data as null) give 0, forward and backward, with and
    without GQA packing (the shared-read path runs without it). The reference, which refuses
    such reads as torch does, gets the band zero-padded to every distance, and no score_mod."""
    band = torch.randn(4, 11, device=DEVICE)
    reach = max(LEN_K)
    padded = torch.zeros(4, 2 * reach + 1, device=DEVICE)
    padded[:, reach - 5:reach + 6] = band
    for h_kv in (4, 2):
        b = make_batch(LEN_Q, LEN_K, 4, h_kv, 64, BF16, seed=11 + h_kv)
        for table, same_as in ((band, gallery.bias_table(padded, reach)), (torch.empty(4, 0, device=DEVICE), None)):
            what = f"table {tuple(table.shape)} h_kv {h_kv}"
            query, key, value = (t.detach().requires_grad_(True) for t in (b.query, b.key, b.value))
            out, lse = jitattn.varlen_attn(query, key, value, *b.args()[3:], enable_gqa=b.enable_gqa,
                                           score_mod=gallery.bias_table(table, 5),
                                           return_aux=jitattn.AuxRequest(lse=True))
            grad_out = torch.randn_like(out)
            ref_out, ref_lse, ref_grads = _reference(b, same_as, None, grad_out=grad_out)
            with torch.no_grad():
                check(b, out.detach(), lse.detach(), (ref_out, ref_lse), f"{what} forward")
            _check_grads(torch.autograd.grad(out, (query, key, value), grad_out), ref_grads, BF16, f"{what} backward")
