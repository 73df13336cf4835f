"""Attention variants on a GPU (issue 46's acceptance set, skipped without a GPU):
jitattn.flex_attention against the float64 reference (forward and gradients) and against torch's
own flex_attention on the same inputs, and jitattn.varlen_attn with score_mod / mask_mod directly
on packed uneven batches (an empty sequence, GQA, a window on top of a mask).

The oracle is jitattn.reference.varlen_attn_reference in float64 (autograd for the gradients),
given the user's functions with q_idx moved to its bottom-right convention by this file
(`as_varlen`), independently of jitattn/flex.py's own shift. Outputs come from NaN-poisoned
allocator blocks; gradients are compared relatively and absolutely as in
tests/test_varlen_backward_gpu.py. Each (variant, dtype, head dim) is a kernel specialization:
the first run compiles it.

JITATTN_TEST_DEVICE=cpu dry-runs the test logic on the CPU with the float64 reference standing in
for the kernels (so only the comparison with torch's flex_attention is a real one there).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import jitattn
from jitattn import flex
from jitattn.reference import alibi_slopes, varlen_attn_reference
from tests.gpu_utils import poison_allocator, rel_error
from tests.varlen_utils import DEVICE, LSE_TOL, TOL, close, cu

pytestmark = pytest.mark.gpu

F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64
DTYPES = [F16, BF16]
HEAD_DIMS = [64, 128]
# Each (variant, dtype, head dim) compiles a forward and a backward kernel: by default every variant
# runs bf16 at D128 and fp16 at D64 (both dtypes, both head dims); JITATTN_TEST_FLEX_ALL=1 runs the
# whole product.
DTYPE_DIMS = ([(dtype, dim) for dtype in DTYPES for dim in HEAD_DIMS] if os.environ.get("JITATTN_TEST_FLEX_ALL") == "1"
              else [(BF16, 128), (F16, 64)])
BATCH, HEADS = 2, 4
# (L, S): square, and queries fewer than keys with neither a multiple of a tile
LENGTHS = [(256, 256), (200, 333)]
# gradients, as tests/test_varlen_backward_gpu.py: ||g - ref|| / ||ref|| and max |g - ref| / largest |ref|
GRAD_REL_TOL = {F16: 1e-2, BF16: 3e-2}
GRAD_ABS_TOL = {F16: 1e-2, BF16: 4e-2}
CPU = DEVICE == "cpu"


@pytest.fixture(autouse=True)
def _standin_on_cpu(monkeypatch):
    """Dry run (JITATTN_TEST_DEVICE=cpu): the float64 reference stands in for varlen_attn."""
    if not CPU:
        return

    def varlen_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, **mods):
        out, lse = varlen_attn_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                         window_size=window_size, **mods)
        out, lse = out.to(query.dtype), lse.float()
        return (out, lse) if return_aux is not None and return_aux.lse else out

    monkeypatch.setattr(flex, "varlen_attn", varlen_standin)
    monkeypatch.setattr(jitattn, "varlen_attn", varlen_standin)


# ---------------------------------------------------------------- the acceptance set

def relative_bias():
    return lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx)


def alibi():
    slopes = alibi_slopes(HEADS).float().to(DEVICE)
    return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)


def bias_table(len_q, len_k, gen):
    """A learned bias by head and relative position: index q_idx - kv_idx + (S - 1) in [0, L + S - 2]."""
    table = torch.randn(HEADS, len_q + len_k - 1, generator=gen, device=DEVICE)
    center = len_k - 1
    return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + center]


def soft_cap(cap=2.0):
    return lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)


def causal():
    return lambda b, h, q_idx, kv_idx: q_idx >= kv_idx


def sliding_window(width=64):
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= width)


def document(len_q, len_k, gen):
    """doc_id (B, max(L, S)): documents of random lengths, a different split per batch entry."""
    starts = torch.rand(BATCH, max(len_q, len_k), generator=gen, device=DEVICE) < 0.02
    doc_id = starts.int().cumsum(1)
    return lambda b, h, q_idx, kv_idx: doc_id[b, q_idx] == doc_id[b, kv_idx]


def prefix_lm():
    prefix = torch.tensor([37, 150], device=DEVICE)
    return lambda b, h, q_idx, kv_idx: (kv_idx < prefix[b]) | (q_idx >= kv_idx)


VARIANTS = {  # name -> (kind, factory(len_q, len_k, gen))
    "relative_bias": ("score_mod", lambda lq, lk, g: relative_bias()),
    "alibi": ("score_mod", lambda lq, lk, g: alibi()),
    "bias_table": ("score_mod", bias_table),
    "soft_cap": ("score_mod", lambda lq, lk, g: soft_cap()),
    "causal": ("mask_mod", lambda lq, lk, g: causal()),
    "sliding_window": ("mask_mod", lambda lq, lk, g: sliding_window()),
    "document": ("mask_mod", document),
    "prefix_lm": ("mask_mod", lambda lq, lk, g: prefix_lm()),
}


def dense_inputs(dtype, head_dim, heads_kv, len_q, len_k, seed, requires_grad=False):
    """(B, H, L, E) query and (B, Hkv, S, E) key / value, the query a (B, L, H, E) tensor's transpose
    half the time (flex_attention then packs it as a view)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(heads, tokens, tokens_major):
        shape = (BATCH, tokens, heads, head_dim) if tokens_major else (BATCH, heads, tokens, head_dim)
        t = torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)
        return t.transpose(1, 2) if tokens_major else t

    q = randn(HEADS, len_q, seed % 2 == 0)
    k, v = randn(heads_kv, len_k, False), randn(heads_kv, len_k, False)
    return [t.requires_grad_() if requires_grad else t for t in (q, k, v)]


