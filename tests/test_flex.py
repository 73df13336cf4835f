"""jitattn.flex_attention / create_block_mask / BlockMask, the drop-in for torch's FlexAttention (CPU).

Without a GPU nothing launches: the argument checks, the block masks, the packing and the mapping
onto one varlen_attn call are checked here, the last by standing the float64 reference in for
varlen_attn (`reference_varlen`) and comparing with torch's own flex_attention (its eager math
path) on the same inputs. tests/test_flex_gpu.py runs the kernels."""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import jitattn
from jitattn import flex
from jitattn.reference import alibi_slopes, varlen_attn_reference
from jitattn.variants.gallery import (alibi, bias_table, causal, document, prefix_lm,  # the acceptance set
                                     relative_position as relative_bias, sliding_window, soft_cap)

REPO = Path(__file__).resolve().parent.parent
F16, F64 = torch.float16, torch.float64


def qkv(batch=2, heads_q=4, heads_kv=4, len_q=12, len_k=12, dim=16, dtype=F16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, len_q, dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads_kv, len_k, dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, len_k, dim, generator=gen).to(dtype)
    return q, k, v


# ---------------------------------------------------------------- argument checks

@pytest.mark.parametrize("change,error,match", [
    (dict(query="q"), TypeError, "query must be a torch.Tensor"),
    (dict(query=torch.zeros(2, 4, 16, dtype=F16)), ValueError, r"query must have 4 dimensions \(B, Hq, L, E\)"),
    (dict(key=torch.zeros(2, 4, 12, dtype=F16)), ValueError, "key must have 4 dimensions"),
    (dict(value=torch.zeros(2, 4, 12, 16, dtype=torch.bfloat16)), TypeError, "value must have query's dtype"),
    (dict(query=torch.zeros(2, 4, 12, 16), key=torch.zeros(2, 4, 12, 16), value=torch.zeros(2, 4, 12, 16)),
     TypeError, "query must be float16 or bfloat16"),
    (dict(key=torch.zeros(2, 2, 12, 16, dtype=F16), value=torch.zeros(2, 2, 12, 16, dtype=F16)),
     ValueError, "set enable_gqa=True"),
    (dict(key=torch.zeros(2, 3, 12, 16, dtype=F16), value=torch.zeros(2, 3, 12, 16, dtype=F16), enable_gqa=True),
     ValueError, "multiple of key/value's Hkv=3"),
    (dict(key=torch.zeros(2, 4, 12, 32, dtype=F16)), ValueError, "key's head dim E must equal query's"),
    (dict(value=torch.zeros(2, 4, 12, 32, dtype=F16)), ValueError, "value's head dim Ev"),
    (dict(value=torch.zeros(2, 4, 11, 16, dtype=F16)), ValueError, r"value must match key's \(B, Hkv, S\)"),
    (dict(key=torch.zeros(3, 4, 12, 16, dtype=F16), value=torch.zeros(3, 4, 12, 16, dtype=F16)),
     ValueError, "key and value must have query's batch size 2"),
    (dict(enable_gqa=1), TypeError, "enable_gqa must be a bool"),
    (dict(score_mod="tanh"), TypeError, "score_mod must be a callable"),
    (dict(score_mod=causal), TypeError, r"score_mod must take 5 arguments \(score, b, h, q_idx, kv_idx\)"),
    (dict(block_mask=causal), TypeError, "block_mask must be a BlockMask"),
    (dict(return_lse=True, return_aux=jitattn.AuxRequest(lse=True)), ValueError, "either return_lse or return_aux"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(return_aux=torch_flex.AuxRequest(lse=True, max_scores=True)), ValueError, "max_scores"),
    (dict(return_aux=True), TypeError, "return_aux must be an AuxRequest"),
    (dict(kernel_options=[("BLOCK_M", 64)]), TypeError, "kernel_options must be a dict"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_raise_errors_naming_them(change, error, match):
    q, k, v = qkv()
    args = dict(query=q, key=k, value=v) | change
    with pytest.raises(error, match=match):
        jitattn.flex_attention(**args)


@pytest.mark.parametrize("mask,match", [
    (lambda: flex.create_block_mask(causal, 2, 4, 12, 10, device="cpu"), r"\(Q_LEN, KV_LEN\)=\(12, 10\)"),
    (lambda: flex.create_block_mask(causal, 2, 4, 11, 12, device="cpu"), r"\(Q_LEN, KV_LEN\)=\(11, 12\)"),
    (lambda: flex.create_block_mask(causal, 3, 4, 12, 12, device="cpu"), "B=3, but the call has B=2"),
    (lambda: flex.create_block_mask(causal, 2, 2, 12, 12, device="cpu"), "H=2, but the call has H=4"),
    (lambda: torch_flex.create_block_mask(causal, 2, 4, 12, 16, device="cpu"), r"\(Q_LEN, KV_LEN\)=\(12, 16\)"),
    (lambda: torch_flex.create_block_mask(causal, 2, 4, 16, 16, device="cpu")[1:], "sliced"),
], ids=["kv_len", "q_len", "batch", "heads", "torch's", "torch's sliced"])
def test_a_block_mask_made_for_other_sizes_is_refused(mask, match):
    q, k, v = qkv()
    if "sliced" in match:
        q, k, v = qkv(batch=1, len_q=16, len_k=16)
    with pytest.raises(ValueError, match=match):
        jitattn.flex_attention(q, k, v, block_mask=mask())


@pytest.mark.parametrize("args,error,match", [
    ((relative_bias, 2, 4, 8, 8), TypeError, r"mask_mod must take 4 arguments \(b, h, q_idx, kv_idx\)"),
    ((None, 2, 4, 8, 8), TypeError, "mask_mod must be a callable"),
    ((causal, 0, 4, 8, 8), ValueError, "B must be >= 1"),
    ((causal, 2, 2.0, 8, 8), TypeError, "H must be an int"),
    ((causal, 2, 4, -1, 8), ValueError, "Q_LEN must be >= 0"),
    ((causal, 2, 4, 8, 8, "cpu", 0), ValueError, "BLOCK_SIZE must be >= 1"),
    ((causal, 2, 4, 8, 8, "cpu", (64, 64, 64)), TypeError, "BLOCK_SIZE must be an int or a tuple"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_create_block_mask_checks_its_arguments(args, error, match):
    with pytest.raises(error, match=match):
        jitattn.create_block_mask(*args)


def test_mods_of_every_callable_kind_are_accepted(monkeypatch):
    calls = record_varlen(monkeypatch)

    class Masks:
        def causal(self, b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        def __call__(self, score, b, h, q_idx, kv_idx, unused=2.0):
            return score

    def scaled(score, b, h, q_idx, kv_idx, *, factor):
        return score * factor

    q, k, v = qkv()
    for score_mod in (Masks(), functools.partial(scaled, factor=0.5), relative_bias):
        mask = jitattn.create_block_mask(Masks().causal, 2, 4, 12, 12, device="cpu")
        jitattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
    assert len(calls) == 3


def test_flex_attention_traces_into_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) sees no graph break in flex_attention's own code (a traceable
    stand-in for varlen_attn here; the real one is a custom op under compile)."""
    def varlen_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, **kw):
        out = query * 2 + cu_seq_k[-1]
        return (out, query.new_zeros(query.shape[1], query.shape[0], dtype=torch.float32)) if return_aux else out

    monkeypatch.setattr(flex, "varlen_attn", varlen_standin)
    q, k, v = qkv(len_q=8, len_k=12)
    slopes = torch.rand(4)
    mask = jitattn.create_block_mask(causal, 2, None, 8, 12, device="cpu")
    compiled = torch.compile(lambda q, k, v: jitattn.flex_attention(
        q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx), block_mask=mask,
        return_aux=torch_flex.AuxRequest(lse=True)), fullgraph=True, backend="eager")
    out, aux = compiled(q, k, v)
    assert out.shape == (2, 4, 8, 16) and aux.lse.shape == (2, 4, 8)
    assert torch.equal(out, q * 2 + 24)


def test_kernel_options_and_torch_block_mask_options_are_accepted_and_ignored(monkeypatch):
    calls = record_varlen(monkeypatch)
    q, k, v = qkv()
    mask = jitattn.create_block_mask(causal, 2, 4, 12, 12, device="cpu", _compile=True, separate_full_blocks=False)
    jitattn.flex_attention(q, k, v, block_mask=mask, kernel_options={"BLOCK_M": 64, "num_warps": 4})
    assert len(calls) == 1


# ---------------------------------------------------------------- create_block_mask / BlockMask

MASKS = {
    "causal": lambda: causal,
    "sliding_window": lambda: sliding_window(37),
    "document": lambda: document(torch.randint(0, 2, (2, 700), generator=torch.Generator().manual_seed(1)).cumsum(1)),
    "prefix_lm": lambda: prefix_lm(torch.tensor([100, 3])),
    "per_head": lambda: (lambda b, h, q_idx, kv_idx: (q_idx + 50 * h >= kv_idx)),
}


@pytest.mark.parametrize("sizes", [(2, 4, 300, 300), (2, 1, 129, 700), (None, 3, 256, 128), (2, None, 5, 1)],
                         ids=str)
@pytest.mark.parametrize("block_size", [128, (64, 32)], ids=str)
@pytest.mark.parametrize("name", sorted(MASKS))
def test_to_dense_is_torchs_dense_block_layout(name, block_size, sizes):
    mask_mod = MASKS[name]()
    ours = jitattn.create_block_mask(mask_mod, *sizes, device="cpu", BLOCK_SIZE=block_size).to_dense()
    theirs = torch_flex.create_block_mask(mask_mod, *sizes, device="cpu", BLOCK_SIZE=block_size).to_dense()
    assert ours.dtype == theirs.dtype == torch.int32
    assert torch.equal(ours, theirs)


def test_to_dense_works_a_block_of_rows_at_a_time(monkeypatch):
    monkeypatch.setattr(flex, "DENSE_CHUNK_ELEMENTS", 300)  # a public knob: one 8-row block per chunk
    mask_mod = document(torch.randint(0, 2, (1, 100), generator=torch.Generator().manual_seed(2)).cumsum(1))
    ours = jitattn.create_block_mask(mask_mod, 1, 2, 90, 100, device="cpu", BLOCK_SIZE=8).to_dense()
    theirs = torch_flex.create_block_mask(mask_mod, 1, 2, 90, 100, device="cpu", BLOCK_SIZE=8).to_dense()
    assert torch.equal(ours, theirs)


def test_a_block_mask_is_a_frozen_record_of_the_mask_and_its_shape():
    mask = jitattn.create_block_mask(causal, None, 4, 256, 300, device="cpu", BLOCK_SIZE=(64, 128))
    assert isinstance(mask, jitattn.BlockMask)
    assert mask.mask_mod is causal and mask.shape == (1, 4, 256, 300) and mask.seq_lengths == (256, 300)
    assert mask.BLOCK_SIZE == (64, 128) and mask.device == torch.device("cpu")
    assert str(mask) == repr(mask) == "BlockMask(shape=(1, 4, 256, 300), BLOCK_SIZE=(64, 128), mask_mod=causal)"
    with pytest.raises(AttributeError):
        mask.shape = (1, 1, 1, 1)


def test_numel_sparsity_and_to_are_torchs():
    mask_mod = sliding_window(100)
    ours = jitattn.create_block_mask(mask_mod, 2, 3, 1000, 700, device="cpu")
    theirs = torch_flex.create_block_mask(mask_mod, 2, 3, 1000, 700, device="cpu")
    assert ours.numel() == theirs.numel() == 2 * 3 * 1000 * 700
    assert ours.sparsity() == pytest.approx(theirs.sparsity(), abs=1e-9) and 0 < ours.sparsity() < 100
    moved = ours.to("meta")
    assert moved.device == torch.device("meta") and moved.mask_mod is mask_mod and ours.device.type == "cpu"


def test_empty_lengths_have_an_empty_dense_layout():
    assert jitattn.create_block_mask(causal, 2, 1, 0, 300, device="cpu").to_dense().shape == (2, 1, 0, 3)
    assert jitattn.create_block_mask(causal, 2, 1, 300, 0, device="cpu").to_dense().shape == (2, 1, 3, 0)


def test_create_block_mask_evaluates_nothing():
    def counted(b, h, q_idx, kv_idx):
        calls.append(1)
        return q_idx >= kv_idx

    calls = []
    mask = jitattn.create_block_mask(counted, 8, 32, 4096, 4096, device="cpu")
    assert calls == []
    assert mask.shape == (8, 32, 4096, 4096)


# ---------------------------------------------------------------- packing and the varlen call

def test_packing_is_a_view_when_the_strides_allow_and_a_copy_otherwise():
    tokens_major = torch.randn(2, 12, 4, 16).transpose(1, 2)  # (B, H, L, E) view of (B, L, H, E)
    packed = flex.packed(tokens_major)
    assert packed.shape == (24, 4, 16) and packed.data_ptr() == tokens_major.data_ptr()
    assert torch.equal(packed.view(2, 12, 4, 16).transpose(1, 2), tokens_major)
    one_head = torch.randn(2, 1, 12, 16)
    assert flex.packed(one_head).data_ptr() == one_head.data_ptr()
    heads_major = torch.randn(2, 4, 12, 16)  # torch's usual (B, H, L, E) contiguous
    packed = flex.packed(heads_major)
    assert packed.data_ptr() != heads_major.data_ptr() and packed.is_contiguous()
    assert torch.equal(packed[12 + 5, 3], heads_major[1, 3, 5])


def record_varlen(monkeypatch, reference=False):
    """Stand in for varlen_attn: record each call's arguments; return the float64 reference's
    result (reference=True) or zeros."""
    calls = []

    def fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    enable_gqa=False, **mods):
        calls.append(dict(query=query, key=key, value=value, cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q,
                          max_k=max_k, return_aux=return_aux, scale=scale, enable_gqa=enable_gqa, **mods))
        if reference:
            out, lse = varlen_attn_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                             enable_gqa=enable_gqa, **mods)
        else:
            out = torch.zeros_like(query)
            lse = torch.zeros(query.shape[1], query.shape[0])
        return (out, lse) if return_aux is not None and return_aux.lse else out

    monkeypatch.setattr(flex, "varlen_attn", fake_varlen)
    return calls


def test_one_varlen_call_with_b_sequences_of_l_queries_and_s_keys(monkeypatch):
    calls = record_varlen(monkeypatch)
    q, k, v = qkv(batch=3, heads_q=4, heads_kv=2, len_q=5, len_k=7)
    out = jitattn.flex_attention(q, k, v, scale=0.25, enable_gqa=True)
    (call,) = calls
    assert call["cu_seq_q"].tolist() == [0, 5, 10, 15] and call["cu_seq_k"].tolist() == [0, 7, 14, 21]
    assert call["cu_seq_q"].dtype == call["cu_seq_k"].dtype == torch.int32
    assert (call["max_q"], call["max_k"], call["scale"], call["enable_gqa"]) == (5, 7, 0.25, True)
    assert call["query"].shape == (15, 4, 16) and call["key"].shape == (21, 2, 16)
    assert torch.equal(call["key"][7 + 3, 1], k[1, 1, 3])
    assert call["return_aux"] is None and "score_mod" not in call and "mask_mod" not in call
    assert out.shape == (3, 4, 5, 16)
    jitattn.flex_attention(q, k, v, enable_gqa=True)
    assert calls[1]["cu_seq_q"] is call["cu_seq_q"], "cu_seq tensors are made once per (B, L, S, device)"


def test_keys_of_batch_one_are_shared_by_the_batch(monkeypatch):
    calls = record_varlen(monkeypatch)
    q, k, v = qkv(batch=3)
    jitattn.flex_attention(q, k[:1], v[:1])
    key = calls[0]["key"]
    assert key.shape == (36, 4, 16) and torch.equal(key[24:36], key[:12])


@pytest.mark.parametrize("len_q,len_k", [(12, 12), (5, 12), (12, 5)])
def test_the_mods_see_torchs_top_left_q_idx(monkeypatch, len_q, len_k):
    calls = record_varlen(monkeypatch)
    seen = []

    def mask(b, h, q_idx, kv_idx):
        seen.append(q_idx)
        return q_idx >= kv_idx

    q, k, v = qkv(len_q=len_q, len_k=len_k)
    jitattn.flex_attention(q, k, v, score_mod=relative_bias,
                           block_mask=jitattn.create_block_mask(mask, 2, 4, len_q, len_k, device="cpu"))
    call = calls[0]
    rows = torch.arange(len_q).view(1, -1, 1)
    bottom_right = rows + (len_k - len_q)  # what varlen_attn passes
    kv = torch.arange(len_k).view(1, 1, -1)
    visible = call["mask_mod"](torch.tensor(0), torch.arange(4).view(-1, 1, 1), bottom_right, kv)
    assert torch.equal(visible.expand(4, -1, -1), (rows >= kv).expand(4, -1, -1))
    assert torch.equal(seen[-1], rows)
    score = torch.zeros(4, len_q, len_k)
    assert torch.equal(call["score_mod"](score, torch.tensor(1), torch.arange(4).view(-1, 1, 1), bottom_right, kv),
                       (rows - kv).expand(4, -1, -1).float())
    if len_q == len_k:
        assert call["mask_mod"] is mask and call["score_mod"] is relative_bias


def torch_reference(q, k, v, **kw):
    """torch's flex_attention on the float64 copies of the inputs, through its eager math path."""
    torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return torch_flex.flex_attention(q.double(), k.double(), v.double(), **kw)
    finally:
        torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = False


def close(got, want, tol=1e-10):
    assert got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert (got[finite] - want[finite]).abs().max().item() < tol


VARIANTS = {
    "relative_bias": lambda g: dict(score_mod=relative_bias),
    "alibi": lambda g: dict(score_mod=alibi(alibi_slopes(4))),
    "bias_table": lambda g: dict(score_mod=bias_table(torch.randn(4, 64, generator=g, dtype=F64), 30)),
    "soft_cap": lambda g: dict(score_mod=soft_cap(2.0)),
    "causal": lambda g: dict(mask=causal),
    "sliding_window": lambda g: dict(mask=sliding_window(4)),
    "document": lambda g: dict(mask=document(torch.randint(0, 2, (2, 40), generator=g).cumsum(1))),
    "prefix_lm": lambda g: dict(mask=prefix_lm(torch.tensor([6, 0]))),
    "alibi_document": lambda g: dict(score_mod=alibi(alibi_slopes(4)),
                                     mask=document(torch.randint(0, 2, (2, 40), generator=g).cumsum(1))),
}


@pytest.mark.parametrize("len_q,len_k", [(24, 24), (9, 24), (24, 10)], ids=str)
@pytest.mark.parametrize("heads_kv", [4, 2])
@pytest.mark.parametrize("which", ["jitattn", "torch"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_flex_attention_is_torchs_on_the_same_inputs(monkeypatch, name, which, heads_kv, len_q, len_k):
    """The mapping (packing, cu_seq, q_idx shift, GQA, lse layout) with the float64 reference standing in
    for the kernels, against torch's flex_attention; with jitattn's BlockMask and with torch's."""
    record_varlen(monkeypatch, reference=True)
    g = torch.Generator().manual_seed(len_q * 31 + heads_kv)
    variant = VARIANTS[name](g)
    mask_mod = variant.pop("mask", None)
    kw = dict(variant, scale=0.3, enable_gqa=heads_kv != 4)
    q, k, v = qkv(heads_kv=heads_kv, len_q=len_q, len_k=len_k, seed=len_k)
    theirs_mask = None if mask_mod is None else torch_flex.create_block_mask(mask_mod, 2, None, len_q, len_k,
                                                                             device="cpu", BLOCK_SIZE=8)
    ours_mask = theirs_mask if which == "torch" or mask_mod is None else \
        jitattn.create_block_mask(mask_mod, 2, None, len_q, len_k, device="cpu")
    out, aux = jitattn.flex_attention(q, k, v, block_mask=ours_mask, return_aux=torch_flex.AuxRequest(lse=True), **kw)
    want, want_aux = torch_reference(q, k, v, block_mask=theirs_mask, return_aux=torch_flex.AuxRequest(lse=True), **kw)
    assert isinstance(aux, torch_flex.AuxOutput) and aux.max_scores is None
    close(out, want)
    close(aux.lse, want_aux.lse)
    if name == "causal" and len_q > len_k:  # bottom-right would hide the first L - S rows; top-left none
        assert torch.isfinite(aux.lse).all()
    if name == "sliding_window" and len_q > len_k:  # rows past S + 4 see no key
        assert torch.isneginf(aux.lse[:, :, len_k + 4:]).all() and torch.isfinite(aux.lse[:, :, :len_k + 4]).all()


def test_return_lse_and_jitattns_aux_request(monkeypatch):
    record_varlen(monkeypatch, reference=True)
    q, k, v = qkv()
    out, lse = jitattn.flex_attention(q, k, v, return_lse=True)
    want, want_lse = torch_reference(q, k, v, return_lse=True)
    close(out, want)
    close(lse, want_lse)
    assert lse.shape == (2, 4, 12)
    out2, aux = jitattn.flex_attention(q, k, v, return_aux=jitattn.AuxRequest(lse=True))
    assert torch.equal(out2, out) and torch.equal(aux.lse, lse) and aux.max_scores is None
    out3, aux = jitattn.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest())
    assert torch.equal(out3, out) and aux.lse is None


def test_a_block_sparse_torch_mask_without_mask_mod_masks_its_blocks(monkeypatch):
    """torch's BlockMask.from_kv_blocks with the default noop mask_mod: the blocks are the mask (in
    torch's compiled kernels; its eager math path reads only mask_mod, so the expected result here
    is torch's with that block layout spelled as a mask_mod)."""
    record_varlen(monkeypatch, reference=True)
    q, k, v = qkv(len_q=32, len_k=48)
    num_blocks = torch.tensor([[[1, 2, 0, 3]]], dtype=torch.int32)  # (1, 1, 4 query blocks of 8)
    indices = torch.tensor([[[[2, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0] * 6, [5, 3, 1, 0, 0, 0]]]],
                           dtype=torch.int32)  # (1, 1, 4, 6 key blocks of 8)
    mask = torch_flex.BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=(8, 8), seq_lengths=(32, 48))
    blocks = mask.to_dense().bool()
    spelled = torch_flex.BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=(8, 8), seq_lengths=(32, 48),
                                                  mask_mod=lambda b, h, q_idx, kv_idx: blocks[0, 0, q_idx // 8,
                                                                                              kv_idx // 8])
    out, lse = jitattn.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    want, want_lse = torch_reference(q, k, v, block_mask=spelled, return_lse=True)
    close(out, want)
    close(lse, want_lse)
    assert torch.isneginf(lse[:, :, 16:24]).all() and torch.isfinite(lse[:, :, :16]).all()


def test_gradients_reach_the_dense_inputs(monkeypatch):
    record_varlen(monkeypatch, reference=True)
    q, k, v = (t.requires_grad_() for t in qkv(heads_kv=2))
    out = jitattn.flex_attention(q, k, v, enable_gqa=True,
                                 block_mask=jitattn.create_block_mask(causal, None, None, 12, 12, device="cpu"))
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_importing_jitattn_imports_neither_flex_module():
    code = ("import json, sys, jitattn; print(json.dumps(['torch.nn.attention.flex_attention' in sys.modules, "
            "'jitattn.flex' in sys.modules, callable(jitattn.create_block_mask), "
            "'torch.nn.attention.flex_attention' in sys.modules]))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False, True, False]
