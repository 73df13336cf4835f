"""GPU: the torch.nn.attention.varlen behaviours that need the kernels (the CPU side is
tests/test_varlen_torch_compat.py): paged and packed keys give the same bits, the output takes the
query's layout (eager and compiled), varlen_attn_out runs under grad (eager and compiled)."""
import zlib

import pytest
import torch

import jitattn
from tests.varlen_utils import Batch, check, cu, make_batch, reference

pytestmark = pytest.mark.gpu
BF16, F16 = torch.bfloat16, torch.float16


def paged_copy(b: Batch, page_size: int, slot_pages: int, seed: int) -> Batch:
    """The same sequences with their keys in a page pool: each sequence owns `slot_pages` pages
    (a slot of slot_pages * page_size keys, as a KV cache allocates), in a shuffled pool whose
    unused rows hold NaN; seqused_k the used lengths, max_k the slot size."""
    n, (h_kv, d) = len(b.len_k), b.key.shape[-2:]
    total = n * slot_pages + 2
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    table = perm[: n * slot_pages].view(n, slot_pages).to(torch.int32)
    pool_k = torch.full((total, page_size, h_kv, d), float("nan"), dtype=b.key.dtype, device=b.key.device)
    pool_v = torch.full_like(pool_k, float("nan"))
    starts = b.cu_seq_k.tolist()
    for i, n_keys in enumerate(b.len_k):
        c = torch.arange(n_keys)
        phys, row = table[i].long()[c // page_size].to(b.key.device), (c % page_size).to(b.key.device)
        pool_k[phys, row] = b.key[starts[i]:starts[i] + n_keys]
        pool_v[phys, row] = b.value[starts[i]:starts[i] + n_keys]
    used = torch.tensor(b.len_k, dtype=torch.int32, device=b.key.device)
    return Batch(b.query, pool_k, pool_v, b.cu_seq_q, None, b.max_q, slot_pages * page_size, b.len_q, b.len_k,
                 used, table.to(b.key.device), b.enable_gqa)


PAGED_VS_PACKED = [
    # (name, len_q, len_k, h_q, h_kv, d, dtype, page_size, slot_pages, window)
    ("issue-page256-maxk256-vs-127", [1, 1, 1], [127, 90, 3], 32, 8, 128, BF16, 256, 1, (-1, -1)),
    ("prefill-rows", [5, 37, 1], [127, 64, 100], 32, 8, 128, BF16, 256, 1, (-1, 0)),
    ("long-decode-splits", [1, 1], [3000, 1500], 32, 8, 128, BF16, 256, 16, (-1, -1)),
    ("long-decode-window", [1, 3], [2900, 700], 16, 4, 64, F16, 64, 64, (511, 0)),
    ("d256-decode", [1, 1, 2], [1000, 33, 640], 8, 8, 256, BF16, 16, 80, (-1, -1)),
    ("d64-mha-prefill", [40, 300], [200, 300], 8, 8, 64, F16, 128, 4, (-1, 0)),
]


@pytest.mark.parametrize("case", PAGED_VS_PACKED, ids=[c[0] for c in PAGED_VS_PACKED])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_and_packed_keys_give_the_same_bits(case, num_splits):
    """A sequence's reduction order follows its own length and num_splits, not max_k's slack (a
    paged call's max_k is the slot size) and not how its keys are stored."""
    name, len_q, len_k, h_q, h_kv, d, dtype, page_size, slot_pages, window = case
    packed = make_batch(len_q, len_k, h_q, h_kv, d, dtype, seed=zlib.crc32(name.encode()) % 1000)
    paged = paged_copy(packed, page_size, slot_pages, seed=3)
    assert paged.max_k > packed.max_k, "the case must give the paged call max_k slack"
    aux = jitattn.AuxRequest(lse=True)
    results = []
    for b in (packed, paged):
        results.append(jitattn.varlen_attn(*b.args(), window_size=window, num_splits=num_splits, return_aux=aux,
                                           **b.kwargs()))
    (out_packed, lse_packed), (out_paged, lse_paged) = results
    check(packed, out_packed, lse_packed, reference(packed, window), f"{name} packed")
    differ = (out_packed != out_paged).sum().item()
    assert differ == 0, f"{name}: {differ} output elements differ between paged and packed keys"
    assert torch.equal(lse_packed, lse_paged), f"{name}: lse differs between paged and packed keys"


@pytest.mark.parametrize("compiled", [False, True])
def test_output_takes_the_querys_layout(compiled):
    b = make_batch([5, 300], [400, 300], 16, 4, 128, BF16, seed=5)
    heads_first = b.query.transpose(0, 1).contiguous().transpose(0, 1)  # (H, T, D) memory
    assert not heads_first.is_contiguous()

    def attend(q):
        return jitattn.varlen_attn(q, *b.args()[1:], window_size=(-1, 0), **b.kwargs())

    fn = torch.compile(attend, fullgraph=True) if compiled else attend
    out = fn(heads_first)
    assert out.stride() == heads_first.stride() == torch.empty_like(heads_first).stride()
    check(b, out, None, reference(b, (-1, 0), query=heads_first), "heads-first query", query=heads_first)
    assert torch.equal(out, attend(b.query)), "the layout changed the values"


@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_attn_out_runs_under_grad(compiled):
    b = make_batch([7, 64], [90, 64], 8, 8, 64, F16, seed=6)
    q = b.query.detach().clone().requires_grad_()

    def block(q):
        out = torch.empty_like(q)
        jitattn.varlen_attn_out(out, q, *b.args()[1:], **b.kwargs())
        return out

    fn = torch.compile(block, fullgraph=True) if compiled else block
    out = fn(q)
    assert out.grad_fn is None
    check(b, out, None, reference(b), f"varlen_attn_out under grad (compiled={compiled})")
