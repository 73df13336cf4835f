"""jitattn as a transformers attention implementation, on the CPU (runs in CI, which installs
transformers with the test extra): registration, how each call's arguments map onto varlen_attn,
the refusals, and whole small models (Llama, Mistral with a sliding window, Gemma-2 with and
without its logit soft cap) against transformers' own sdpa in float32: logits with padding, greedy generation with
the KV cache, a training step packed (DataCollatorWithFlattening) against unpacked.

varlen_attn needs a GPU, so here the integration's one call into jitattn goes to a stand-in (put in
with `jitattn.integrations.transformers.use_backend`) that runs varlen_attn's own argument checks (on a
bfloat16 copy: the kernels' dtypes) and then the float64 reference. The same models against the
real kernels: tests/test_transformers_gpu.py.
"""
import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import jitattn.integrations.transformers as jt  # noqa: E402
from jitattn import checks as _checks  # noqa: E402
from jitattn.reference import varlen_attn_reference  # noqa: E402
from jitattn.varlen.checks import check_varlen_args  # noqa: E402
from tests.varlen_utils import window_visibility  # noqa: E402

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def reference_standin(recorded: list):
    """A varlen_attn that appends each call's arguments to `recorded` and answers with the float64
    reference (`masked_reference` when the call has a mask_mod)."""

    def standin(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                seqused_k=None, softcap=None, mask_mod=None):
        recorded.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=scale,
                             window=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k, softcap=softcap,
                             mask_mod=mask_mod))
        half = [t.detach().to(BF16) for t in (q, k, v)]
        check_varlen_args(*half, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                          enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=None, num_splits=None,
                          softcap=softcap)
        if mask_mod is not None:
            return masked_reference(q, k, v, cu_q, cu_k, seqused_k, scale, window_size, softcap,
                                    visibility(mask_mod)).to(q.dtype)
        out, _ = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                       seqused_k=seqused_k, softcap=softcap)
        return out.to(q.dtype)

    return standin


def visibility(mask_mod):
    """mask_mod(b, h, q_idx, kv_idx) on broadcast index tensors: a function as it is, a traced
    Variant through jitattn.variants' float64 reference."""
    if callable(mask_mod):
        return mask_mod
    from jitattn.variants import reference_mask

    return lambda b, h, q_idx, kv_idx: reference_mask(mask_mod, b, h, q_idx, kv_idx)


def masked_reference(q, k, v, cu_q, cu_k, seqused_k, scale, window_size, softcap, visible):
    """Float64 attention over packed sequences (varlen_attn's contract: bottom-right windows, GQA,
    seqused_k, soft cap) where key kv_idx of sequence b is seen by query head h at q_idx only if
    visible(b, h, q_idx, kv_idx); a row that sees no key is zero. Differentiable."""
    heads_q, group = q.shape[1], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    left, right = window_size
    cq, ck = cu_q.tolist(), cu_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    pieces = []
    for b in range(len(cq) - 1):
        len_q, len_k = cq[b + 1] - cq[b], (ck[b + 1] - ck[b]) if used is None else used[b]
        qs = q[cq[b]:cq[b + 1]].double()
        if len_q == 0 or len_k == 0:
            pieces.append(qs.new_zeros(len_q, heads_q, v.shape[-1]))
            continue
        ks, vs = (t[ck[b]:ck[b] + len_k].double().repeat_interleave(group, 1) for t in (k, v))
        x = scale * torch.einsum("qhd,khd->hqk", qs, ks)
        if softcap:
            x = softcap * torch.tanh(x / softcap)
        rows = torch.arange(len_q)[:, None] + len_k - len_q
        cols = torch.arange(len_k)[None, :]
        allowed = window_visibility(len_q, len_k, left, right) & visible(torch.tensor(b), torch.arange(heads_q)[:, None, None], rows[None], cols[None])
        x = x.masked_fill(~allowed, float("-inf"))
        top = torch.where(allowed.any(-1, keepdim=True), x.amax(-1, keepdim=True), 0.0).detach()
        e = torch.exp(x - top)
        total = e.sum(-1, keepdim=True)
        p = e / torch.where(total > 0, total, 1.0)
        pieces.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(pieces)


@pytest.fixture
def calls(monkeypatch):
    """Every varlen_attn call the integration makes, answered by the float64 reference."""
    recorded = []
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    # the reference is exact in float32
    with jt.use_backend(jt.Backend(reference_standin(recorded), (torch.float16, torch.bfloat16, F32))):
        jt.register()
        yield recorded


# ---------------------------------------------------------------- the kernel seam
def test_use_backend_takes_only_a_backend_and_restores_the_previous_one_after_an_error(calls):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="Backend"):
        with jt.use_backend(reference_standin(calls)):  # a bare function, not a Backend
            pass
    seen = []

    def failing(*args, **kwargs):
        seen.append(args)
        raise RuntimeError("stand-in failed")

    with pytest.raises(RuntimeError, match="stand-in failed"):
        with jt.use_backend(jt.Backend(failing, (torch.float16, torch.bfloat16, F32))):
            jt.attention_forward(Attn(), q, k, v, None)
    assert len(seen) == 1
    before = len(calls)
    jt.attention_forward(Attn(), q, k, v, None)  # back on the fixture's reference stand-in
    assert len(calls) == before + 1


def test_use_backend_refuses_an_unknown_padding_by_name(calls):
    with pytest.raises(ValueError, match=r"padding must be one of on_device, host_read, async_read, got 'unpad'"):
        with jt.use_backend(jt.JITATTN_BACKEND._replace(padding="unpad")):
            pass
    assert jt.JITATTN_BACKEND.padding == "on_device"


# ---------------------------------------------------------------- registration
def test_register_adds_jitattn_to_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert jt.register() == "jitattn" and jt.register() == "jitattn"  # idempotent
    assert AttentionInterface()["jitattn"] is jt.attention_forward
    assert "jitattn" in AttentionInterface().valid_keys()
    # the model hands over the 2D padding mask (or None), as to FlashAttention
    assert ALL_MASK_ATTENTION_FUNCTIONS["jitattn"] is jt.padding_mask


def mask_call(mask, q_length, kv_length=None):
    """What transformers' create_*_mask hands a mask function (keywords, as masking_utils calls it)."""
    from transformers.masking_utils import causal_mask_function

    kv_length = mask.shape[1] if kv_length is None else kv_length
    return dict(batch_size=mask.shape[0], q_length=q_length, kv_length=kv_length, q_offset=0, kv_offset=0,
                mask_function=causal_mask_function, attention_mask=mask, allow_is_causal_skip=True,
                dtype=torch.float32, config=None, use_vmap=False, device=mask.device)


