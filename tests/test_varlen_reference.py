"""varlen_attn_reference (jitattn/reference.py) against a naive per-(sequence, head, row) loop
written here straight from shared/spec/varlen.md, on small random batches (CPU, float64)."""
import math
import random

import pytest
import torch

from jitattn.reference import varlen_attn_reference

F64 = torch.float64
TOL = 1e-10
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (1, 0), (3, 0), (2, 1), (0, 2), (-1, 2), (3, -1), (1, 5)]
GQA = [(4, 4), (4, 2), (4, 1)]  # (H_q, H_kv): ratios 1, 2, 4
D = 32


def naive(query, key, value, cu_q, cu_k, scale, window, seqused_k=None, block_table=None):
    """The spec, one (sequence, head, row) at a time, with python scalars for the softmax."""
    total_q, h_q, d = query.shape
    h_kv = key.shape[-2]
    left, right = window
    out = torch.zeros(total_q, h_q, d, dtype=F64)
    lse = torch.full((h_q, total_q), -math.inf, dtype=F64)
    cu_q = cu_q.tolist()
    cu_k = None if cu_k is None else cu_k.tolist()
    for i in range(len(cu_q) - 1):
        len_q = cu_q[i + 1] - cu_q[i]
        len_k = int(seqused_k[i]) if seqused_k is not None else cu_k[i + 1] - cu_k[i]

        def kv_row(c, head):
            if block_table is not None:
                page_size = key.shape[1]
                page = int(block_table[i, c // page_size])
                return key[page, c % page_size, head], value[page, c % page_size, head]
            return key[cu_k[i] + c, head], value[cu_k[i] + c, head]

        for h in range(h_q):
            kvh = h // (h_q // h_kv)
            for r in range(len_q):
                t = cu_q[i] + r
                cols = [c for c in range(len_k)
                        if (left < 0 or c >= r + len_k - len_q - left)
                        and (right < 0 or c <= r + len_k - len_q + right)]
                if not cols:
                    continue
                xs = [scale * float(torch.dot(query[t, h].to(F64), kv_row(c, kvh)[0].to(F64))) for c in cols]
                m = max(xs)
                s = sum(math.exp(x - m) for x in xs)
                row_lse = m + math.log(s)
                acc = torch.zeros(d, dtype=F64)
                for x, c in zip(xs, cols):
                    acc += math.exp(x - row_lse) * kv_row(c, kvh)[1].to(F64)
                out[t, h] = acc
                lse[h, t] = row_lse
    return out, lse


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def skewed_lengths(rng, n, longest):
    """Lengths with zeros, ones and one long sequence."""
    lengths = [rng.choice([0, 1, 2, rng.randint(0, longest)]) for _ in range(n)]
    lengths[rng.randrange(n)] = longest
    return lengths


def batch(seed, h_q, h_kv, n=5, longest=11):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    len_q = skewed_lengths(rng, n, longest)
    len_k = skewed_lengths(rng, n, longest)
    t_q, t_k = sum(len_q), sum(len_k)
    q = torch.randn(t_q, h_q, D, generator=gen, dtype=F64)
    k = torch.randn(t_k, h_kv, D, generator=gen, dtype=F64)
    v = torch.randn(t_k, h_kv, D, generator=gen, dtype=F64)
    return q, k, v, cu(len_q), cu(len_k), max(len_q), max(len_k)


def assert_close(got, want):
    out, lse = got
    out_want, lse_want = want
    assert out.dtype == F64 and lse.dtype == F64
    assert out.shape == out_want.shape and lse.shape == lse_want.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_want)), "-inf rows differ"
    finite = torch.isfinite(lse_want)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out - out_want).abs().max().item() < TOL if out.numel() else True
    if finite.any():
        assert (lse[finite] - lse_want[finite]).abs().max().item() < TOL


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("h_q,h_kv", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_reference_matches_the_naive_formula(window, h_q, h_kv, seed):
    q, k, v, cu_q, cu_k, max_q, max_k = batch(seed * 97 + h_kv, h_q, h_kv)
    scale = 0.3
    got = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window,
                                enable_gqa=h_q != h_kv)
    assert_close(got, naive(q, k, v, cu_q, cu_k, scale, window))


def test_batches_cover_zero_length_query_and_key_sequences_and_empty_rows():
    """The random batches above are only meaningful if they hit the edge cases."""
    zero_q = zero_k = empty_rows = 0
    for seed in (0, 1):
        for _, h_kv in GQA:
            q, k, v, cu_q, cu_k, max_q, max_k = batch(seed * 97 + h_kv, 4, h_kv)
            zero_q += int((cu_q.diff() == 0).sum())
            zero_k += int((cu_k.diff() == 0).sum())
            _, lse = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True)
            empty_rows += int(torch.isneginf(lse).sum())
            assert max(cu_q.diff().tolist()) == max_q == 11
    assert zero_q > 0 and zero_k > 0 and empty_rows > 0


