"""CPU tests: the float64 decode oracle against a naive per-head loop written from shared/spec/decode.md.

The loop below is a literal transcription of "Exact semantics": logits x_j = s * q_scale * k_scale *
<q, k_j>, then soft cap, then the ALiBi bias slope_h * j, then the window; o = sum_j softmax(x)_j v_j
(times v_scale); lse = log2(sum_j 2^(x_j log2 e)). RoPE rotates q at position L-1 and k_j at j.
"""
from __future__ import annotations

import math

import pytest
import torch

from jitattn.reference import LOG2E, alibi_slopes, rope_llama, single_decode_reference

TOL = 1e-10


def spec_slopes(num_heads: int) -> list[float]:
    n = 1
    while n * 2 <= num_heads:
        n *= 2
    return [2.0 ** (-8.0 * (h + 1) / n) if h < n else 2.0 ** (-4.0 * (2.0 * (h + 1 - n) - 1.0) / n)
            for h in range(num_heads)]


def spec_rope(x: list[float], pos: int, rope_scale: float, rope_theta: float) -> list[float]:
    d = len(x)
    out = list(x)
    for i in range(d // 2):
        angle = pos * rope_theta ** (-2.0 * i / d) / rope_scale
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return out


def naive_decode(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", q_scale=None, k_scale=None,
                 v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                 rope_theta=None, alibi_offset=0):
    """(out [H, D], lse [H]) by loops over heads, keys and dims, in python floats.

    `alibi_offset` shifts the ALiBi position (bias slope * (j - alibi_offset)), to show what the
    contract does *not* say."""
    q, k, v = q.tolist(), k.tolist(), v.tolist()
    if kv_layout == "HND":  # [H_kv][L][D] -> [L][H_kv][D]
        k = [[k[h][j] for h in range(len(k))] for j in range(len(k[0]))]
        v = [[v[h][j] for h in range(len(v))] for j in range(len(v[0]))]
    num_qo_heads, head_dim = len(q), len(q[0])
    kv_len, num_kv_heads = len(k), len(k[0])
    group = num_qo_heads // num_kv_heads
    s = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    s *= (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)
    rs = 1.0 if rope_scale is None else rope_scale
    rt = 1e4 if rope_theta is None else rope_theta
    slopes = spec_slopes(num_qo_heads)
    out, lse = [], []
    for h in range(num_qo_heads):
        kv_head = h // group
        qh = q[h]
        if pos_encoding_mode == "ROPE_LLAMA":
            qh = spec_rope(qh, kv_len - 1, rs, rt)
        logits = []
        for j in range(kv_len):
            kj = k[j][kv_head]
            if pos_encoding_mode == "ROPE_LLAMA":
                kj = spec_rope(kj, j, rs, rt)
            x = s * sum(qh[i] * kj[i] for i in range(head_dim))
            if logits_soft_cap:
                x = logits_soft_cap * math.tanh(x / logits_soft_cap)
            if pos_encoding_mode == "ALIBI":
                x += slopes[h] * (j - alibi_offset)
            logits.append(x)
        keep = [j for j in range(kv_len) if window_left < 0 or j >= kv_len - 1 - window_left]
        m = max(logits[j] for j in keep)
        weights = {j: math.exp(logits[j] - m) for j in keep}
        total = sum(weights.values())
        o = [sum(weights[j] * v[j][kv_head][i] for j in keep) / total for i in range(head_dim)]
        if v_scale is not None:
            o = [x * v_scale for x in o]
        out.append(o)
        lse.append(math.log2(sum(2.0 ** (logits[j] * LOG2E) for j in keep)))
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def make_inputs(seed, num_qo_heads=4, num_kv_heads=4, kv_len=19, head_dim=32, kv_layout="NHD"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_qo_heads, head_dim, generator=g, dtype=torch.float64)
    shape = (kv_len, num_kv_heads, head_dim) if kv_layout == "NHD" else (num_kv_heads, kv_len, head_dim)
    k = torch.randn(*shape, generator=g, dtype=torch.float64)
    v = torch.randn(*shape, generator=g, dtype=torch.float64)
    return q, k, v


def check(q, k, v, **kw):
    out, lse = single_decode_reference(q, k, v, **kw)
    want_out, want_lse = naive_decode(q, k, v, **kw)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert (out - want_out).abs().max().item() < TOL
    assert (lse - want_lse).abs().max().item() < TOL
    return out, lse


def test_plain_decode_matches_the_spec():
    check(*make_inputs(0))


def test_single_key_sequence():
    q, k, v = make_inputs(1, kv_len=1)
    out, lse = check(q, k, v)
    assert torch.allclose(out, v[0], atol=TOL, rtol=0)  # one key: softmax weight 1
    x = (q * k[0]).sum(-1) / math.sqrt(q.shape[-1])
    assert torch.allclose(lse, x * LOG2E, atol=TOL, rtol=0)


def test_sm_scale_overrides_the_default():
    q, k, v = make_inputs(2)
    check(q, k, v, sm_scale=0.3)
    default, _ = single_decode_reference(q, k, v)
    other, _ = single_decode_reference(q, k, v, sm_scale=0.3)
    assert (default - other).abs().max().item() > 1e-3


@pytest.mark.parametrize("num_qo_heads, num_kv_heads", [(8, 2), (8, 1), (6, 3)])
def test_gqa_query_head_uses_kv_head_h_over_group(num_qo_heads, num_kv_heads):
    q, k, v = make_inputs(3, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, kv_len=23)
    out, _ = check(q, k, v)
    # Query head h must equal plain attention against kv head h // group.
    group = num_qo_heads // num_kv_heads
    for h in range(num_qo_heads):
        kh = h // group
        alone, _ = single_decode_reference(q[h:h + 1], k[:, kh:kh + 1], v[:, kh:kh + 1])
        assert (alone[0] - out[h]).abs().max().item() < TOL


def test_hnd_layout_matches_nhd_of_the_transposed_cache():
    q, k, v = make_inputs(4, num_qo_heads=8, num_kv_heads=2, kv_len=17, kv_layout="HND")
    out, lse = check(q, k, v, kv_layout="HND")
    out2, lse2 = single_decode_reference(q, k.transpose(0, 1), v.transpose(0, 1), kv_layout="NHD")
    assert (out - out2).abs().max().item() < TOL and (lse - lse2).abs().max().item() < TOL


@pytest.mark.parametrize("cap", [1.0, 5.0, 30.0])
def test_soft_cap(cap):
    q, k, v = make_inputs(5)
    q = q * 4  # big logits so the cap matters
    check(q, k, v, logits_soft_cap=cap)
    if cap <= 5.0:
        capped, _ = single_decode_reference(q, k, v, logits_soft_cap=cap)
        plain, _ = single_decode_reference(q, k, v)
        assert (capped - plain).abs().max().item() > 1e-3


@pytest.mark.parametrize("window_left", [0, 3, 18, 19, 50])
def test_window_left_keeps_the_last_w_plus_1_keys(window_left):
    q, k, v = make_inputs(6, num_qo_heads=4, num_kv_heads=2, kv_len=19)
    out, lse = check(q, k, v, window_left=window_left)
    kv_len = k.shape[0]
    if window_left == 0:
        # Only the last key: its value row, and its own logit as the LSE.
        group = 2
        for h in range(4):
            assert (out[h] - v[-1, h // group]).abs().max().item() < TOL
            x = (q[h] * k[-1, h // group]).sum() / math.sqrt(q.shape[-1])
            assert abs(lse[h].item() - x.item() * LOG2E) < TOL
    if window_left >= kv_len - 1:
        full, full_lse = single_decode_reference(q, k, v)
        assert (out - full).abs().max().item() < TOL and (lse - full_lse).abs().max().item() < TOL
    if window_left == 3:
        tail, tail_lse = single_decode_reference(q, k[-4:], v[-4:])
        assert (out - tail).abs().max().item() < TOL and (lse - tail_lse).abs().max().item() < TOL


def test_alibi_slopes_for_8_heads():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(h + 1) for h in range(8)], dtype=torch.float64),
                          atol=0, rtol=0)


def test_alibi_slopes_for_12_heads():
    # n = 8: the first 8 are 2^-(h+1); the rest interleave from the 16-head series: 2^-0.5, 2^-1.5, ...
    want = [2.0 ** -(h + 1) for h in range(8)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    got = alibi_slopes(12)
    assert got.dtype == torch.float64
    assert (got - torch.tensor(want, dtype=torch.float64)).abs().max().item() < 1e-15
    assert (got - torch.tensor(spec_slopes(12), dtype=torch.float64)).abs().max().item() < 1e-15


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 8, 12, 32, 40])
def test_alibi_slopes_follow_the_spec_formula(num_heads):
    got = alibi_slopes(num_heads)
    assert got.shape == (num_heads,)
    assert (got - torch.tensor(spec_slopes(num_heads), dtype=torch.float64)).abs().max().item() < 1e-15


@pytest.mark.parametrize("num_qo_heads, num_kv_heads", [(8, 8), (12, 4)])
def test_alibi_bias_is_slope_times_j(num_qo_heads, num_kv_heads):
    q, k, v = make_inputs(7, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, kv_len=21)
    out, lse = check(q, k, v, pos_encoding_mode="ALIBI")
    # Softmax is shift-invariant: slope * (j - (L-1)) gives the same output but not the same LSE.
    kv_len = k.shape[0]
    shifted_out, shifted_lse = naive_decode(q, k, v, pos_encoding_mode="ALIBI", alibi_offset=kv_len - 1)
    assert (out - shifted_out).abs().max().item() < TOL
    slopes = torch.tensor(spec_slopes(num_qo_heads), dtype=torch.float64)
    assert (lse - shifted_lse - slopes * (kv_len - 1) * LOG2E).abs().max().item() < TOL
    assert (lse - shifted_lse).abs().min().item() > 1e-3


@pytest.mark.parametrize("rope_scale, rope_theta", [(None, None), (2.0, None), (None, 5e5), (4.0, 1e6)])
def test_rope_llama_rotates_q_at_last_position_and_k_at_j(rope_scale, rope_theta):
    q, k, v = make_inputs(8, num_qo_heads=8, num_kv_heads=2, kv_len=13, head_dim=32)
    out, lse = check(q, k, v, pos_encoding_mode="ROPE_LLAMA", rope_scale=rope_scale, rope_theta=rope_theta)
    plain, _ = single_decode_reference(q, k, v)
    assert (out - plain).abs().max().item() > 1e-3  # the rotation is not a no-op


def test_rope_defaults_are_scale_1_and_theta_1e4():
    q, k, v = make_inputs(9, kv_len=11)
    default = single_decode_reference(q, k, v, pos_encoding_mode="ROPE_LLAMA")
    explicit = single_decode_reference(q, k, v, pos_encoding_mode="ROPE_LLAMA", rope_scale=1.0, rope_theta=1e4)
    for a, b in zip(default, explicit):
        assert (a - b).abs().max().item() == 0.0


def test_rope_llama_pairs_i_with_i_plus_half():
    d = 8
    x = torch.zeros(1, d, dtype=torch.float64)
    x[0, 1] = 1.0  # e_1 rotates in the plane (1, 1 + d/2) = (1, 5)
    pos, theta, scale = 3, 100.0, 2.0
    y = rope_llama(x, torch.tensor([pos]), scale, theta)
    angle = pos * theta ** (-2.0 * 1 / d) / scale
    want = torch.zeros(1, d, dtype=torch.float64)
    want[0, 1], want[0, 5] = math.cos(angle), math.sin(angle)
    assert (y - want).abs().max().item() < 1e-15
    # And per position, against the literal spec formula.
    g = torch.Generator().manual_seed(10)
    xs = torch.randn(5, 16, generator=g, dtype=torch.float64)
    ys = rope_llama(xs, torch.arange(5), 1.5, 1e4)
    for p in range(5):
        want = torch.tensor(spec_rope(xs[p].tolist(), p, 1.5, 1e4), dtype=torch.float64)
        assert (ys[p] - want).abs().max().item() < 1e-14


def test_rope_leaves_position_zero_unchanged():
    q, k, v = make_inputs(11, kv_len=1)
    # L = 1: q at position 0 and k_0 at position 0 -> no rotation at all.
    rotated = single_decode_reference(q, k, v, pos_encoding_mode="ROPE_LLAMA")
    plain = single_decode_reference(q, k, v)
    for a, b in zip(rotated, plain):
        assert (a - b).abs().max().item() < TOL


def test_q_k_v_scales():
    q, k, v = make_inputs(12, num_qo_heads=8, num_kv_heads=2)
    out, lse = check(q, k, v, q_scale=0.5, k_scale=1.7, v_scale=0.25)
    # q_scale * k_scale is the same as that factor folded into sm_scale; v_scale scales the output.
    same, same_lse = single_decode_reference(q, k, v, sm_scale=0.5 * 1.7 / math.sqrt(q.shape[-1]))
    assert (out - same * 0.25).abs().max().item() < TOL
    assert (lse - same_lse).abs().max().item() < TOL


def test_lse_is_base_2():
    q, k, v = make_inputs(13, num_qo_heads=8, num_kv_heads=2, kv_len=29)
    _, lse = check(q, k, v)
    kd = k.repeat_interleave(4, dim=1)
    logits = torch.einsum("hd,lhd->hl", q, kd) / math.sqrt(q.shape[-1])
    natural = torch.logsumexp(logits, dim=-1)
    assert (lse - natural * math.log2(math.e)).abs().max().item() < TOL
    assert (lse - torch.log2(torch.exp2(logits * LOG2E).sum(-1))).abs().max().item() < TOL


def test_everything_at_once():
    q, k, v = make_inputs(14, num_qo_heads=8, num_kv_heads=2, kv_len=27, head_dim=64, kv_layout="HND")
    check(q, k, v, kv_layout="HND", window_left=9, q_scale=0.8, k_scale=1.25, v_scale=2.0, sm_scale=0.1)
    check(q, k, v, kv_layout="HND", pos_encoding_mode="ROPE_LLAMA", window_left=5, rope_scale=1.5,
          rope_theta=5e5)
    check(q, k, v, kv_layout="HND", pos_encoding_mode="ALIBI", window_left=12, q_scale=0.5, v_scale=3.0)
    check(q, k, v, kv_layout="HND", window_left=12, logits_soft_cap=2.0, sm_scale=0.5)
    # (soft cap together with ALIBI is left out: decode.md does not pin their order)


def test_reduced_precision_inputs_are_upcast_first():
    q, k, v = make_inputs(15, num_qo_heads=8, num_kv_heads=2)
    q16, k16, v16 = q.half(), k.half(), v.half()
    out, lse = single_decode_reference(q16, k16, v16)
    want_out, want_lse = naive_decode(q16.double(), k16.double(), v16.double())
    assert out.dtype == torch.float64
    assert (out - want_out).abs().max().item() < TOL and (lse - want_lse).abs().max().item() < TOL