@pytest.mark.parametrize("padded", [False, True])
def test_padding_mask_hands_inference_calls_the_2d_mask_without_reading_it(padded):
    """Several queries, no grad (an encoder, a prompt): the mask's last kv_length columns, read
    by nothing on the host (FlashAttention's function would return None for an all-ones mask after
    reading it). One query, or grad: FlashAttention's own answer."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    flash = ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :4] = not padded
    counter = SyncCounter()
    with torch.no_grad(), counter:
        got = jt.padding_mask(**mask_call(mask, q_length=9))
        sliced = jt.padding_mask(**mask_call(mask, q_length=5, kv_length=6))
    assert counter.syncs == []
    assert torch.equal(got, mask) and got.data_ptr() == mask.data_ptr()  # a view: nothing copied
    assert torch.equal(sliced, mask[:, -6:])
    for q_length, grad in ((1, False), (9, True)):
        with torch.set_grad_enabled(grad):
            want = flash(**mask_call(mask, q_length=q_length))
            got = jt.padding_mask(**mask_call(mask, q_length=q_length))
        assert (got is None) == (want is None) == (not padded)
        assert want is None or torch.equal(got, want)
    with torch.no_grad():  # no mask stays no mask
        assert jt.padding_mask(**{**mask_call(mask, q_length=9), "attention_mask": None}) is None


def test_an_encoder_forward_pass_reads_nothing_back_and_matches_sdpa_without_padding(calls, sync_counter):
    """A BERT-like encoder under jitattn: no host read in the whole forward pass (transformers' mask
    creation included), padded or not; an all-ones mask takes the padded path and stays exact."""
    def config():  # one each: a model keeps its config's attention implementation
        return transformers.BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=32)

    torch.manual_seed(0)
    ours = transformers.AutoModel.from_config(config(), attn_implementation="jitattn").eval()
    theirs = transformers.AutoModel.from_config(config(), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(1, 100, (3, 10), generator=torch.Generator().manual_seed(1))
    for mask in (torch.ones(3, 10, dtype=torch.long), torch.tensor([[1] * 10, [1] * 6 + [0] * 4, [1] * 3 + [0] * 7])):
        del sync_counter.syncs[:]
        with torch.no_grad():
            with sync_counter:
                got = ours(ids, attention_mask=mask).last_hidden_state
            want = theirs(ids, attention_mask=mask).last_hidden_state
        assert sync_counter.syncs == [], sync_counter.syncs
        assert [c["mask_mod"] is not None for c in calls] == [True, True]  # both layers: the padded path
        del calls[:]
        valid = mask.bool()
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4)


def test_register_without_transformers_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"jitattn\[transformers\]"):
        jt.register()


def test_models_accept_the_name_at_load_and_later(calls):
    config = llama_config()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="jitattn")
    assert model.config._attn_implementation == "jitattn"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("jitattn")
    assert model.config._attn_implementation == "jitattn"
    model(torch.randint(0, 100, (1, 6)))
    assert len(calls) == config.num_hidden_layers


# ---------------------------------------------------------------- how a call maps
class Attn(torch.nn.Module):
    is_causal = True


def qkv(batch=2, h_q=4, h_kv=2, len_q=7, len_k=7, d=32, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h_q, len_q, d, generator=g, dtype=dtype),
            torch.randn(batch, h_kv, len_k, d, generator=g, dtype=dtype),
            torch.randn(batch, h_kv, len_k, d, generator=g, dtype=dtype))


def sdpa(q, k, v, mask=None, scale=None, causal=True, window=None):
    """(B, L_q, H, D) by torch's SDPA in float64, bottom-right causal, with the padding mask and a
    sliding window of `window` positions."""
    len_q, len_k = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1).double() for t in (k, v))
    rows = torch.arange(len_q)[:, None] + len_k - len_q
    cols = torch.arange(len_k)[None, :]
    allowed = torch.ones(len_q, len_k, dtype=torch.bool)
    if causal:
        allowed &= cols <= rows
    if window:  # FlashAttention's window as transformers maps it: W - 1 to the left (and right, not causal)
        allowed &= (rows - cols < window) if causal else ((rows - cols).abs() < window)
    allowed = allowed[None, None].expand(q.shape[0], 1, len_q, len_k)
    if mask is not None:
        allowed = allowed & mask.bool()[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=allowed, scale=scale)
    return out.nan_to_num(0.0).transpose(1, 2)


def test_causal_gqa_scaling_and_window_reach_varlen(calls):
    q, k, v = qkv()
    out, weights = jt.attention_forward(Attn(), q, k, v, None, scaling=0.3, sliding_window=4)
    call = calls[-1]
    assert weights is None and out.shape == (2, 7, 4, 32)
    assert call["window"] == (3, 0) and call["scale"] == 0.3 and call["enable_gqa"] is True
    assert (call["max_q"], call["max_k"]) == (7, 7) and call["cu_q"].tolist() == [0, 7, 14]
    torch.testing.assert_close(out.double(), sdpa(q, k, v, scale=0.3, window=4), rtol=0, atol=1e-5)


def test_non_causal_and_symmetric_window(calls):
    q, k, v = qkv(h_q=2, h_kv=2)
    jt.attention_forward(Attn(), q, k, v, None, is_causal=False)
    assert calls[-1]["window"] == (-1, -1) and calls[-1]["enable_gqa"] is False
    jt.attention_forward(Attn(), q, k, v, None, is_causal=False, sliding_window=3)
    assert calls[-1]["window"] == (2, 2)


@pytest.mark.parametrize("batch", [3, 1])
def test_an_inference_call_reads_the_kv_cache_in_place(calls, batch):
    """No grad: keys/values are slots of a strided view of the cache, never copied (batch 1 too:
    generation at batch 1 would copy the whole cache in every layer at every step)."""
    q, k, v = qkv(batch=batch, len_q=1, len_k=9)
    with torch.no_grad():
        out, _ = jt.attention_forward(Attn(), q, k, v, None)
    call = calls[-1]
    rows = k.stride(0) // k.stride(2)
    assert call["k"].data_ptr() == k.data_ptr() and call["v"].data_ptr() == v.data_ptr()
    assert call["seqused_k"].tolist() == [9] * batch
    assert call["cu_k"].tolist() == [b * rows for b in range(batch)] + [(batch - 1) * rows + 9]
    torch.testing.assert_close(out.double(), sdpa(q, k, v), rtol=0, atol=1e-5)


def test_a_call_with_grad_packs_keys_and_is_differentiable(calls):
    q, k, v = (t.requires_grad_() for t in qkv(batch=2, len_q=5, len_k=5))
    out, _ = jt.attention_forward(Attn(), q, k, v, None)
    assert calls[-1]["seqused_k"] is None and calls[-1]["cu_k"].tolist() == [0, 5, 10]
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((sdpa(*leaves) * g.double()).sum(), leaves)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("len_q", [9, 1, 3])
def test_a_padding_mask_reads_keys_in_place_and_zeroes_padded_rows(calls, len_q):
    """Left padding (generation), the prompt (L_q = L_k), a decode step, a chunk of 3: keys are
    read where they lie (row b's run by cu_k and seqused_k), queries stay in their padded rows."""
    q, k, v = qkv(batch=2, len_q=len_q, len_k=9)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.bool)
    with torch.no_grad():
        out, _ = jt.attention_forward(Attn(), q, k, v, mask)
    call = calls[-1]
    rows = k.stride(0) // k.stride(2)  # a slot per batch row
    assert call["k"].data_ptr() == k.data_ptr() and call["v"].data_ptr() == v.data_ptr()
    assert call["max_k"] == 9 and call["max_q"] == len_q  # the shapes' bounds: nothing read back
    if len_q == 1:  # one sequence per row, from its first token (row 0: its slot's start) to the mask's end
        assert call["cu_q"].tolist() == [0, 1, 2]
        assert call["cu_k"].tolist() == [0, rows, rows + 9] and call["seqused_k"].tolist() == [9, 9]
    else:  # padding before, the run, padding after (no keys), per row
        valid = mask[:, -len_q:].sum(-1).tolist()
        assert call["cu_q"].tolist() == [0, len_q - valid[0], len_q, len_q, len_q, 2 * len_q, 2 * len_q]
        assert call["cu_k"].tolist() == [0, 3, 9, rows, rows, rows + 9, rows + 9]
        assert call["seqused_k"].tolist() == [0, 6, 0, 0, 9, 0]
    valid_q = mask[:, -len_q:]
    want = sdpa(q, k, v, mask=mask)
    torch.testing.assert_close(out[valid_q].double(), want[valid_q], rtol=0, atol=1e-5)
    assert (out[~valid_q] == 0).all()