def test_default_scale_is_one_over_sqrt_head_dim():
    q, k, v, cu_q, cu_k, max_q, max_k = batch(5, 4, 2)
    default = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True)
    explicit = naive(q, k, v, cu_q, cu_k, 1 / math.sqrt(D), (-1, -1))
    assert_close(default, explicit)


def test_lse_is_natural_log_and_out_is_the_mean_for_equal_logits():
    lk = 7
    q = torch.zeros(3, 2, D, dtype=F64)  # every logit 0: softmax uniform
    k = torch.randn(lk, 2, D, dtype=F64)
    v = torch.randn(lk, 2, D, dtype=F64)
    out, lse = varlen_attn_reference(q, k, v, cu([3]), cu([lk]), 3, lk)
    # bottom-right alignment does not matter without a window: every row sees all 7 keys
    assert torch.allclose(lse, torch.full((2, 3), math.log(lk), dtype=F64), atol=1e-14, rtol=0)
    assert (out - v.mean(0, keepdim=True)).abs().max() < 1e-14
    # causal, bottom-right aligned: row r of 3 sees keys 0..r+4
    out, lse = varlen_attn_reference(q, k, v, cu([3]), cu([lk]), 3, lk, window_size=(-1, 0))
    for r in range(3):
        assert abs(lse[0, r].item() - math.log(r + 5)) < 1e-14
        assert (out[r] - v[: r + 5].mean(0)).abs().max() < 1e-14


def test_empty_rows_output_zeros_and_minus_inf():
    torch.manual_seed(0)
    len_q, len_k = [2, 0, 4, 3, 1], [3, 4, 0, 1, 2]
    q = torch.randn(sum(len_q) + 2, 2, D, dtype=F64)  # two padding rows past cu_seq_q[-1]
    k = torch.randn(sum(len_k), 2, D, dtype=F64)
    v = torch.randn(sum(len_k), 2, D, dtype=F64)
    out, lse = varlen_attn_reference(q, k, v, cu(len_q), cu(len_k), 4, 4, window_size=(-1, 0))
    assert out.shape == (sum(len_q) + 2, 2, D) and lse.shape == (2, sum(len_q) + 2)
    # sequence 2 (Lk = 0): all 4 rows; sequence 3 (Lq 3 > Lk 1, causal): rows 0, 1; padding rows
    empty = [2, 3, 4, 5, 6, 7, 10, 11]
    full = [t for t in range(sum(len_q) + 2) if t not in empty]
    assert torch.isneginf(lse[:, empty]).all()
    assert torch.isfinite(lse[:, full]).all()
    assert torch.count_nonzero(out[empty]) == 0
    assert (out[full].abs().sum(-1) > 0).all()
    # sequence 3, row 2 sees key 0 only: out = v[key 0], lse = its logit
    t, c = 8, 7  # cu_seq_q[3] = 6, cu_seq_k[3] = 7
    assert (out[t] - v[c]).abs().max() < 1e-14
    logit = (q[t] * k[c]).sum(-1) / math.sqrt(D)
    assert (lse[:, t] - logit).abs().max() < 1e-14


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (1, 3)], ids=str)
@pytest.mark.parametrize("h_q,h_kv", GQA, ids=lambda x: str(x))
def test_seqused_k_smaller_than_the_slot(window, h_q, h_kv):
    rng = random.Random(h_kv)
    gen = torch.Generator().manual_seed(h_kv)
    slots = [9, 4, 12, 0, 6]
    used = [rng.randint(0, s) for s in slots]
    used[2] = 5
    len_q = [3, 1, 7, 2, 0]
    q = torch.randn(sum(len_q), h_q, D, generator=gen, dtype=F64)
    k = torch.randn(sum(slots), h_kv, D, generator=gen, dtype=F64)
    v = torch.randn(sum(slots), h_kv, D, generator=gen, dtype=F64)
    used_t = torch.tensor(used, dtype=torch.int32)
    got = varlen_attn_reference(q, k, v, cu(len_q), cu(slots), 7, 12, window_size=window,
                                enable_gqa=h_q != h_kv, seqused_k=used_t)
    assert_close(got, naive(q, k, v, cu(len_q), cu(slots), 1 / math.sqrt(D), window, seqused_k=used_t))
    # the same as packing only the used keys
    keep = torch.cat([torch.arange(s0, s0 + n) for s0, n in zip(cu(slots)[:-1].tolist(), used)])
    packed = varlen_attn_reference(q, k[keep], v[keep], cu(len_q), cu(used), 7, 12, window_size=window,
                                   enable_gqa=h_q != h_kv)
    assert_close(got, packed)
    # the unused tail of a slot is never read
    k2, v2 = k.clone(), v.clone()
    tail = torch.ones(sum(slots), dtype=torch.bool)
    tail[keep] = False
    k2[tail], v2[tail] = math.nan, math.nan
    assert_close(varlen_attn_reference(q, k2, v2, cu(len_q), cu(slots), 7, 12, window_size=window,
                                       enable_gqa=h_q != h_kv, seqused_k=used_t), got)