def as_varlen(fn, kind, len_q, len_k):
    """The user's function with torch's top-left q_idx, for varlen's bottom-right q_idx (row + S - L)."""
    shift = len_k - len_q
    if kind == "score_mod":
        return lambda score, b, h, q_idx, kv_idx: fn(score, b, h, q_idx - shift, kv_idx)
    return lambda b, h, q_idx, kv_idx: fn(b, h, q_idx - shift, kv_idx)


def dense_reference(q, k, v, kind, fn, scale=None):
    """Float64 (out (B, H, L, E), lse (B, H, L)) of flex_attention's contract, differentiable."""
    batch, heads, len_q, dim = q.shape
    len_k = k.shape[2]

    def pack(x):
        return x.double().transpose(1, 2).reshape(-1, x.shape[1], dim)

    mods = {} if fn is None else {kind: as_varlen(fn, kind, len_q, len_k)}
    out, lse = varlen_attn_reference(pack(q), pack(k), pack(v), cu([len_q] * batch), cu([len_k] * batch), len_q,
                                     len_k, scale=scale, enable_gqa=True, **mods)
    return out.view(batch, len_q, heads, dim).transpose(1, 2), lse.view(heads, batch, len_q).transpose(0, 1)


def flex_call(q, k, v, kind, fn, mask_api="jitattn"):
    """jitattn.flex_attention -> (out, lse); mask_api: whose create_block_mask makes the block mask."""
    len_q, len_k = q.shape[2], k.shape[2]
    kw = dict(enable_gqa=q.shape[1] != k.shape[1], return_aux=torch_flex.AuxRequest(lse=True))
    if kind == "score_mod":
        kw["score_mod"] = fn
    elif kind == "mask_mod":
        make = jitattn.create_block_mask if mask_api == "jitattn" else torch_flex.create_block_mask
        kw["block_mask"] = make(fn, BATCH, None, len_q, len_k, device=DEVICE)
    out, aux = jitattn.flex_attention(q, k, v, **kw)
    return out, aux.lse, kw


def torch_flex_call(q, k, v, kw, monkeypatch):
    """torch's flex_attention on the same inputs through its eager math path (float32 working
    precision, no compile: the test compares results, not speed)."""
    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True, raising=False)
    block_mask = kw.get("block_mask")
    if isinstance(block_mask, jitattn.BlockMask):
        kw = dict(kw, block_mask=torch_flex.create_block_mask(block_mask.mask_mod, *block_mask.shape,
                                                              device=DEVICE))
    out, aux = torch_flex.flex_attention(q, k, v, **kw)
    return out, aux.lse


