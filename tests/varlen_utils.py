"""Helpers for the varlen GPU tests: batches (packed or paged KV, seqused_k slots), a float64
reference that stays within GPU memory for long sequences, and the check every test makes.

Nothing here imports jitattn.varlen: the tests reach the API through `jitattn.varlen_attn`, so
collection works on machines without a GPU (and before the module exists).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

import jitattn
from jitattn.reference import varlen_attn_reference
from tests.gpu_utils import poison_allocator, rel_error

TOL = {torch.float16: (4e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative, max abs) on out
LSE_TOL = (1e-4, 2e-3)  # (relative, max abs) on the finite lse entries
REF_BUDGET = 1 << 27  # float64 logits per reference call (1 GiB): long sequences go a few heads at a time
NAN = float("nan")
# The tests run on "cuda"; JITATTN_TEST_DEVICE=cpu lets the test logic itself be dry-run on a
# machine without a GPU against a stand-in for jitattn.varlen_attn.
DEVICE = os.environ.get("JITATTN_TEST_DEVICE", "cuda")


def cu(lengths, device=None) -> torch.Tensor:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + int(n))
    return torch.tensor(starts, dtype=torch.int32, device=device or DEVICE)


@dataclass
class Batch:
    """One varlen call's tensors and the lengths they were built from."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor | None
    max_q: int
    max_k: int
    len_q: list[int]
    len_k: list[int]  # keys that take part (seqused_k when given)
    seqused_k: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    enable_gqa: bool = False
    notes: dict = field(default_factory=dict)

    def args(self):
        return (self.query, self.key, self.value, self.cu_seq_q, self.cu_seq_k, self.max_q, self.max_k)

    def kwargs(self) -> dict:
        kw = {"enable_gqa": self.enable_gqa}
        if self.seqused_k is not None:
            kw["seqused_k"] = self.seqused_k
        if self.block_table is not None:
            kw["block_table"] = self.block_table
        return kw

    def describe(self) -> str:
        h_q, d = self.query.shape[1:]
        h_kv = self.key.shape[-2]
        paged = f" paged ps={self.key.shape[1]}" if self.block_table is not None else ""
        used = " seqused_k" if self.seqused_k is not None else ""
        lq, lk = _short(self.len_q), _short(self.len_k)
        return (f"{str(self.query.dtype)[6:]} d{d} {h_q}/{h_kv}{paged}{used} len_q={lq} len_k={lk} "
                f"max_q={self.max_q} max_k={self.max_k}{' ' + str(self.notes) if self.notes else ''}")


def _short(xs, n=12):
    return str(xs) if len(xs) <= n else f"{xs[:n]}+{len(xs) - n} more"