def test_packed_sequences_from_flash_kwargs_and_from_position_ids(calls):
    q, k, v = qkv(batch=1, len_q=10, len_k=10)
    cu = torch.tensor([0, 4, 10], dtype=I32)
    out, _ = jt.attention_forward(Attn(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
                                  max_length_k=6)
    assert calls[-1]["cu_q"].tolist() == [0, 4, 10] and calls[-1]["max_q"] == 6
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    out2, _ = jt.attention_forward(Attn(), q, k, v, None, position_ids=position_ids)
    assert calls[-1]["cu_q"].tolist() == [0, 4, 10] and calls[-1]["max_k"] == 6
    assert torch.equal(out, out2)
    for a, b in ((0, 4), (4, 10)):  # each sequence on its own
        want = sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        torch.testing.assert_close(out[:, a:b].double(), want, rtol=0, atol=1e-5)
    jt.attention_forward(Attn(), q, k, v, None, position_ids=torch.arange(10)[None])
    assert calls[-1]["cu_q"].tolist() == [0, 10]  # one sequence: the dense path


def test_refusals_name_what_cannot_be_expressed(calls):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout=0\.1"):
        jt.attention_forward(Attn(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"s_aux"):
        jt.attention_forward(Attn(), q, k, v, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match=r"2D padding mask.*\(2, 1, 7, 7\)"):
        jt.attention_forward(Attn(), q, k, v, torch.ones(2, 1, 7, 7, dtype=torch.bool))


def test_gaps_inside_a_row_are_exact_with_and_without_a_sliding_window(calls):
    """The window counts positions in the padded row, as transformers' own masks do (sdpa): gaps
    are masked by the mask_mod, and the keys keep their places."""
    q, k, v = qkv()
    holes = torch.tensor([[1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    for window in (None, 3):
        out, _ = jt.attention_forward(Attn(), q, k, v, holes, sliding_window=window)
        call = calls[-1]
        assert call["mask_mod"] is not None and call["window"] == ((-1, 0) if window is None else (2, 0))
        rows = k.stride(0) // k.stride(2)  # read in place: a slot per batch row
        assert call["cu_k"].tolist() == [0, 0, 7, rows, rows + 1, rows + 7, rows + 7]  # row 1: its span, 1..6
        want = sdpa(q, k, v, mask=holes, window=window)
        torch.testing.assert_close(out[holes].double(), want[holes], rtol=0, atol=1e-5)
        gap_rows = torch.tensor([[0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
        torch.testing.assert_close(out[gap_rows].double(), want[gap_rows], rtol=0, atol=1e-5)  # as sdpa's


def test_float32_runs_under_autocast_and_is_refused_without(calls):
    q, k, v = qkv()
    with jt.use_backend(jt.Backend(reference_standin(calls), (torch.float16, torch.bfloat16))):
        with pytest.raises(TypeError, match=r"float16 or bfloat16.*dtype=torch\.bfloat16.*autocast"):
            jt.attention_forward(Attn(), q, k, v, None)
        with torch.autocast("cpu", dtype=BF16):
            out, _ = jt.attention_forward(Attn(), q, k, v, None)
    assert out.dtype == BF16 and calls[-1]["q"].dtype == BF16


# ---------------------------------------------------------------- whole models against sdpa
def llama_config(**kw):
    return transformers.LlamaConfig(vocab_size=100, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    initializer_range=0.2, pad_token_id=0, **kw)


def mistral_config(**kw):
    return transformers.MistralConfig(vocab_size=100, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      sliding_window=6, initializer_range=0.2, pad_token_id=0, **kw)


def gemma2_config(**kw):
    kw.setdefault("attn_logit_softcapping", None)
    return transformers.Gemma2Config(vocab_size=100, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     max_position_embeddings=128, sliding_window=6, query_pre_attn_scalar=48,
                                     final_logit_softcapping=None, initializer_range=0.2, pad_token_id=0, **kw)


def gemma2_softcap_config(**kw):
    kw.setdefault("attn_logit_softcapping", 2.0)  # Gemma-2's is 50; at 2 the cap bites on these small models
    return gemma2_config(**kw)


CONFIGS = {"llama": llama_config, "mistral": mistral_config, "gemma2": gemma2_config,
           "gemma2-softcap": gemma2_softcap_config}


def reference_implementation(name: str) -> str:
    """transformers' own implementation to compare with: sdpa, or eager where a transformers
    release dropped sdpa for the architecture (Gemma-2 in 5.24), and where a soft cap is on (sdpa
    drops it)."""
    if name == "gemma2-softcap":
        return "eager"
    try:
        transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa")
    except ValueError as exc:
        if "does not support an attention implementation" in str(exc):
            return "eager"
        raise
    return "sdpa"


def pair(name, **kw):
    """The same random weights under transformers' own attention and under jitattn (float32, eval)."""
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](**kw), attn_implementation="jitattn")
    theirs = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](**kw),
                                                           attn_implementation=reference_implementation(name))
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def prompts(seed=1):
    """Two left-padded prompts of 11 and 7 tokens (ids >= 1; 0 is the pad)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_with_padding_match_sdpa(calls, name):
    ours, theirs = pair(name)
    ids, mask = prompts()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = theirs(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4)
    assert any(c["window"][0] == 5 for c in calls) == (name != "llama")  # the sliding window reached varlen
    assert {c["softcap"] for c in calls} == ({2.0} if name == "gemma2-softcap" else {None})  # and the soft cap


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_generation_with_the_kv_cache_matches_sdpa(calls, name):
    ours, theirs = pair(name)
    ids, mask = prompts(seed=2)
    common = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(ids, **common)
        want = theirs.generate(ids, **common)
    assert torch.equal(got, want)
    assert any(c["max_q"] == 1 for c in calls)  # decode steps through varlen


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_packed_training_step_matches_unpacked_sdpa(calls, name):
    """DataCollatorWithFlattening (with and without the flash kwargs) against a padded batch."""
    ours, theirs = pair(name)
    ours.train(), theirs.train()
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (9, 5, 12)]
    features = [{"input_ids": s, "labels": s} for s in seqs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    labels = torch.tensor([s + [-100] * (width - len(s)) for s in seqs])
    mask = (labels != -100).long()
    theirs.zero_grad()
    theirs(ids, attention_mask=mask, labels=labels).loss.backward()
    want_loss = theirs(ids, attention_mask=mask, labels=labels).loss.item()
    for flash_kwargs in (False, True):
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)
        ours.zero_grad()
        loss = ours(**batch).loss
        loss.backward()
        assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-5)
        for (pname, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {pname}: {m}")
    assert calls[-1]["cu_q"].tolist() == [0, 9, 14, 26] and calls[-1]["q"].requires_grad


def test_softcap_maps_to_varlen_softcap(calls):
    q, k, v = qkv()
    out, _ = jt.attention_forward(Attn(), q, k, v, None, softcap=1.5)
    assert calls[-1]["softcap"] == 1.5
    # Gemma-2's eager formula in float64: causal, GQA, logits 1.5 * tanh(q.k / sqrt(32) / 1.5).
    kk, vv = (t.repeat_interleave(2, 1).double() for t in (k, v))
    logits = 1.5 * torch.tanh(q.double() @ kk.transpose(-1, -2) / 32**0.5 / 1.5)
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    want = (logits.softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    uncapped, _ = jt.attention_forward(Attn(), q, k, v, None)
    assert (uncapped - out).abs().max() > 1e-2  # the cap changed the result


# ---------------------------------------------------------------- host syncs: once per forward pass, not per layer
SYNCS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


class SyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that read values back to the host (on a GPU: a sync), outside
    the stand-in for varlen_attn (the float64 reference reads its metadata, the kernels do not)."""

    def __init__(self):
        super().__init__()
        self.syncs, self.paused = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in SYNCS:
            self.syncs.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def sync_counter(calls):
    counter = SyncCounter()
    standin = reference_standin(calls)

    def paused(*args, **kwargs):
        counter.paused = True
        try:
            return standin(*args, **kwargs)
        finally:
            counter.paused = False

    # use_backend also starts from an empty per-forward memo: the first layer's reads show
    with jt.use_backend(jt.Backend(paused, (torch.float16, torch.bfloat16, F32))):
        yield counter


@pytest.mark.parametrize("padding", jt.PADDINGS)
@pytest.mark.parametrize("len_q", [9, 1])
def test_no_layer_makes_a_host_sync_and_host_read_padding_reads_once(sync_counter, len_q, padding):
    """The padded path ("on_device"): no layer reads back, the first included. "host_read": the
    first layer of a forward pass reads the mask once; the other layers (the same mask tensor)
    reuse what it derived. The dense path never reads back."""
    q, k, v = qkv(batch=2, len_q=len_q, len_k=9)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.bool)
    per_layer = []
    backend = jt._backend._replace(padding=padding)
    with jt.use_backend(backend), sync_counter, torch.no_grad():
        for _ in range(4):
            before = len(sync_counter.syncs)
            jt.attention_forward(Attn(), q, k, v, mask)
            per_layer.append(len(sync_counter.syncs) - before)
        before = len(sync_counter.syncs)
        for _ in range(3):
            jt.attention_forward(Attn(), q, k, v, None)
        dense = len(sync_counter.syncs) - before
    assert per_layer == ([0, 0, 0, 0] if padding == "on_device" else [1, 0, 0, 0]), sync_counter.syncs
    assert dense == 0, sync_counter.syncs


def test_a_new_or_changed_mask_is_read_again(sync_counter):
    q, k, v = qkv(batch=2, len_q=1, len_k=9)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.bool)
    with torch.no_grad():
        first, _ = jt.attention_forward(Attn(), q, k, v, mask)
        mask[1, :5] = False  # in place: the version changes
        changed, _ = jt.attention_forward(Attn(), q, k, v, mask)
        fresh, _ = jt.attention_forward(Attn(), q, k, v, mask.clone())
    torch.testing.assert_close(changed.double(), sdpa(q, k, v, mask=mask), rtol=0, atol=1e-5)
    assert not torch.equal(first[1], changed[1]) and torch.equal(changed, fresh)


def test_a_padded_forward_pass_makes_as_many_host_reads_with_4_layers_as_with_1(calls, sync_counter):
    """Whatever transformers itself reads back (mask creation), jitattn's share does not grow
    with the number of layers."""
    ids, mask = prompts()
    counts = {}
    for layers in (1, 4):
        config = llama_config()
        config.num_hidden_layers = layers
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="jitattn").eval()
        del calls[:], sync_counter.syncs[:]
        with torch.no_grad(), sync_counter:
            model(ids, attention_mask=mask)
        assert len(calls) == layers
        counts[layers] = list(sync_counter.syncs)
    assert counts[4] == counts[1], counts


@pytest.mark.parametrize("causal", [True, False])
def test_right_padding_reads_in_place_and_matches_sdpa(calls, causal):
    """Right padding (an encoder batch, or a training batch padded on the right), the prompt."""
    q, k, v = qkv(batch=3, len_q=8, len_k=8)
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8, [1] * 2 + [0] * 6], dtype=torch.bool)
    with torch.no_grad():
        out, _ = jt.attention_forward(Attn(), q, k, v, mask, is_causal=causal)
    call = calls[-1]
    # causal: padding before, the run, padding after per row; bidirectional: a sequence per row
    used = [0, 5, 0, 0, 8, 0, 0, 2, 0] if causal else [5, 8, 2]
    assert call["k"].data_ptr() == k.data_ptr() and call["seqused_k"].tolist() == used
    want = sdpa(q, k, v, mask=mask, causal=causal)
    rows = mask if causal else torch.ones_like(mask)  # bidirectional padding rows attend as sdpa's
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=0, atol=1e-5)
    assert (out[~rows] == 0).all()