def poison(q):
    if not CPU:
        poison_allocator(q.numel() * q.element_size())
        poison_allocator(q.numel() // q.shape[-1] * 4)


def check_dense(out, lse, ref_out, ref_lse, dtype, what, factor=1.0):
    """out (B, H, L, E) and lse (B, H, L) against a reference: tolerances by dtype (times factor), -inf
    exactly where the reference has it, and zero output rows there."""
    assert out.shape == ref_out.shape and out.dtype == dtype, f"{what}: out {tuple(out.shape)} {out.dtype}"
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32, f"{what}: lse {tuple(lse.shape)} {lse.dtype}"
    rel, abs_ = TOL[dtype]
    close(out, ref_out, rel * factor, abs_ * factor, what)
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse -inf rows differ from the reference's"
    assert (out[empty] == 0).all(), f"{what}: rows with no visible key are not zero"
    finite = ~empty
    if finite.any():
        rel, abs_ = LSE_TOL
        close(lse[finite], ref_lse[finite], rel * factor,
              abs_ * factor * max(1.0, ref_lse[finite].abs().max().item() / 100), what + " lse")


def check_grads(got, want, dtype, what):
    """dq, dk, dv finite, within GRAD_ABS_TOL of the largest reference gradient and, where not
    (near) zero, within GRAD_REL_TOL relatively."""
    scale = max(w.abs().max().item() for w in want)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g is not None and g.shape == w.shape, f"{what}: {name} is {None if g is None else tuple(g.shape)}"
        assert torch.isfinite(g).all(), f"{what}: NaN or inf in {name}"
        max_abs = (g.double() - w).abs().max().item()
        assert max_abs <= GRAD_ABS_TOL[dtype] * scale, \
            f"{what}: {name} max abs error {max_abs:.3e} > {GRAD_ABS_TOL[dtype]:.0e} x largest gradient {scale:.3e}"
        if w.norm().item() > 1e-6 * scale * math.sqrt(w.numel()):
            err = rel_error(g, w)
            assert err < GRAD_REL_TOL[dtype], f"{what}: {name} relative error {err:.2e} >= {GRAD_REL_TOL[dtype]:.0e}"


# ---------------------------------------------------------------- flex_attention

@pytest.mark.parametrize("dtype,head_dim", DTYPE_DIMS, ids=str)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_flex_attention_matches_float64_and_torchs_flex_attention(name, dtype, head_dim, monkeypatch):
    kind, factory = VARIANTS[name]
    for heads_kv in (HEADS, 2):
        for len_q, len_k in LENGTHS:
            what = f"{name} {str(dtype)[6:]} d{head_dim} H{HEADS}/{heads_kv} L{len_q} S{len_k}"
            gen = torch.Generator(device=DEVICE).manual_seed(len_q + heads_kv)
            fn = factory(len_q, len_k, gen)
            q, k, v = dense_inputs(dtype, head_dim, heads_kv, len_q, len_k, seed=head_dim + heads_kv + len_q)
            poison(q)
            out, lse, kw = flex_call(q, k, v, kind, fn)
            ref_out, ref_lse = dense_reference(q, k, v, kind, fn)
            check_dense(out, lse, ref_out, ref_lse, dtype, what + " vs float64")
            if name == "soft_cap":  # the cap must bite, or this compares plain attention
                plain, _ = dense_reference(q, k, v, None, None)
                assert rel_error(ref_out, plain) > 10 * TOL[dtype][0], f"{what}: the soft cap changes nothing"
            theirs, their_lse = torch_flex_call(q, k, v, kw, monkeypatch)
            check_dense(out, lse, theirs, their_lse, dtype, what + " vs torch's flex_attention", factor=2.0)


@pytest.mark.parametrize("name", ["causal", "document"])
def test_torchs_own_block_mask_gives_the_same_result(name):
    kind, factory = VARIANTS[name]
    len_q, len_k = LENGTHS[1]
    fn = factory(len_q, len_k, torch.Generator(device=DEVICE).manual_seed(3))
    q, k, v = dense_inputs(BF16, 128, 2, len_q, len_k, seed=5)
    ours = flex_call(q, k, v, kind, fn)
    theirs = flex_call(q, k, v, kind, fn, mask_api="torch")
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("dtype,head_dim", DTYPE_DIMS, ids=str)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_flex_attention_gradients_match_float64(name, dtype, head_dim):
    kind, factory = VARIANTS[name]
    for heads_kv in (HEADS, 2):
        len_q, len_k = LENGTHS[heads_kv == 2]
        what = f"{name} {str(dtype)[6:]} d{head_dim} H{HEADS}/{heads_kv} L{len_q} S{len_k}"
        fn = factory(len_q, len_k, torch.Generator(device=DEVICE).manual_seed(7))
        q, k, v = dense_inputs(dtype, head_dim, heads_kv, len_q, len_k, seed=11 + head_dim, requires_grad=True)
        gen = torch.Generator(device=DEVICE).manual_seed(13)
        grad_out = torch.randn(q.shape, generator=gen, device=DEVICE)
        grad_lse = torch.randn(q.shape[:3], generator=gen, device=DEVICE)
        out, lse, _ = flex_call(q, k, v, kind, fn)
        loss = (out.float() * grad_out).sum() + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
        poison(q)
        got = torch.autograd.grad(loss, (q, k, v))
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = dense_reference(*leaves, kind, fn)
        ref_loss = (ref_out * grad_out.double()).sum() + \
            torch.where(torch.isfinite(ref_lse), ref_lse, 0.0).mul(grad_lse.double()).sum()
        want = torch.autograd.grad(ref_loss, leaves)
        check_grads(got, want, dtype, what)


# ---------------------------------------------------------------- varlen_attn with variants

def packed_batch(dtype, head_dim, heads_q, heads_kv, seed):
    """Uneven sequences: an empty one, one with queries and no keys, a decode row, Lq != Lk both
    ways; key/value rows past the last sequence hold NaN (never read)."""
    len_q = [0, 3, 1, 130, 77, 256, 40]
    len_k = [0, 0, 190, 130, 200, 256, 17]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(tokens, heads):
        return torch.randn(tokens, heads, head_dim, generator=gen, device=DEVICE).to(dtype)

    q = randn(sum(len_q), heads_q)
    k, v = randn(sum(len_k) + 5, heads_kv), randn(sum(len_k) + 5, heads_kv)
    k[sum(len_k):], v[sum(len_k):] = math.nan, math.nan
    return q, k, v, cu(len_q), cu(len_k), max(len_q), max(len_k), len_q, len_k


PACKED_CASES = {  # name -> (mods(len_q, len_k, gen), window)
    "causal_with_window": (lambda g: dict(mask_mod=causal()), (48, 0)),
    "document_causal_window": (lambda g: dict(mask_mod=packed_document(g)), (-1, 0)),
    "prefix_lm_sliding_window": (lambda g: dict(mask_mod=prefix_lm_by_sequence()), (100, 0)),
    "alibi_document": (lambda g: dict(score_mod=alibi8(), mask_mod=packed_document(g)), (-1, -1)),
    "bias_table_sliding_mask": (lambda g: dict(score_mod=packed_bias_table(g), mask_mod=sliding_window(30)),
                                (-1, -1)),
    "soft_cap_causal": (lambda g: dict(score_mod=soft_cap(), mask_mod=causal()), (-1, -1)),
}


def packed_document(gen):
    """Documents by sequence and position; rows before the keys' start (q_idx < 0, Lq > Lk) see none."""
    doc_id = (torch.rand(7, 256, generator=gen, device=DEVICE) < 0.03).int().cumsum(1)
    return lambda b, h, q_idx, kv_idx: (q_idx >= 0) & (doc_id[b, q_idx] == doc_id[b, kv_idx])


def prefix_lm_by_sequence():
    prefix = torch.tensor([0, 0, 50, 20, 0, 128, 5], device=DEVICE)
    return lambda b, h, q_idx, kv_idx: (kv_idx < prefix[b]) | (q_idx >= kv_idx)


def alibi8():
    slopes = alibi_slopes(8).float().to(DEVICE)
    return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)