def make_batch(len_q, len_k, h_q, h_kv, head_dim, dtype, seed, *, enable_gqa=None, paged=False, page_size=16,
               slack=None, use_seqused=False, cu_seq_k_paged="none", pad_table=-1, extra_pages=3,
               max_q=None, max_k=None, q_gain=1.0, fill=NAN, tail_rows=3) -> Batch:
    """A batch of len(len_q) sequences on the GPU.

    Unpaged: key/value are packed (T_k, H_kv, D) with cu_seq_k over each sequence's slot; with
    use_seqused the slot of sequence i is len_k[i] + slack[i] keys and seqused_k = len_k. Paged:
    a pool (total_pages, page_size, H_kv, D) with the pages of all sequences a random permutation
    of the pool (plus `extra_pages` never referenced), each sequence's table row holding
    ceil((len_k[i] + slack[i]) / page_size) pages, padded with `pad_table` (-1, or "random" for
    valid but foreign page ids) up to the widest row; seqused_k = len_k. cu_seq_k_paged:
    "none" passes None, "used" the cumulative used lengths. Every key/value row that must not be
    read (slot tails, unused pages, the rows after cu_seq_k[-1]) holds `fill` (NaN by default):
    reading one shows up in the output.
    """
    n = len(len_q)
    assert len(len_k) == n
    len_q, len_k = [int(x) for x in len_q], [int(x) for x in len_k]
    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    if slack is None:
        slack = [0] * n
    elif isinstance(slack, int):
        slack = [slack] * n

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.float32, generator=gen).to(dtype)

    query = (randn(sum(len_q), h_q, head_dim).float() * q_gain).to(dtype)
    seqused_k = block_table = None
    if not paged:
        slots = [lk + (s if use_seqused else 0) for lk, s in zip(len_k, slack)]
        total = sum(slots) + tail_rows
        key, value = randn(total, h_kv, head_dim), randn(total, h_kv, head_dim)
        cu_k = cu(slots)
        starts = cu_k.tolist()
        for i in range(n):
            key[starts[i] + len_k[i]: starts[i + 1]] = fill
            value[starts[i] + len_k[i]: starts[i + 1]] = fill
        key[starts[-1]:] = fill
        value[starts[-1]:] = fill
        if use_seqused:
            seqused_k = torch.tensor(len_k, dtype=torch.int32, device=dev)
    else:
        pages = [-(-(lk + s) // page_size) for lk, s in zip(len_k, slack)]
        width = max(1, max(pages, default=0))
        total_pages = sum(pages) + extra_pages
        perm = torch.randperm(total_pages, generator=cpu_gen).tolist()
        table = torch.full((n, width), -1, dtype=torch.int32)
        if pad_table == "random":
            table = torch.randint(0, max(1, total_pages), (n, width), generator=cpu_gen, dtype=torch.int32)
        at = 0
        for i, p in enumerate(pages):
            table[i, :p] = torch.tensor(perm[at: at + p], dtype=torch.int32)
            at += p
        pool_shape = (max(1, total_pages), page_size, h_kv, head_dim)
        key = torch.full(pool_shape, fill, device=dev, dtype=dtype)
        value = torch.full(pool_shape, fill, device=dev, dtype=dtype)
        block_table = table.to(dev)
        for i, lk in enumerate(len_k):
            if lk == 0:
                continue
            c = torch.arange(lk, device=dev)
            phys = block_table[i].long()[c // page_size]
            key[phys, c % page_size] = randn(lk, h_kv, head_dim)
            value[phys, c % page_size] = randn(lk, h_kv, head_dim)
        seqused_k = torch.tensor(len_k, dtype=torch.int32, device=dev)
        cu_k = cu(len_k) if cu_seq_k_paged == "used" else None
    if enable_gqa is None:
        enable_gqa = h_q != h_kv
    return Batch(query, key, value, cu(len_q), cu_k,
                 max(len_q, default=0) if max_q is None else max_q,
                 max(len_k, default=0) if max_k is None else max_k,
                 len_q, len_k, seqused_k, block_table, enable_gqa)


def reference(b: Batch, window=(-1, -1), scale=None, query=None, softcap=None):
    """varlen_attn_reference (float64, on the GPU) for batch b; long sequences a few query heads
    at a time so the float64 logits stay within REF_BUDGET elements per call."""
    query = b.query if query is None else query
    h_q, h_kv = query.shape[1], b.key.shape[-2]
    group = h_q // h_kv
    common = dict(scale=scale, window_size=window, seqused_k=b.seqused_k, block_table=b.block_table,
                  softcap=softcap)
    widest = max((lq * lk for lq, lk in zip(b.len_q, b.len_k)), default=0)
    if widest * h_q <= REF_BUDGET:
        return varlen_attn_reference(query, b.key, b.value, b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k,
                                     enable_gqa=b.enable_gqa, **common)
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    lse = torch.empty(h_q, query.shape[0], dtype=torch.float64, device=query.device)
    per = max(1, min(group, REF_BUDGET // max(widest, 1)))
    for j in range(h_kv):
        for h0 in range(j * group, (j + 1) * group, per):
            h1 = min(h0 + per, (j + 1) * group)
            o, l = varlen_attn_reference(query[:, h0:h1], b.key[..., j:j + 1, :], b.value[..., j:j + 1, :],
                                         b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k, enable_gqa=True, **common)
            out[:, h0:h1], lse[h0:h1] = o, l
    return out, lse


def poison_for(b: Batch) -> None:
    """NaN-fill freed allocator blocks of out's and lse's sizes: unwritten outputs read NaN."""
    if DEVICE != "cuda":
        return
    t_q, h_q, d = b.query.shape
    poison_allocator(max(1, t_q * h_q * d * b.query.element_size()))
    poison_allocator(max(1, t_q * h_q * 4))


def run(b: Batch, *, window=(-1, -1), scale=None, num_splits=None, want_lse=False, query=None, poison=True,
        softcap=None):
    """jitattn.varlen_attn on batch b -> (out, lse or None)."""
    if poison:
        poison_for(b)
    q = b.query if query is None else query
    kw = b.kwargs()
    if num_splits is not None:
        kw["num_splits"] = num_splits
    if scale is not None:
        kw["scale"] = scale
    if softcap is not None:
        kw["softcap"] = softcap
    result = jitattn.varlen_attn(q, *b.args()[1:], return_aux=jitattn.AuxRequest(lse=True) if want_lse else None,
                                 window_size=window, **kw)
    if want_lse:
        assert isinstance(result, tuple) and len(result) == 2, f"return_aux lse=True must return (out, lse), got {type(result)}"
        return result
    assert isinstance(result, torch.Tensor), f"without return_aux varlen_attn must return a tensor, got {type(result)}"
    return result, None


def close(got, ref, rel_tol, abs_tol, what) -> None:
    """assert_close that also takes empty tensors."""
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (unwritten rows or a NaN read)"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    if got.numel() == 0:
        return
    err = rel_error(got, ref)
    max_abs = (got.double() - ref.double()).abs().max().item()
    assert err < rel_tol, f"{what}: relative error {err:.2e} >= {rel_tol:.0e} (max abs {max_abs:.2e})"
    assert max_abs < abs_tol, f"{what}: max abs error {max_abs:.2e} >= {abs_tol:.0e} (rel {err:.2e})"


def check(b: Batch, out, lse, ref, what, query=None) -> None:
    """out (and lse, when not None) against the reference: tolerances by dtype; rows with no key
    exactly zero; lse float32 (H_q, T_q), -inf exactly where the reference is -inf."""
    q = b.query if query is None else query
    ref_out, ref_lse = ref
    what = f"{what} [{b.describe()}]"
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, \
        f"{what}: out {tuple(out.shape)} {out.dtype} {out.device}, want {tuple(q.shape)} {q.dtype} {q.device}"
    rel, abs_ = TOL[q.dtype]
    close(out, ref_out, rel, abs_, what)
    empty = torch.isneginf(ref_lse)  # (H_q, T_q): rows with no key to attend
    if empty.any():
        rows = out.transpose(0, 1)[empty]  # (rows, D)
        assert (rows == 0).all(), f"{what}: {int((rows != 0).any(-1).sum())} rows with no key are not zero"
    if lse is None:
        return
    assert lse.shape == (q.shape[1], q.shape[0]), f"{what}: lse shape {tuple(lse.shape)}, want (H_q, T_q)"
    assert lse.dtype == torch.float32 and lse.device == q.device, f"{what}: lse {lse.dtype} on {lse.device}"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse ({int(torch.isnan(lse).sum())} entries)"
    got_empty = torch.isneginf(lse)
    if not torch.equal(got_empty, empty):
        wrong = (got_empty != empty).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: lse is -inf at {int(got_empty.sum())} entries, the reference at "
                             f"{int(empty.sum())}; first (head, row) that differ: {wrong}")
    finite = ~empty
    assert torch.isfinite(lse[finite]).all(), f"{what}: +inf in lse"
    if finite.any():
        rel, abs_ = LSE_TOL
        close(lse[finite], ref_lse[finite], rel, abs_ * max(1.0, ref_lse[finite].abs().max().item() / 100),
              what + " lse")


def row_range(b: Batch, i: int) -> slice:
    starts = [0]
    for n in b.len_q:
        starts.append(starts[-1] + n)
    return slice(starts[i], starts[i + 1])


def work(len_q, len_k) -> int:
    return sum(a * b for a, b in zip(len_q, len_k))


def window_visibility(lq: int, lk: int, left: int, right: int) -> torch.Tensor:
    """vis[r, c]: query row r of a sequence of lq queries over lk keys sees key c under the
    window (left, right), bottom-right aligned (shared/spec/varlen.md)."""
    r = torch.arange(lq)[:, None] + (lk - lq)
    c = torch.arange(lk)[None, :]
    vis = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        vis &= c >= r - left
    if right >= 0:
        vis &= c <= r + right
    return vis