def test_padding_with_grad_packs_keys_and_is_differentiable(calls):
    q, k, v = (t.requires_grad_() for t in qkv(batch=2, len_q=6, len_k=6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    out, _ = jt.attention_forward(Attn(), q, k, v, mask)
    assert calls[-1]["k"].shape == (12, 2, 32)  # packed (B * L_k rows), not a view of the cache
    g = torch.randn_like(out) * mask[:, :, None, None]
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((sdpa(*leaves, mask=mask) * g.double()).sum(), leaves)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- padding masks of every kind, no host read
MASK_KINDS = ("left", "right", "gaps", "all-pad and full rows")


def random_mask(kind: str, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    """(batch, length) bool: each row's tokens left- or right-padded, scattered (gaps inside the
    row), or (last kind) an all-padding row, a full row and left-padded rows."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b in range(batch):
        n = int(torch.randint(1, length + 1, (1,), generator=g))
        if kind == "right":
            mask[b, :n] = True
        elif kind == "gaps":
            mask[b] = torch.rand(length, generator=g) < 0.6
            mask[b, int(torch.randint(0, length, (1,), generator=g))] = True
        else:
            mask[b, length - n:] = True
    if kind == "all-pad and full rows":
        mask[0], mask[1] = False, True
    return mask


@pytest.fixture
def host_reads_raise(calls):
    """A context manager in which every tensor method that reads values back to the host (on a
    GPU, a sync) raises, except inside the stand-in for varlen_attn (the float64 reference reads
    its metadata; the kernels do not). The methods are restored on leaving it."""
    standin = reference_standin(calls)
    inside = []

    def reading(*args, **kwargs):
        inside.append(True)
        try:
            return standin(*args, **kwargs)
        finally:
            inside.pop()

    def forbidden(name, original):
        def read(*args, **kwargs):
            if not inside:
                raise AssertionError(f"the padded path made a host read: {name}")
            return original(*args, **kwargs)

        return read

    @contextlib.contextmanager
    def no_host_reads():
        names = ("tolist", "item", "nonzero", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
        originals = {name: getattr(torch.Tensor, name) for name in names}
        original_nonzero = torch.nonzero
        try:
            for name, original in originals.items():
                setattr(torch.Tensor, name, forbidden(f"Tensor.{name}", original))
            torch.nonzero = forbidden("torch.nonzero", original_nonzero)
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            torch.nonzero = original_nonzero

    with jt.use_backend(jt.Backend(reading, (torch.float16, torch.bfloat16, F32))):
        yield no_host_reads


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("len_q", [12, 1])
def test_every_padding_mask_matches_sdpa_with_no_host_read(calls, host_reads_raise, kind, len_q):
    """Random masks of each kind, the prompt (L_q = L_k) and a decode step, with and without GQA,
    causal or not, with and without a sliding window, each a new forward pass (first layer
    included): the valid query rows are sdpa's (float64), and so are query rows inside a gap;
    the padding before and after a row's queries comes out zero."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    batch, len_k = 4, 12
    for heads_kv in (2, 4):
        for causal in (True, False):
            for window in (None, 4):
                q, k, v = qkv(batch=batch, h_q=4, h_kv=heads_kv, len_q=len_q, len_k=len_k,
                              seed=int(torch.randint(0, 2**31, (1,), generator=g)))
                mask = random_mask(kind, batch, len_k, g)
                with torch.no_grad(), host_reads_raise():
                    out, _ = jt.attention_forward(Attn(), q, k, v, mask, is_causal=causal, sliding_window=window)
                call = calls[-1]
                assert (call["max_q"], call["max_k"]) == (len_q, len_k) and call["mask_mod"] is not None
                assert call["k"].data_ptr() == k.data_ptr()  # read in place
                want = sdpa(q, k, v, mask=mask, causal=causal, window=window)
                valid_q = mask[:, -len_q:]
                if len_q == 1 or (not causal and window is None):  # one sequence per row: every row as sdpa's
                    inside = torch.ones_like(valid_q)
                else:  # from the row's first valid query to its last
                    cols = torch.arange(len_q)
                    first = torch.where(valid_q, cols, len_q).amin(-1, keepdim=True)
                    last = torch.where(valid_q, cols, -1).amax(-1, keepdim=True)
                    inside = (cols >= first) & (cols <= last)
                said = f"{kind}, {heads_kv} kv heads, causal {causal}, window {window}"
                torch.testing.assert_close(out[inside].double(), want[inside], rtol=0, atol=1e-5, msg=said)
                assert (out[~inside] == 0).all(), said


def test_dense_starts_match_their_formula_across_length_tables_and_cache_layouts():
    """jt._dense_starts (a dense batch's metadata): cu_q = b x L_q, cu_k = b x rows but the last,
    (B - 1) x rows + L_k, seqused_k = L_k; for slots of c x L_k rows (a DynamicCache's (B, H, L, D)
    at any H) from tables of jt.LENGTHS lengths, crossed here; a static cache's longer slots not."""
    for batch in (1, 3):
        for per_key in (1, 2, 4):
            for len_k in (1, 62, 63, 64, 65, 127, 128, 300):
                for rows in (per_key * len_k, per_key * len_k + 5):
                    cu_q, cu_k, used = jt._dense_starts(batch, 1, len_k, rows, torch.device("cpu"))
                    assert cu_q.tolist() == list(range(batch + 1))
                    assert cu_k.tolist() == [b * rows for b in range(batch)] + [(batch - 1) * rows + len_k]
                    assert used.tolist() == [len_k] * batch
                    for t in (cu_q, cu_k, used):
                        assert t.dtype == torch.int32 and t.is_contiguous()
    cu_q, _, _ = jt._dense_starts(2, 5, 7, 7, torch.device("cpu"))
    assert cu_q.tolist() == [0, 5, 10]


def test_runs_finds_each_rows_first_token_span_and_count():
    """jt._runs against a loop over random masks of every kind and width (a slice of the columns),
    rows without a True among them."""
    g = torch.Generator().manual_seed(11)
    ends = torch.arange(1, 17, dtype=torch.int32)
    for kind in MASK_KINDS:
        for width in (1, 7, 16):
            mask = random_mask(kind, 5, 16, g)[:, -width:]
            mask[0] = False
            first, span, count = jt._runs(mask, ends)
            for b, row in enumerate(mask.tolist()):
                at = [i for i, x in enumerate(row) if x]
                want = (at[0], at[-1] - at[0] + 1, len(at)) if at else (0, 0, 0)
                assert (int(first[b]), int(span[b]), int(count[b])) == want, (kind, width, row)
            assert first.dtype == span.dtype == count.dtype == torch.int32


@pytest.mark.parametrize("host_read", [False, True])
def test_an_encoder_row_is_one_sequence_whose_padding_queries_attend_as_sdpa(calls, host_read):
    """Bidirectional (not causal, no window: an encoder's prompt): row b is one sequence of all L_q
    query rows over the span of its tokens, so the call has B sequences, not 3 B, and padding
    query rows get sdpa's values (an all-padding row: zero, as sdpa's NaN turned zero)."""
    g = torch.Generator().manual_seed(7)
    q, k, v = qkv(batch=4, len_q=10, len_k=10, seed=3)
    mask = random_mask("right", 4, 10, g)
    mask[1], mask[3] = False, True
    mask[3, 4] = False  # a gap
    padding = "host_read" if host_read else "on_device"
    with torch.no_grad(), jt.use_backend(jt._backend._replace(padding=padding)):
        out, _ = jt.attention_forward(Attn(), q, k, v, mask, is_causal=False)
    call = calls[-1]
    rows = k.stride(0) // k.stride(2)
    firsts = [int(row.nonzero().min()) if row.any() else 0 for row in mask]
    spans = [int(row.nonzero().max()) + 1 - f if row.any() else 0 for row, f in zip(mask, firsts)]
    assert call["cu_q"].tolist() == [0, 10, 20, 30, 40] and call["max_q"] == 10
    assert call["cu_k"].tolist() == [b * rows + f for b, f in enumerate(firsts)] + [3 * rows + 10]
    assert call["seqused_k"].tolist() == spans and call["mask_mod"] is not None  # row 3 has a gap
    assert call["max_k"] == (max(spans) if host_read else 10)
    torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=mask, causal=False), rtol=0, atol=1e-5)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_host_read_padding_gives_the_same_result_and_leaves_the_mask_mod_out_without_gaps(calls, kind):
    """Backend.padding "host_read" (the path before, for measuring against): the longest span as
    max_k, no mask_mod where no row has gaps (row 0's keys then start at its first token: the view
    moves), the same outputs as "on_device"."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for len_q in (10, 1):
        q, k, v = qkv(batch=4, len_q=len_q, len_k=10, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        mask = random_mask(kind, 4, 10, g)
        if kind == "left":
            mask[:, :2] = False  # every row padded: the longest span is below L_k
        with torch.no_grad():
            device, _ = jt.attention_forward(Attn(), q, k, v, mask)
            with jt.use_backend(jt._backend._replace(padding="host_read")):
                host, _ = jt.attention_forward(Attn(), q, k, v, mask)
        call = calls[-1]
        torch.testing.assert_close(host, device, rtol=0, atol=1e-6)
        firsts = [int(row.nonzero().min()) if row.any() else 0 for row in mask]
        spans = [int(row.nonzero().max()) + 1 - first if row.any() else 0 for row, first in zip(mask, firsts)]
        if len_q == 1:  # each row's keys run from its first token to the mask's end (the query)
            spans = [10 - first for first in firsts]
        assert (call["mask_mod"] is None) == all(int(row.sum()) == n for row, n in zip(mask, spans))
        if call["mask_mod"] is None:
            assert call["max_k"] == max(spans) and (kind != "left" or call["max_k"] <= 8)
            if len_q == 1:
                first = int(mask[0].nonzero().min())
                assert call["k"].data_ptr() - k.data_ptr() == first * k.stride(2) * k.element_size()



@pytest.mark.parametrize("kind", MASK_KINDS)
def test_async_read_padding_leaves_the_mask_mod_out_once_it_knows_no_row_has_gaps(calls, kind):
    """Backend.padding "async_read": the plan of "on_device" (max_k = L_k, keys in place), and the
    read of whether any row has gaps (a mask on the CPU is read at once: here the first layer
    already knows) leaves the mask_mod out exactly when none has; every layer's output is the
    float64 one, as "on_device"'s."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    backend = jt._backend._replace(padding="async_read")  # the fixture's stand-in, reading asynchronously
    for len_q in (10, 1):
        for causal in (True, False):
            mask = random_mask(kind, 4, 10, g)
            gaps = any(row.any() and int(row.sum()) != int(row.nonzero().max()) + 1 - int(row.nonzero().min())
                       for row in mask)
            for layer in range(2):
                q, k, v = qkv(batch=4, len_q=len_q, len_k=10, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
                with torch.no_grad():
                    device, _ = jt.attention_forward(Attn(), q, k, v, mask, is_causal=causal)
                    on_device = calls[-1]
                    with jt.use_backend(backend):
                        read, _ = jt.attention_forward(Attn(), q, k, v, mask, is_causal=causal)
                call = calls[-1]
                torch.testing.assert_close(read, device, rtol=0, atol=1e-6)
                assert (call["max_q"], call["max_k"]) == (on_device["max_q"], on_device["max_k"]) == (len_q, 10)
                assert call["k"].data_ptr() == k.data_ptr()
                if len_q == 1:  # a decode step's row reads from its first token (row 0: its slot's start) to the end
                    gaps = any(int(row.sum()) != 10 - (int(row.int().argmax()) if b else 0)
                               for b, row in enumerate(mask))
                assert (call["mask_mod"] is not None) == gaps, (kind, len_q, causal, layer)


def test_async_read_warm_calls_switch_between_the_calls_with_and_without_the_mask_mod(kernel_calls):
    """jitattn's own backend with "async_read" padding: a forward pass whose mask has no gaps runs
    its later layers without the mask_mod, one with gaps with it; each way is mapped and planned
    once (the same shapes' warm calls hand over to each other), and every layer is exact."""
    clean = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]] * 2 + [[1] * 8], dtype=torch.bool)
    holed = clean.clone()
    holed[2, 3] = False
    with torch.no_grad(), jt.use_backend(jt.jitattn_backend("async_read")):
        for step, mask in enumerate((clean, holed, clean.clone(), holed.clone(), clean.clone())):
            for layer in range(3):
                # (B, H, L, D) views of (B, L, H, D) tensors, as a model's projections give them
                q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
                           for t in qkv(batch=3, len_q=8, len_k=8, dtype=BF16, seed=10 * step + layer))
                out, _ = jt.attention_forward(Attn(), q, k, v, mask, is_causal=False)
                torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=mask, causal=False), rtol=0, atol=1e-2)
                hooked = kernel_calls["launches"][-1]["spec"]
                assert ("_mm" in hooked) == (mask is holed or bool((mask != clean).any())), (step, layer, hooked)
    assert len(kernel_calls["mapped"]) == 2  # the pass without gaps, then the first with: never again
    assert jt.jitattn_backend() is jt.JITATTN_BACKEND
    with pytest.raises(ValueError, match="padding must be one of on_device, host_read, async_read, got 'x'"):
        jt.jitattn_backend("x")

