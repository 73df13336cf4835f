"""varlen_attn's backward pass on a GPU (skipped without one): gradients of the real kernels'
forward + jitattn/varlen/backward.py against autograd through the float64 reference.

Each test makes float64 leaf copies of the inputs, runs jitattn.reference.varlen_attn_reference
on them and backpropagates the same random grad_out. Key/value rows that must not be read hold
NaN (tests/varlen_utils.make_batch): reading one shows up as NaN in a gradient. Head dims 64/128/256,
fp16/bf16: the cached specializations. The CPU tests (math, wiring, refusals) are in
tests/test_varlen_backward.py.

Tolerances (relative Frobenius error per gradient): fp16 1e-2, bf16 3e-2. The backward computes
in float32 from the kernel's out and lse, so the error is dominated by `out` rounded to the input
dtype (D = rowsum(dO * O)) and the gradients rounded to it: a few units of the dtype's epsilon
(fp16 ~5e-4, bf16 ~4e-3), with headroom for float32 accumulation over 2k-key rows.
"""
import pytest
import torch

import jitattn
import jitattn.varlen.ops  # noqa: F401  (registers torch.ops.jitattn.varlen_attn*)
from jitattn.reference import varlen_attn_reference
from tests.gpu_utils import rel_error
from tests.varlen_utils import DEVICE, Batch, make_batch

pytestmark = pytest.mark.gpu

F16, BF16 = torch.float16, torch.bfloat16
GRAD_TOL = {F16: 1e-2, BF16: 3e-2}
LONG = 16384  # the long-sequence test's length


def leaves(b: Batch, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in (b.query, b.key, b.value)]


def grad_out_for(b: Batch, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(b.query.shape, generator=g, device=DEVICE).to(b.query.dtype)


def run_backward(b: Batch, window, grad_out, *, scale=None, num_splits=None, want_lse=False, grad_lse=None):
    """jitattn.varlen_attn forward + backward -> (out, lse or None, (dq, dk, dv))."""
    q, k, v = leaves(b)
    kw = b.kwargs()
    if scale is not None:
        kw["scale"] = scale
    if num_splits is not None:
        kw["num_splits"] = num_splits
    aux = jitattn.AuxRequest(lse=True) if want_lse else None
    result = jitattn.varlen_attn(q, k, v, *b.args()[3:], window_size=window, return_aux=aux, **kw)
    out, lse = result if want_lse else (result, None)
    assert isinstance(out, torch.Tensor) and out.requires_grad, "varlen_attn lost the autograd graph"
    loss = (out.float() * grad_out.float()).sum()
    if grad_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
    loss.backward()
    return out.detach(), lse, (q.grad, k.grad, v.grad)


def reference_backward(b: Batch, window, grad_out, *, scale=None, grad_lse=None):
    """Float64 autograd through the reference -> (out, lse, (dq, dk, dv))."""
    q, k, v = leaves(b, torch.float64)
    out, lse = varlen_attn_reference(q, k, v, b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k, scale=scale,
                                     window_size=window, enable_gqa=b.enable_gqa, seqused_k=b.seqused_k)
    loss = (out * grad_out.double()).sum()
    if grad_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)


def check_grads(b: Batch, got, ref, what) -> None:
    """Each gradient within the dtype's tolerance, in the input's dtype and shape, without NaN;
    exact zeros on query rows with no visible key and on key/value rows no query sees."""
    _, ref_lse, want = ref
    what = f"{what} [{b.describe()}]"
    tol = GRAD_TOL[b.query.dtype]
    for name, g, w, t in zip(("dq", "dk", "dv"), got, want, (b.query, b.key, b.value)):
        assert g is not None, f"{what}: no {name}"
        assert g.shape == t.shape and g.dtype == t.dtype, f"{what}: {name} {tuple(g.shape)} {g.dtype}"
        assert not torch.isnan(g).any(), f"{what}: NaN in {name} (a row that must not be read was read)"
        assert torch.isfinite(g).all(), f"{what}: inf in {name}"
        err = rel_error(g, w)
        assert err < tol, f"{what}: {name} relative error {err:.2e} >= {tol:.0e}"
    unseen_q = torch.isneginf(ref_lse).T
    assert (got[0][unseen_q] == 0).all(), f"{what}: dq non-zero on a query row with no visible key"
    unseen_k = want[2] == 0
    for name, g in (("dk", got[1]), ("dv", got[2])):
        assert (g[unseen_k] == 0).all(), f"{what}: {name} non-zero on a key row no query sees"


def check_case(b: Batch, window, what, seed=0, **kw) -> None:
    grad_out = grad_out_for(b, seed)
    _, _, got = run_backward(b, window, grad_out, **kw)
    check_grads(b, got, reference_backward(b, window, grad_out, scale=kw.get("scale")), what)


