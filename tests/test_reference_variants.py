"""varlen_attn_reference's score_mod / mask_mod (issue 46): FlexAttention's functions evaluated in
float64 with bottom-right aligned positions, against the built-in window and soft cap and against a
naive loop that calls the user's function once per (sequence, head, row, key) with 0-d tensors, as
FlexAttention defines them (CPU)."""
import math
import random

import pytest
import torch

from jitattn import reference
from jitattn.reference import varlen_attn_reference
from jitattn.variants.gallery import (alibi, bias_table, causal, document, prefix_lm,  # the acceptance set
                                     relative_position as relative_bias, sliding_window)

F64 = torch.float64
TOL = 1e-10
GQA = [(4, 4), (4, 2), (4, 1)]
D = 16


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def uneven_batch(seed, h_q, h_kv, len_q=None, len_k=None):
    """A batch with an empty sequence (Lq = Lk = 0), Lk = 0 with queries, Lq != Lk both ways."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    len_q = len_q or [5, 0, 3, rng.randint(1, 9), 2, 7]
    len_k = len_k or [5, 0, 0, rng.randint(1, 9), 6, 3]
    q = torch.randn(sum(len_q), h_q, D, generator=gen, dtype=F64)
    k = torch.randn(sum(len_k), h_kv, D, generator=gen, dtype=F64)
    v = torch.randn(sum(len_k), h_kv, D, generator=gen, dtype=F64)
    return q, k, v, cu(len_q), cu(len_k), max(len_q), max(len_k)


def run(args, **kw):
    q, k, v, cu_q, cu_k, max_q, max_k = args
    return varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True, **kw)


def assert_same(got, want, tol=TOL):
    (out, lse), (out_want, lse_want) = got, want
    assert out.shape == out_want.shape and lse.shape == lse_want.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_want)), "-inf rows differ"
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out - out_want).abs().max().item() < tol
    finite = torch.isfinite(lse_want)
    assert (lse[finite] - lse_want[finite]).abs().max().item() < tol


def naive(args, scale, score_mod=None, mask_mod=None):
    """FlexAttention's definition, one element at a time: the user's functions get 0-d int64
    tensors b, h, q_idx = r + Lk - Lq, kv_idx and a 0-d float64 score."""
    q, k, v, cu_q, cu_k, _, _ = args
    total_q, h_q, d = q.shape
    group = h_q // k.shape[1]
    out = torch.zeros(total_q, h_q, d, dtype=F64)
    lse = torch.full((h_q, total_q), -math.inf, dtype=F64)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    t = torch.tensor
    for i in range(len(cu_q) - 1):
        len_q, len_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        for h in range(h_q):
            for r in range(len_q):
                row = cu_q[i] + r
                xs, vs = [], []
                for c in range(len_k):
                    pos = (t(i), t(h), t(r + len_k - len_q), t(c))
                    if mask_mod is not None and not bool(mask_mod(*pos)):
                        continue
                    x = scale * float(torch.dot(q[row, h], k[cu_k[i] + c, h // group]))
                    if score_mod is not None:
                        x = float(score_mod(t(x, dtype=F64), *pos))
                    if x != -math.inf:
                        xs.append(x)
                        vs.append(v[cu_k[i] + c, h // group])
                if not xs:
                    continue
                m = max(xs)
                row_lse = m + math.log(sum(math.exp(x - m) for x in xs))
                out[row, h] = sum(math.exp(x - row_lse) * vc for x, vc in zip(xs, vs))
                lse[h, row] = row_lse
    return out, lse


@pytest.mark.parametrize("h_q,h_kv", GQA, ids=str)
def test_causal_mask_mod_is_the_bottom_right_causal_window(h_q, h_kv):
    args = uneven_batch(h_kv, h_q, h_kv)
    assert_same(run(args, mask_mod=causal), run(args, window_size=(-1, 0)))


@pytest.mark.parametrize("width", [0, 1, 3])
@pytest.mark.parametrize("h_q,h_kv", GQA, ids=str)
def test_sliding_window_mask_mod_is_the_window(width, h_q, h_kv):
    args = uneven_batch(10 + width, h_q, h_kv)
    assert_same(run(args, mask_mod=sliding_window(width)), run(args, window_size=(width, 0)))


def test_a_mask_mod_and_a_window_both_apply():
    args = uneven_batch(3, 4, 2)
    beyond_two = lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 2  # noqa: E731
    assert_same(run(args, mask_mod=beyond_two, window_size=(-1, 0)), run(args, window_size=(2, 0)))


@pytest.mark.parametrize("h_q,h_kv", GQA, ids=str)
def test_soft_cap_as_score_mod_is_the_softcap_argument(h_q, h_kv):
    args = uneven_batch(20 + h_kv, h_q, h_kv)
    cap = 1.5
    softcap = lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)  # noqa: E731
    assert_same(run(args, score_mod=softcap, scale=0.9), run(args, softcap=cap, scale=0.9))


@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (4, 2)], ids=str)
def test_the_acceptance_set_matches_flex_attentions_elementwise_definition(h_q, h_kv):
    # keys at least as long as queries, so every q_idx is a position (document ids index by it)
    args = uneven_batch(30 + h_kv, h_q, h_kv, len_q=[5, 0, 3, 6, 2, 1], len_k=[5, 0, 4, 9, 6, 3])
    gen = torch.Generator().manual_seed(h_kv)
    slopes = reference.alibi_slopes(h_q)
    table = torch.randn(h_q, 20, generator=gen, dtype=F64)
    doc_id = torch.randint(0, 3, (6, 9), generator=gen).cumsum(-1)
    prefix = torch.tensor([2, 0, 1, 4, 0, 3])
    cases = [dict(score_mod=relative_bias), dict(score_mod=alibi(slopes)), dict(score_mod=bias_table(table, 9)),
             dict(mask_mod=causal), dict(mask_mod=sliding_window(2)), dict(mask_mod=document(doc_id)),
             dict(mask_mod=prefix_lm(prefix)), dict(score_mod=alibi(slopes), mask_mod=document(doc_id))]
    for mods in cases:
        assert_same(run(args, scale=0.7, **mods), naive(args, 0.7, **mods))


def test_b_is_the_sequence_and_h_the_query_head():
    args = uneven_batch(4, 4, 2)
    per_seq = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0], dtype=F64)
    per_head = torch.tensor([0.25, -0.5, 1.0, 0.0], dtype=F64)
    mod = lambda score, b, h, q_idx, kv_idx: score * per_seq[b] + per_head[h] * kv_idx  # noqa: E731
    assert_same(run(args, score_mod=mod, scale=0.5), naive(args, 0.5, score_mod=mod))


def test_q_idx_is_bottom_right_aligned():
    """One query row over 6 keys (a decode step) sees q_idx = 5; Lq 4 over Lk 2 sees -2, -1, 0, 1."""
    seen = []

    def record(b, h, q_idx, kv_idx):
        seen.append(q_idx.flatten().tolist())
        return kv_idx >= 0

    run(uneven_batch(5, 2, 2, len_q=[1, 4], len_k=[6, 2]), mask_mod=record)
    assert seen == [[5], [-2, -1, 0, 1]]


def test_rows_the_mask_hides_everywhere_output_zero_and_lse_minus_inf():
    args = uneven_batch(6, 4, 2)
    nothing = lambda b, h, q_idx, kv_idx: (kv_idx < 0) | (h == 1)  # noqa: E731 (head 1 sees all)
    out, lse = run(args, mask_mod=nothing)
    hidden = [0, 2, 3]
    assert torch.isneginf(lse[hidden]).all() and torch.count_nonzero(out[:, hidden]) == 0
    q, k, v, *rest = args  # query head 1 reads kv head 0 (2 query heads per kv head)
    assert_same((out[:, 1:2], lse[1:2]), run((q[:, 1:2], k[:, :1], v[:, :1], *rest), scale=D ** -0.5))


def test_a_score_of_minus_infinity_hides_the_key_like_the_mask():
    args = uneven_batch(7, 4, 4)
    as_score = lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -math.inf)  # noqa: E731
    assert_same(run(args, score_mod=as_score), run(args, mask_mod=causal))


def test_constant_masks_broadcast():
    args = uneven_batch(8, 4, 2)
    everything = run(args)
    assert_same(run(args, mask_mod=lambda b, h, q_idx, kv_idx: b.new_ones((), dtype=torch.bool)), everything)
    assert_same(run(args, mask_mod=lambda b, h, q_idx, kv_idx: True), everything)
    assert_same(run(args, score_mod=lambda score, b, h, q_idx, kv_idx: score), everything)


def test_a_function_that_does_not_broadcast_runs_under_vmap():
    """bias[h][i] indexes bias's first dim twice on broadcast tensors; under vmap it is what it says."""
    args = uneven_batch(9, 4, 2, len_q=[5, 0, 3, 6, 2, 1], len_k=[5, 0, 4, 9, 6, 3])
    table = torch.randn(4, 20, dtype=F64)
    chained = lambda score, b, h, q_idx, kv_idx: score + table[h][q_idx - kv_idx + 9]  # noqa: E731
    h, q_idx, kv_idx = torch.arange(4).view(4, 1, 1), torch.arange(6).view(1, 6, 1), torch.arange(9).view(1, 1, 9)
    with pytest.raises(IndexError):  # so the reference cannot have used the broadcast call
        chained(torch.zeros(4, 6, 9, dtype=F64), torch.tensor(3), h, q_idx + 3, kv_idx)
    assert_same(run(args, score_mod=chained), run(args, score_mod=bias_table(table, 9)))