def test_a_padded_training_step_with_gaps_is_differentiable(calls):
    """With grad the keys are packed (B * L_k rows), the mask_mod goes with them, and the
    gradients are sdpa's (float64) through every valid query row."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q, k, v = (t.requires_grad_() for t in qkv(batch=3, len_q=8, len_k=8, seed=int(torch.randint(0, 2**31, (1,)))))
    mask = random_mask("gaps", 3, 8, g)
    out, _ = jt.attention_forward(Attn(), q, k, v, mask, sliding_window=5)
    assert calls[-1]["k"].shape == (24, 2, 32) and calls[-1]["mask_mod"] is not None
    weights = torch.randn(out.shape, generator=g) * mask[:, :, None, None]
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((sdpa(*leaves, mask=mask, window=5) * weights.double()).sum(), leaves)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)


def test_the_mask_mod_is_traced_once_and_each_forward_pass_attaches_its_tensors(calls):
    """With jitattn.variants: the mask_mod handed to varlen_attn is the one traced Variant
    (whole[b], or the mask read where it lies from the row's first token), carrying this forward
    pass's tensors: the flags (N,), N = 3 sequences per row, each row's first token (B,) and the
    mask itself (B, L_k), no table made from it."""
    variants = pytest.importorskip("jitattn.variants")
    q, k, v = qkv(batch=2, len_q=6, len_k=6)
    masks = [torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1]], dtype=torch.bool),
             torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)]
    seen = []
    with torch.no_grad():
        for mask in masks:
            for _ in range(2):  # two layers of one forward pass
                jt.attention_forward(Attn(), q, k, v, mask)
                seen.append(calls[-1]["mask_mod"])
    assert all(isinstance(m, variants.Variant) and m.kind == "mask_mod" for m in seen)
    assert len({m.key_text for m in seen}) == 1
    assert seen[0].captures == (("bool", 1), ("int32", 1), ("bool", 2))
    assert seen[0] is seen[1] and seen[2] is seen[3] and seen[0].tensors[1] is not seen[2].tensors[1]
    whole, first, read = seen[0].tensors
    assert whole.tolist() == [True, True, True, True, False, True]  # row 1 has a gap
    assert first.tolist() == [2, 0] and read.tolist() == masks[0].tolist()


# ---------------------------------------------------------------- warm layer calls (jitattn's own backend)
@pytest.fixture
def kernel_calls(monkeypatch):
    """jitattn's own backend down to the kernel, whose stand-in (tests/varlen_stand_in.py) computes
    the float64 reference of the arguments it is launched with (its views, metadata, window, scale
    and the padding mask_mod rebuilt from its captured tensors). Yields the launches and the
    calls that were checked and planned (jitattn.varlen's varlen_call) and those the integration
    mapped and handed to jitattn.varlen_attn (a warm layer call does neither)."""
    import jitattn.varlen.api as api
    from jitattn.kernel import fresh_memos
    from jitattn.varlen import forward as varlen_forward
    from jitattn.varlen.variant_args import variants_of
    from tests.varlen_stand_in import stand_in_forward_kernels

    import jitattn

    record = {"launches": [], "checked": [], "mapped": []}

    def run(spec, q, k, v, cu_q, cu_k, used, table, out, bad_page, pack, m_blocks, splits, min_tiles, left, right,
            scale_log2, softcap, want_lse, build_mask_map, captures):
        record["launches"].append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, used=used, spec=spec.name,
                                       plan=(m_blocks, splits, min_tiles, left, right, build_mask_map)))
        _, mask_mod = variants_of(None, spec.mask_mod or None, captures)
        visible = visibility(mask_mod) if mask_mod is not None else (lambda b, h, q_idx, kv_idx: True)
        ref = masked_reference(q, k, v, cu_q, cu_k, used, scale_log2 / varlen_forward.LOG2E, (left, right),
                               softcap or None, visible)
        result = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        result.copy_(ref)
        return result, None

    checked = api.varlen_call

    def counting_call(*args, **kwargs):
        record["checked"].append(args[0].shape)
        return checked(*args, **kwargs)

    mapped = jitattn.varlen_attn

    def counting_varlen_attn(*args, **kwargs):
        record["mapped"].append(args[0].shape)
        return mapped(*args, **kwargs)

    stand_in_forward_kernels(monkeypatch, run)
    monkeypatch.setattr(api, "varlen_call", counting_call)
    monkeypatch.setattr(jitattn, "varlen_attn", counting_varlen_attn)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: __import__("types").SimpleNamespace(
        multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    monkeypatch.delenv("JITATTN_WGMMA", raising=False)
    with fresh_memos(), jt.use_backend(jt.JITATTN_BACKEND):
        yield record


def test_later_layers_launch_the_first_layers_plan_and_stay_exact(kernel_calls):
    """Layers of a decode step (a new padding mask per step, changed in place once, new values per
    layer): only a step's new shapes check and plan; every layer's result is the float64 one."""
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [0, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        for step, step_mask in enumerate((mask, mask.clone(), None)):
            for layer in range(3):
                q, k, v = qkv(batch=3, len_q=1, len_k=9, dtype=BF16, seed=10 * step + layer)
                out, _ = jt.attention_forward(Attn(), q, k, v, step_mask)
                want = sdpa(q, k, v, mask=step_mask)
                torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-2)
                assert kernel_calls["launches"][-1]["k"].data_ptr() == k.data_ptr()  # the cache, in place
            if step_mask is not None:
                step_mask[1, 4] = False  # in place, a gap in a row without: the next layer's plan is derived again
                out, _ = jt.attention_forward(Attn(), q, k, v, step_mask)
                torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=step_mask), rtol=0, atol=1e-2)
    # mapped, checked and planned: the padded shapes once, the dense ones once
    assert len(kernel_calls["mapped"]) == len(kernel_calls["checked"]) == 2
    assert len(kernel_calls["launches"]) == 3 * 3 + 2


def test_what_changes_a_call_plans_it_again(kernel_calls, monkeypatch):
    """Another head count, grad, a window, another scale or a knob (JITATTN_WGMMA) is a new
    signature: mapped, checked and planned, then warm itself (a longer cache alone is re-planned)."""
    def call(**kw):
        shape = dict(batch=2, len_q=1, len_k=9, dtype=BF16)
        extra = {name: kw.pop(name) for name in ("scaling", "sliding_window") if name in kw}
        q, k, v = qkv(**{**shape, **kw})
        before = len(kernel_calls["mapped"])
        out, _ = jt.attention_forward(Attn(), q, k, v, None, **extra)
        torch.testing.assert_close(out.double(), sdpa(q, k, v, scale=extra.get("scaling"),
                                                      window=extra.get("sliding_window")), rtol=0, atol=1e-2)
        return len(kernel_calls["mapped"]) - before

    with torch.no_grad():
        assert [call(), call()] == [1, 0]
        assert [call(len_k=10), call(len_k=10)] == [0, 0]  # a longer cache: re-planned, not mapped (below)
        assert [call(h_q=8), call(h_q=8)] == [1, 0]
        assert [call(scaling=0.25), call(scaling=0.25), call(sliding_window=4), call(sliding_window=4)] == [1, 0, 1, 0]
        monkeypatch.setenv("JITATTN_WGMMA", "0")
        assert [call(), call()] == [1, 0]
    q, k, v = (t.requires_grad_() for t in qkv(batch=2, len_q=1, len_k=9, dtype=BF16))
    before = len(kernel_calls["mapped"])
    for _ in range(2):  # with grad: never warm (each call is mapped and goes through autograd)
        jt.attention_forward(Attn(), q, k, v, None)
    assert len(kernel_calls["mapped"]) - before == 2


def test_a_decode_step_with_the_same_plan_reuses_the_kept_launch_for_its_longer_cache(kernel_calls, monkeypatch):
    """When one key more changes neither the split count nor the mask map (forward.for_max_k
    returns the launch itself), a step's first layer derives its kept launch from the last
    step's (KeptLaunch.for_keys: the new keys' strides) instead of packing one anew."""
    from jitattn.varlen import forward as varlen_forward

    kept = []
    real = varlen_forward.keep_launch
    monkeypatch.setattr(varlen_forward, "keep_launch", lambda *a: kept.append(a) or real(*a))
    with torch.no_grad():
        for len_k in range(400, 406):  # 13 key tiles of 32 each: one plan
            for layer in range(3):
                q, k, v = qkv(batch=1, h_q=8, h_kv=2, len_q=1, len_k=len_k, d=64, dtype=BF16, seed=len_k + layer)
                out, _ = jt.attention_forward(Attn(), q, k, v, None)
                torch.testing.assert_close(out.double(), sdpa(q, k, v), rtol=0, atol=1e-2)
    assert len(kept) == 1  # the first warm run packs it; every later step derives it
    assert len(kernel_calls["mapped"]) == 1


@pytest.mark.parametrize("padded", [False, True])
def test_a_decode_steps_first_layer_replans_the_last_steps_call_for_its_longer_cache(kernel_calls, padded):
    """A DynamicCache grows by one key per step, in a new tensor (and the padding mask by one
    column): the step's first layer re-plans the last step's call for the new length without
    mapping or checking it (jitattn/varlen/forward.py's for_max_k), and launches what the full path
    would (kernel, splits, window, mask map); where the short-call rule changes its verdict (129
    keys), the full path runs."""
    batch = 3 if padded else 1

    def steps():
        outs = []
        with torch.no_grad():
            for len_k in (125, 126, 127, 128, 129, 130, 400, 401):
                mask = None
                if padded:  # left padding, a gap in row 2
                    mask = torch.ones(batch, len_k, dtype=torch.long)
                    mask[1, :7] = 0
                    mask[2, :3] = 0
                    mask[2, 10] = 0
                for layer in range(2):
                    q, k, v = qkv(batch=batch, h_q=8, h_kv=2, len_q=1, len_k=len_k, d=64, dtype=BF16,
                                  seed=len_k + layer)
                    out, _ = jt.attention_forward(Attn(), q, k, v, mask)
                    torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=mask), rtol=0, atol=1e-2)
                    outs.append(out)
        return outs

    first = steps()
    replanned = [(c["spec"], c["plan"]) for c in kernel_calls["launches"]]
    assert len(kernel_calls["mapped"]) == 2  # the first call, and the first past the short-call rule's 128 keys
    kernel_calls["launches"].clear()
    # The same kernels on a backend of its own: no warm calls, every call the full path.
    with jt.use_backend(jt.Backend(jt.JITATTN_BACKEND.varlen_attn)):
        second = steps()
    assert [(c["spec"], c["plan"]) for c in kernel_calls["launches"]] == replanned
    assert len({plan[1] for _, plan in replanned}) > 1  # the split count follows the length
    assert all(torch.equal(a, b) for a, b in zip(first, second))