# ---------------------------------------------------------------- windows x head dims x dtypes
WINDOWS = {"causal": (-1, 0), "full": (-1, -1), "sliding": (128, 0), "general": (37, 11)}
LEN_Q = [1, 300, 17, 129, 64]
LEN_K = [40, 300, 17, 400, 64]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_gradients_match_reference(window, dtype, head_dim):
    b = make_batch(LEN_Q, LEN_K, 4, 4, head_dim, dtype, seed=head_dim)
    check_case(b, WINDOWS[window], window)


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_gqa4_gradients_sum_over_the_group(window, dtype):
    b = make_batch(LEN_Q, LEN_K, 8, 2, 128, dtype, seed=5)
    check_case(b, WINDOWS[window], f"gqa4 {window}")


def test_gqa_decode_shaped_batch():
    """max_q * group <= 16 takes the decode tile shape (and splits the keys) in the forward."""
    b = make_batch([1, 2, 1, 1], [700, 33, 1, 2000], 8, 2, 128, F16, seed=6)
    check_case(b, (-1, 0), "decode-shaped")


# ---------------------------------------------------------------- empty sequences and rows
@pytest.mark.parametrize("window", [(-1, 0), (0, 2), (3, 0)])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_zero_length_sequences_and_rows_without_keys(window, dtype):
    # a sequence without keys, one without queries, and Lq > Lk (the first Lq - Lk rows of a
    # causal window see no key)
    b = make_batch([5, 0, 7, 3, 9], [0, 5, 2, 3, 20], 4, 2, 64, dtype, seed=8)
    check_case(b, window, f"empty window={window}")


def test_batch_without_any_visible_key_gives_zero_gradients():
    b = make_batch([3, 4], [0, 0], 4, 4, 64, F16, seed=9)
    _, _, got = run_backward(b, (-1, -1), grad_out_for(b, 0))
    for g in got:
        assert g is not None and (g == 0).all()


# ---------------------------------------------------------------- skewed batch with a 2k sequence
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (256, 0)])
def test_skewed_lengths_with_a_2k_sequence(window, dtype):
    len_q = [1, 2048, 17, 300, 0, 64, 5, 900]
    len_k = [33, 2048, 17, 520, 5, 0, 1, 450]
    b = make_batch(len_q, len_k, 8, 2, 128, dtype, seed=10)
    check_case(b, window, f"skewed window={window}")


# ---------------------------------------------------------------- options
def test_seqused_k_is_supported_with_grad():
    """seqused_k (inference-only in torch) is differentiable here: keys past seqused_k[i] (NaN in
    the batch) get zero gradient."""
    b = make_batch([6, 40, 3], [20, 33, 0], 4, 2, 128, BF16, seed=12, use_seqused=True, slack=[5, 17, 4])
    check_case(b, (-1, 0), "seqused_k")


def test_explicit_scale_and_num_splits():
    b = make_batch([2, 1], [900, 1500], 4, 4, 64, F16, seed=13)
    check_case(b, (-1, -1), "scale=0.05 splits=4", scale=0.05, num_splits=4)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_lse_gradient(dtype):
    """A loss that uses the returned lse gets its gradient too (torch's varlen_attn ignores it)."""
    b = make_batch([7, 130, 2], [7, 200, 0], 4, 2, 64, dtype, seed=14)
    grad_out = grad_out_for(b, 1)
    g = torch.Generator(device=DEVICE).manual_seed(2)
    grad_lse = torch.randn(4, b.query.shape[0], generator=g, device=DEVICE)
    _, lse, got = run_backward(b, (20, 0), grad_out, want_lse=True, grad_lse=grad_lse)
    assert lse.shape == (4, b.query.shape[0]) and lse.dtype == torch.float32
    check_grads(b, got, reference_backward(b, (20, 0), grad_out, grad_lse=grad_lse), "grad through lse")


def test_lse_not_requested_still_returns_out_alone():
    b = make_batch([9, 4], [9, 11], 4, 4, 64, F16, seed=15)
    q, k, v = leaves(b)
    out = jitattn.varlen_attn(q, k, v, *b.args()[3:])
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.requires_grad