def packed_bias_table(gen):
    table = torch.randn(8, 2 * 256 - 1, generator=gen, device=DEVICE)
    return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + 255]


@pytest.mark.parametrize("dtype,head_dim", DTYPE_DIMS, ids=str)
@pytest.mark.parametrize("name", sorted(PACKED_CASES))
def test_varlen_attn_with_variants_on_uneven_sequences(name, dtype, head_dim):
    """q_idx here is varlen's own (bottom-right): the functions go to varlen_attn unchanged."""
    make_mods, window = PACKED_CASES[name]
    q, k, v, cu_q, cu_k, max_q, max_k, len_q, len_k = packed_batch(dtype, head_dim, 8, 2, seed=17)
    mods = make_mods(torch.Generator(device=DEVICE).manual_seed(19))
    poison(q)
    out, lse = jitattn.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window, enable_gqa=True,
                                   return_aux=jitattn.AuxRequest(lse=True), **mods)
    ref_out, ref_lse = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window, **mods)
    what = f"varlen {name} {str(dtype)[6:]}"
    empty = torch.isneginf(ref_lse)
    assert empty[:, :3].all(), f"{what}: the sequence without keys was meant to give -inf rows"
    check_dense(out.transpose(0, 1), lse, ref_out.transpose(0, 1), ref_lse, dtype, what)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    gen = torch.Generator(device=DEVICE).manual_seed(23)
    grad_out = torch.randn(q.shape, generator=gen, device=DEVICE)
    out = jitattn.varlen_attn(*leaves, cu_q, cu_k, max_q, max_k, window_size=window, enable_gqa=True, **mods)
    poison(q)
    got = torch.autograd.grad((out.float() * grad_out).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = varlen_attn_reference(*ref_leaves, cu_q, cu_k, max_q, max_k, window_size=window, **mods)
    want = torch.autograd.grad((ref_out * grad_out.double()).sum(), ref_leaves)
    check_grads(got, want, dtype, what)


# ---------------------------------------------------------------- graphs

@pytest.mark.skipif(CPU, reason="CUDA graphs")
def test_flex_attention_with_a_variant_captures_into_a_cuda_graph():
    """Nothing in flex_attention reads back to the host or allocates its cu_seq per call."""
    len_q, len_k = LENGTHS[1]
    q, k, v = dense_inputs(BF16, 128, 2, len_q, len_k, seed=29)
    mask = jitattn.create_block_mask(sliding_window(), BATCH, None, len_q, len_k, device=DEVICE)
    bias = alibi()
    eager = jitattn.flex_attention(q, k, v, score_mod=bias, block_mask=mask, enable_gqa=True)  # warm: builds, caches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = jitattn.flex_attention(q, k, v, score_mod=bias, block_mask=mask, enable_gqa=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    want = jitattn.flex_attention(q, k, v, score_mod=bias, block_mask=mask, enable_gqa=True)
    assert not torch.equal(want, eager)
    assert torch.equal(captured, want)


# ---------------------------------------------------------------- the oracle itself on the GPU

def test_the_reference_runs_a_function_that_needs_vmap_on_the_gpu():
    """bias[h][i] indexes bias's first dim with relative positions when called on broadcast index
    tensors: out of range there, which on a GPU would be a device-side assert (ending the process),
    not the IndexError the reference falls back to vmap on."""
    q, k, v, cu_q, cu_k, max_q, max_k, _, _ = packed_batch(F64, 32, 4, 2, seed=31)
    table = torch.randn(4, 2 * 256 - 1, device=DEVICE, dtype=F64)
    chained = lambda score, b, h, q_idx, kv_idx: score + table[h][q_idx - kv_idx + 255]  # noqa: E731
    direct = lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + 255]  # noqa: E731
    got = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True, score_mod=chained)
    want = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True, score_mod=direct)
    finite = torch.isfinite(want[1])
    assert torch.equal(finite, torch.isfinite(got[1]))
    assert torch.allclose(got[0], want[0], rtol=0, atol=1e-12) and torch.allclose(got[1][finite], want[1][finite])


@pytest.mark.skipif(CPU, reason="the kernels under torch.compile")
def test_flex_attention_with_variant_functions_compiles():
    """torch.compile: flex_attention's own code and varlen_attn's op with a score_mod and a
    mask_mod, forward and backward, give the eager results. (The functions are traced outside the
    graph, a graph break: fullgraph=True takes pre-traced variants, test_variants_gpu.py.)"""
    len_q, len_k = LENGTHS[1]
    q, k, v = dense_inputs(BF16, 128, 2, len_q, len_k, seed=37, requires_grad=True)
    mask = jitattn.create_block_mask(prefix_lm(), BATCH, None, len_q, len_k, device=DEVICE)
    bias = alibi()

    def attend(q, k, v):
        return jitattn.flex_attention(q, k, v, score_mod=bias, block_mask=mask, enable_gqa=True)

    eager = attend(q, k, v)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), (q, k, v))
    compiled = torch.compile(attend)(q, k, v)
    compiled_grads = torch.autograd.grad(compiled.float().square().sum(), (q, k, v))
    assert torch.equal(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        close(got, want.double(), *TOL[BF16], "compiled gradient")