def test_evaluate_mod_gives_one_value_per_position():
    positions = (torch.tensor(1), torch.arange(3).view(3, 1, 1), torch.arange(4).view(1, 4, 1),
                 torch.arange(5).view(1, 1, 5))
    table = torch.arange(60).view(3, 4, 5)
    got = reference.evaluate_mod(lambda b, h, q_idx, kv_idx: table[h][q_idx][kv_idx] + b, "mask_mod", positions,
                                 torch.Size([3, 4, 5]))
    assert torch.equal(got, table + 1)


def test_a_mask_mod_returning_numbers_is_refused():
    with pytest.raises(TypeError, match="mask_mod must return a bool"):
        run(uneven_batch(1, 2, 2), mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx)


def test_gradients_flow_through_score_mod_and_masked_rows_give_no_nan():
    q, k, v, cu_q, cu_k, max_q, max_k = uneven_batch(11, 4, 2)
    slopes = reference.alibi_slopes(4).requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attn_reference(*leaves, cu_q, cu_k, max_q, max_k, enable_gqa=True,
                                     score_mod=alibi(slopes), mask_mod=sliding_window(1))
    weight_o, weight_l = torch.randn_like(out), torch.randn_like(lse)
    finite = torch.isfinite(lse)
    (out * weight_o).sum().backward(inputs=leaves + [slopes], retain_graph=True)
    (lse[finite] * weight_l[finite]).sum().backward(inputs=leaves + [slopes])
    for t in leaves + [slopes]:
        assert t.grad is not None and not t.grad.isnan().any()
    assert slopes.grad.abs().sum() > 0
    assert (~finite).any(), "the batch was meant to have rows the mask hides"


def test_gradients_match_autograd_through_the_equivalent_window():
    args = uneven_batch(12, 4, 2)
    grads = []
    for kw in (dict(mask_mod=causal), dict(window_size=(-1, 0))):
        leaves = [t.clone().requires_grad_() for t in args[:3]]
        out, lse = varlen_attn_reference(*leaves, *args[3:], enable_gqa=True, **kw)
        torch.manual_seed(0)
        (out * torch.randn_like(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        assert (got - want).abs().max() < TOL


def test_gradcheck_through_a_score_mod():
    args = uneven_batch(13, 2, 1, len_q=[3, 2], len_k=[4, 2])
    q, k, v = (t.clone().requires_grad_() for t in args[:3])
    capped_alibi = lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh((s - 0.3 * (q_idx - kv_idx)) / 2.0)  # noqa: E731

    def f(q, k, v):
        return varlen_attn_reference(q, k, v, *args[3:], enable_gqa=True, score_mod=capped_alibi, mask_mod=causal)

    assert torch.autograd.gradcheck(f, (q, k, v))