def test_long_sequence_memory_stays_bounded():
    """One 16k causal sequence: the backward's extra memory stays far below the (H_q, 16k, 16k)
    float32 logits (8 GiB). Rows and keys that only see / are seen by a 256-row slice are
    compared with the reference on that slice; dV summed over keys equals dO summed over rows
    (every causal row's P sums to one)."""
    n, h_q, h_kv, d = LONG, 8, 2, 128
    b = make_batch([n], [n], h_q, h_kv, d, BF16, seed=16, tail_rows=0)
    grad_out = grad_out_for(b, 3)
    q, k, v = leaves(b)
    out = jitattn.varlen_attn(q, k, v, *b.args()[3:], window_size=(-1, 0), enable_gqa=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out.backward(grad_out)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1.5 * 2**30, f"backward of one 16k sequence used {extra / 2**30:.2f} GiB beyond its inputs"
    tol = GRAD_TOL[BF16]
    m = 256
    # The last m rows see every key; the last m keys are seen only by the last m rows.
    sub = Batch(b.query[-m:], b.key, b.value, b.cu_seq_q.new_tensor([0, m]), b.cu_seq_k, m, n, [m], [n],
                enable_gqa=True)
    _, _, (rq, rk, rv) = reference_backward(sub, (-1, 0), grad_out[-m:])
    for name, g, w in (("dq last rows", q.grad[-m:], rq), ("dk last keys", k.grad[-m:], rk[-m:]),
                       ("dv last keys", v.grad[-m:], rv[-m:])):
        err = rel_error(g, w)
        assert err < tol, f"16k causal: {name} relative error {err:.2e}"
    # The first m rows see only the first m keys.
    first = Batch(b.query[:m], b.key[:m], b.value[:m], b.cu_seq_q.new_tensor([0, m]),
                  b.cu_seq_k.new_tensor([0, m]), m, m, [m], [m], enable_gqa=True)
    _, _, (fq, _, _) = reference_backward(first, (-1, 0), grad_out[:m])
    assert rel_error(q.grad[:m], fq) < tol, "16k causal: dq first rows"
    dv_sum = v.grad.double().sum(0)  # (H_kv, D)
    do_sum = grad_out.double().sum(0).view(h_kv, h_q // h_kv, d).sum(1)
    assert rel_error(dv_sum, do_sum) < tol, "16k causal: sum of dV over keys != sum of dO over rows"


# ---------------------------------------------------------------- the op: opcheck, torch.compile
def test_opcheck_with_requires_grad():
    """opcheck's autograd-registration and AOT-dispatch checks of jitattn::varlen_attn, and the
    backward op itself."""
    b = make_batch([5, 130, 1], [300, 130, 77], 8, 2, 128, BF16, seed=17, fill=0.0)
    q, k, v = leaves(b)
    for window, return_lse in (([-1, 0], True), ([64, 3], False)):
        args = (q, k, v, b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k, None, window, True, None, None, None, return_lse)
        torch.library.opcheck(torch.ops.jitattn.varlen_attn.default, args)
    out, lse = torch.ops.jitattn.varlen_attn(q.detach(), k.detach(), v.detach(), b.cu_seq_q, b.cu_seq_k, b.max_q,
                                             b.max_k, None, [-1, 0], True, None, None, None, True)
    grad_out = grad_out_for(b, 4)
    args = (grad_out, torch.zeros_like(lse), q.detach(), k.detach(), v.detach(), out, lse, b.cu_seq_q, b.cu_seq_k,
            None, None, [-1, 0])
    torch.library.opcheck(torch.ops.jitattn.varlen_attn_backward.default, args)


@pytest.mark.parametrize("want_lse", [False, True])
def test_compile_fullgraph_forward_and_backward(want_lse):
    torch._dynamo.reset()
    b = make_batch([17, 200, 3], [40, 260, 0], 8, 2, 128, BF16, seed=18)
    grad_out = grad_out_for(b, 5)
    cu_q, cu_k, max_q, max_k = b.args()[3:]

    def model(q, k, v):
        result = jitattn.varlen_attn(q * 1.0, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=True,
                                     return_aux=jitattn.AuxRequest(lse=True) if want_lse else None)
        out = result[0] if want_lse else result
        return (out.float() * grad_out.float()).sum()

    q, k, v = leaves(b)
    loss = torch.compile(model, fullgraph=True)(q, k, v)
    loss.backward()
    check_grads(b, (q.grad, k.grad, v.grad), reference_backward(b, (-1, 0), grad_out), "compiled")
    eager = leaves(b)
    model(*eager).backward()
    for g, e in zip((q.grad, k.grad, v.grad), eager):
        assert rel_error(g, e.grad) < 1e-3, "compiled and eager gradients differ"


# ---------------------------------------------------------------- refusals (also tested on the CPU)
def test_paged_with_grad_raises():
    b = make_batch([3, 5], [40, 9], 4, 4, 64, F16, seed=19, paged=True, page_size=16)
    q, k, v = leaves(b)
    with pytest.raises(NotImplementedError, match="^block_table is an inference-only parameter"):
        jitattn.varlen_attn(q, k, v, *b.args()[3:], **b.kwargs())
    with torch.no_grad():
        jitattn.varlen_attn(q, k, v, *b.args()[3:], **b.kwargs())


def test_varlen_attn_out_with_grad_runs_and_records_nothing():
    b = make_batch([3, 5], [40, 9], 4, 4, 64, F16, seed=20)
    q, k, v = leaves(b)
    out = jitattn.varlen_attn_out(torch.empty_like(q), q, k, v, *b.args()[3:])
    assert out.grad_fn is None
    assert torch.equal(out, jitattn.varlen_attn(*b.args())), "under grad or not, the same forward"