def paged_copy(k, v, cu_k, used, page_size, seed, spare_pages=3):
    """A page pool holding the first used[i] keys of each sequence of (k, v), pages in shuffled
    order (plus spare NaN pages), and its block table (padding entries -1)."""
    rng = random.Random(seed)
    pages_per_seq = [-(-n // page_size) for n in used]
    width = max(max(pages_per_seq), 1) + 1
    total = sum(pages_per_seq) + spare_pages
    physical = list(range(total))
    rng.shuffle(physical)
    h_kv, d = k.shape[1:]
    pool_k = torch.full((total, page_size, h_kv, d), math.nan, dtype=k.dtype)
    pool_v = torch.full((total, page_size, h_kv, d), math.nan, dtype=v.dtype)
    table = torch.full((len(used), width), -1, dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(used):
        for p in range(pages_per_seq[i]):
            page = physical[nxt]
            nxt += 1
            table[i, p] = page
            c0, c1 = p * page_size, min(n, (p + 1) * page_size)
            pool_k[page, : c1 - c0] = k[cu_k[i] + c0 : cu_k[i] + c1]
            pool_v[page, : c1 - c0] = v[cu_k[i] + c0 : cu_k[i] + c1]
    return pool_k, pool_v, table


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (2, 1)], ids=str)
@pytest.mark.parametrize("h_q,h_kv", GQA, ids=lambda x: str(x))
def test_paged_matches_the_same_data_unpaged(page_size, window, h_q, h_kv):
    seed = page_size * 10 + h_kv
    q, k, v, cu_q, cu_k, max_q, max_k = batch(seed, h_q, h_kv, n=5, longest=21)
    lens_k = cu_k.diff().tolist()
    rng = random.Random(seed)
    used = [rng.randint(0, n) for n in lens_k]
    used[lens_k.index(max(lens_k))] = max(lens_k)  # one full slot spanning several pages
    used_t = torch.tensor(used, dtype=torch.int32)
    pool_k, pool_v, table = paged_copy(k, v, cu_k.tolist(), used, page_size, seed)
    assert len(set(table[table >= 0].tolist())) == int((table >= 0).sum())
    gqa = h_q != h_kv
    paged = varlen_attn_reference(q, pool_k, pool_v, cu_q, cu_k, max_q, max_k, window_size=window,
                                  enable_gqa=gqa, seqused_k=used_t, block_table=table)
    unpaged = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window,
                                    enable_gqa=gqa, seqused_k=used_t)
    assert_close(paged, unpaged)
    assert_close(paged, naive(q, pool_k, pool_v, cu_q, None, 1 / math.sqrt(D), window,
                              seqused_k=used_t, block_table=table))
    # cu_seq_k is not used with a block table
    assert_close(varlen_attn_reference(q, pool_k, pool_v, cu_q, None, max_q, max_k, window_size=window,
                                       enable_gqa=gqa, seqused_k=used_t, block_table=table), paged)


def test_half_inputs_are_computed_in_compute_dtype():
    q, k, v, cu_q, cu_k, max_q, max_k = batch(3, 4, 2)
    q16, k16, v16 = q.half(), k.half(), v.half()
    out, lse = varlen_attn_reference(q16, k16, v16, cu_q, cu_k, max_q, max_k, enable_gqa=True)
    assert out.dtype == F64 and lse.dtype == F64
    assert_close((out, lse), naive(q16.double(), k16.double(), v16.double(), cu_q, cu_k, 1 / math.sqrt(D), (-1, -1)))
    out32, lse32 = varlen_attn_reference(q16, k16, v16, cu_q, cu_k, max_q, max_k, enable_gqa=True,
                                         compute_dtype=torch.float32)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    assert (out32.double() - out).abs().max() < 1e-5


@pytest.mark.gpu
def test_reference_runs_on_gpu_tensors():
    q, k, v, cu_q, cu_k, max_q, max_k = batch(7, 4, 2, longest=16)
    lens_k = cu_k.diff().tolist()
    used = torch.tensor([n // 2 for n in lens_k], dtype=torch.int32)
    pool_k, pool_v, table = paged_copy(k, v, cu_k.tolist(), used.tolist(), 4, 7)
    for args, kw in [((q, k, v), {}), ((q, pool_k, pool_v), {"seqused_k": used, "block_table": table})]:
        cpu = varlen_attn_reference(*args, cu_q, cu_k, max_q, max_k, window_size=(2, 0), enable_gqa=True, **kw)
        gpu = varlen_attn_reference(*(t.cuda() for t in args), cu_q.cuda(), cu_k.cuda(), max_q, max_k,
                                    window_size=(2, 0), enable_gqa=True,
                                    **{n: t.cuda() for n, t in kw.items()})
        assert gpu[0].is_cuda and gpu[1].is_cuda
        assert_close(tuple(t.cpu() for t in gpu), cpu)
