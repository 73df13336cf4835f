"""varlen_attn's backward pass on the CPU (runs in CI): the oracle's math
(jitattn/reference_backward.py) against autograd through the float64 reference, the autograd
wiring of jitattn::varlen_attn and jitattn::varlen_attn_backward with stand-ins for the CUDA
forward and backward, and the calls that must refuse grad (paged KV, varlen_attn_out).

The GPU counterpart, with the real kernels, is tests/test_varlen_backward_gpu.py; how the
backward plans its launch is tests/test_varlen_backward_plan.py.
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import jitattn
import jitattn.varlen.ops  # noqa: F401  (registers torch.ops.jitattn.varlen_attn*)
from jitattn import checks as _checks
from jitattn.varlen import api as varlen_api
from jitattn.varlen import backward_launch
from jitattn.varlen import ops as varlen_ops
from jitattn.reference import varlen_attn_reference
from jitattn.reference_backward import CHUNK_ELEMENTS, varlen_attn_backward

F16, BF16, F32, F64, I32 = torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32


def cu(lengths):
    return torch.tensor([0] + [int(x) for x in torch.tensor(lengths, dtype=torch.long).cumsum(0)], dtype=I32)


def rel_error(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make(len_q, len_k, h_q, h_kv, d, *, seed=0, used=None, slack=3, tail=2, dtype=F32):
    """Packed inputs with `tail` rows after each packed tensor; with `used` (seqused_k) each key
    slot is used[i] + slack rows. Rows nobody may read hold NaN."""
    g = torch.Generator().manual_seed(seed)
    slots = list(len_k) if used is None else [u + slack for u in used]
    cu_q, cu_k = cu(len_q), cu(slots)
    t_q, t_k = int(cu_q[-1]) + tail, int(cu_k[-1]) + tail
    q = torch.randn(t_q, h_q, d, generator=g).to(dtype)
    k = torch.randn(t_k, h_kv, d, generator=g).to(dtype)
    v = torch.randn(t_k, h_kv, d, generator=g).to(dtype)
    starts = cu_k.tolist()
    for i in range(len(slots)):
        n = slots[i] if used is None else used[i]
        k[starts[i] + n:starts[i + 1]] = float("nan")
        v[starts[i] + n:starts[i + 1]] = float("nan")
    k[starts[-1]:], v[starts[-1]:] = float("nan"), float("nan")
    seqused = None if used is None else torch.tensor(used, dtype=I32)
    return q, k, v, cu_q, cu_k, seqused


def reference_grads(q, k, v, cu_q, cu_k, seqused, window, *, scale=None, with_lse=False, seed=1, softcap=None):
    """(out, lse, grad_out, grad_lse, (dq, dk, dv)) by autograd through the float64 reference."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attn_reference(*leaves, cu_q, cu_k, 0, 0, scale=scale, window_size=window, seqused_k=seqused,
                                     softcap=softcap)
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=F64)
    loss = (out * grad_out).sum()
    grad_lse = None
    if with_lse:
        grad_lse = torch.randn(lse.shape, generator=g, dtype=F64)
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
    loss.backward()
    return out.detach(), lse.detach(), grad_out, grad_lse, tuple(t.grad for t in leaves)


def check_grads(got, want, tol, what, lse):
    """Relative error of each gradient below tol; exact zeros for query rows with no visible key
    (lse = -inf, which includes rows outside every sequence) and key/value rows no query sees
    (outside every sequence, past seqused_k, outside every window: the reference dv is 0 there)."""
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), f"{what}: NaN in {name}"
        assert rel_error(a, b) < tol, f"{what}: {name} relative error {rel_error(a, b):.2e} >= {tol:.0e}"
    unseen_q = torch.isneginf(lse).T  # (T_q, H_q)
    assert (got[0][unseen_q] == 0).all(), f"{what}: dq is non-zero on a row with no visible key"
    unseen_k = want[2] == 0
    for name, a in (("dk", got[1]), ("dv", got[2])):
        assert (a[unseen_k] == 0).all(), f"{what}: {name} is non-zero on a key no query sees"


# ---------------------------------------------------------------- the math, float32 inputs vs float64
CASES = {
    # name: (len_q, len_k, h_q, h_kv, window, used)
    "full": ([5, 17, 1, 9], [7, 17, 30, 2], 4, 4, (-1, -1), None),
    "causal": ([5, 17, 1, 9], [7, 17, 30, 2], 4, 4, (-1, 0), None),
    "sliding": ([5, 40, 1, 9], [7, 40, 30, 12], 4, 4, (6, 0), None),
    "general": ([5, 40, 1, 9], [7, 33, 30, 12], 4, 4, (5, 3), None),
    "left0-right1": ([6, 9], [6, 4], 2, 2, (0, 1), None),  # (0, 0) would make dq = dk = 0 exactly
    "right-only": ([6, 9], [8, 4], 2, 2, (-1, 2), None),
    "gqa4-causal": ([5, 17, 1, 9], [7, 17, 30, 2], 8, 2, (-1, 0), None),
    "gqa8-general": ([12, 3], [20, 3], 8, 1, (4, 1), None),
    # a zero-length key sequence, a zero-length query sequence, rows with no visible key
    # (causal with fewer keys than queries: the first Lq - Lk rows see nothing)
    "empty": ([4, 0, 7, 3], [0, 5, 2, 3], 4, 2, (-1, 0), None),
    "seqused_k": ([4, 6, 3], None, 4, 2, (-1, 0), [2, 6, 0]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("lse_given", [True, False], ids=["lse", "recomputed-lse"])
def test_backward_math_matches_float64_autograd(name, lse_given):
    len_q, len_k, h_q, h_kv, window, used = CASES[name]
    q, k, v, cu_q, cu_k, seqused = make(len_q, len_k, h_q, h_kv, 16, used=used, seed=len(name))
    out, lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, seqused, window)
    got = varlen_attn_backward(grad_out.float(), None, q, k, v, out.float(), lse.float() if lse_given else None,
                               cu_q, cu_k, seqused, window_size=window)
    check_grads(got, want, 1e-5, f"{name} window={window}", lse)


@pytest.mark.parametrize("name", ["full", "causal", "general", "gqa8-general", "empty", "seqused_k"])
def test_soft_cap_backward_matches_float64_autograd(name):
    """Logits softcap * tanh(scale * s / softcap): dS takes the slope 1 - tanh^2; with grad_lse
    too, and at a cap small enough to bite (the uncapped gradients are far away)."""
    len_q, len_k, h_q, h_kv, window, used = CASES[name]
    q, k, v, cu_q, cu_k, seqused = make(len_q, len_k, h_q, h_kv, 16, used=used, seed=13)
    q = q * 3  # logits of a few units: the cap of 1.5 saturates many of them
    out, lse, grad_out, grad_lse, want = reference_grads(q, k, v, cu_q, cu_k, seqused, window, with_lse=True,
                                                         softcap=1.5)
    for lse_given in (lse.float(), None):
        got = varlen_attn_backward(grad_out.float(), grad_lse.float(), q, k, v, out.float(), lse_given, cu_q, cu_k,
                                   seqused, window_size=window, softcap=1.5)
        check_grads(got, want, 1e-5, f"{name} soft cap, lse {'given' if lse_given is not None else 'recomputed'}",
                    lse)
    uncapped = varlen_attn_backward(grad_out.float(), grad_lse.float(), q, k, v, out.float(), lse.float(), cu_q,
                                    cu_k, seqused, window_size=window)
    if name != "empty":
        assert rel_error(uncapped[0], want[0]) > 0.1, "the soft cap must change dq"


@pytest.mark.parametrize("name", ["causal", "general", "gqa8-general", "empty"])
def test_lse_gradient_is_exact(name):
    """d lse_r / d s_rc = P_rc: a loss that uses the lse gets the right gradients (torch's own
    varlen_attn ignores grad_lse)."""
    len_q, len_k, h_q, h_kv, window, used = CASES[name]
    q, k, v, cu_q, cu_k, seqused = make(len_q, len_k, h_q, h_kv, 16, used=used, seed=7)
    out, lse, grad_out, grad_lse, want = reference_grads(q, k, v, cu_q, cu_k, seqused, window, with_lse=True)
    got = varlen_attn_backward(grad_out.float(), grad_lse.float(), q, k, v, out.float(), lse.float(), cu_q, cu_k,
                               seqused, window_size=window)
    check_grads(got, want, 1e-5, f"{name} with grad_lse", lse)


@pytest.mark.parametrize("name", ["general", "gqa4-causal", "empty", "seqused_k"])
def test_float64_math_matches_float64_autograd_to_rounding(name):
    """compute_dtype=float64 on float64 inputs (the GPU tests' oracle for rows too long for
    autograd): the same gradients as autograd through the reference, to float64 rounding."""
    len_q, len_k, h_q, h_kv, window, used = CASES[name]
    q, k, v, cu_q, cu_k, seqused = make(len_q, len_k, h_q, h_kv, 16, used=used, seed=21, dtype=F64)
    out, lse, grad_out, grad_lse, want = reference_grads(q, k, v, cu_q, cu_k, seqused, window, with_lse=True)
    got = varlen_attn_backward(grad_out, grad_lse, q, k, v, out, None, cu_q, cu_k, seqused, window_size=window,
                               compute_dtype=F64)
    for g in got:
        assert g.dtype == F64
    check_grads(got, want, 1e-12, f"{name} float64", lse)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (7, 0), (3, 9)])
@pytest.mark.parametrize("max_rows,chunk_elements", [(1, CHUNK_ELEMENTS), (3, CHUNK_ELEMENTS), (1024, 1), (5, 200)])
def test_chunking_does_not_change_the_result(window, max_rows, chunk_elements):
    """Query-row chunks (and the key range each chunk's window restricts it to) give the result
    of one chunk per sequence."""
    q, k, v, cu_q, cu_k, seqused = make([33, 1, 20], [40, 9, 20], 4, 2, 16, seed=3)
    out, lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, seqused, window, scale=0.3)
    args = (grad_out.float(), None, q, k, v, out.float(), lse.float(), cu_q, cu_k, seqused)
    whole = varlen_attn_backward(*args, scale=0.3, window_size=window)
    chunked = varlen_attn_backward(*args, scale=0.3, window_size=window, max_rows=max_rows,
                                   chunk_elements=chunk_elements)
    check_grads(chunked, want, 1e-5, f"chunked window={window}", lse)
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_gradients_come_back_in_the_input_dtypes_and_layouts(dtype):
    q, k, v, cu_q, cu_k, _ = make([9, 4], [9, 13], 4, 2, 32, dtype=dtype, seed=5)
    q = torch.cat([q, q], dim=1)[:, 2:6]  # a strided view, as a fused qkv projection gives
    out, lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (-1, 0))
    got = varlen_attn_backward(grad_out.to(dtype), None, q, k, v, out.to(dtype), lse.float(), cu_q, cu_k,
                               window_size=(-1, 0))
    for g, t in zip(got, (q, k, v)):
        assert g.dtype == dtype and g.shape == t.shape
    check_grads(got, want, 1e-2 if dtype == F16 else 3e-2, str(dtype), lse)


def test_backward_op_opcheck(standin):
    """opcheck of jitattn::varlen_attn_backward (schema, fake kernel, AOT dispatch), its
    implementation stood in for by the oracle on the CPU; with and without max_q / max_k."""
    q, k, v, cu_q, cu_k, seqused = make([5, 9], None, 4, 2, 16, used=[3, 9], seed=9)
    out, lse, grad_out, grad_lse, _ = reference_grads(q, k, v, cu_q, cu_k, seqused, (4, 1), with_lse=True)
    args = (grad_out.float(), grad_lse.float(), q, k, v, out.float(), lse.float(), cu_q, cu_k, seqused, None, [4, 1])
    torch.library.opcheck(torch.ops.jitattn.varlen_attn_backward.default, args)
    torch.library.opcheck(torch.ops.jitattn.varlen_attn_backward.default, args + (9, 9))
    torch.library.opcheck(torch.ops.jitattn.varlen_attn_backward.default, args + (9, 9, 2.5))


# ---------------------------------------------------------------- autograd wiring, with a stand-in forward
def standin_forward(call):
    """jitattn.varlen.forward.forward's contract (a checked VarlenCall in), computed by the reference (any device)."""
    args, query, out = call, call.query, call.out
    o, lse = varlen_attn_reference(query.detach(), call.key.detach(), call.value.detach(), call.cu_seq_q,
                                   call.cu_seq_k, call.max_q, call.max_k, scale=args.scale,
                                   window_size=(args.window_left, args.window_right), seqused_k=call.seqused_k,
                                   block_table=call.block_table, softcap=args.softcap or None)
    standin_forward.calls.append(jitattn.AuxRequest(lse=True) if args.return_lse else None)
    o = o.to(query.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    if args.return_lse:
        return o, lse.float()
    return o, lse.new_empty((0, query.shape[0]), dtype=F32)


def standin_backward(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k=None, *,
                     scale=None, window_size=(-1, -1), max_q=None, max_k=None, deterministic=None, softcap=None,
                     score_mod=None, mask_mod=None):
    """jitattn.varlen.backward_launch.backward's contract, computed by the oracle (any device); the
    oracle takes no variants, so the calls here have none."""
    assert score_mod is None and mask_mod is None
    standin_backward.calls.append({"max_q": max_q, "max_k": max_k, **({"softcap": softcap} if softcap else {})})
    return varlen_attn_backward(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k,
                                scale=scale, window_size=window_size, softcap=softcap)


@pytest.fixture
def standin(monkeypatch):
    """jitattn.varlen.forward.forward (where the API and the ops call it; warm calls off) and the
    backward launch replaced by the references; the CUDA-device check accepts CPU tensors (the fake
    kernels call it): the ops and their autograd formula run on the CPU."""
    standin_forward.calls = []
    standin_backward.calls = []
    monkeypatch.setattr(varlen_api, "forward", standin_forward)
    monkeypatch.setattr(varlen_api, "warm_key", lambda *args: None)  # no warm launches past the stand-in
    monkeypatch.setattr(varlen_ops, "forward", standin_forward)
    monkeypatch.setattr(backward_launch, "backward", standin_backward)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: next(iter(named.values())).device)
    return standin_forward


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("want_lse", [False, True])
def test_varlen_attn_is_differentiable(standin, want_lse):
    q, k, v, cu_q, cu_k, _ = make([6, 0, 11], [9, 3, 4], 4, 2, 64, dtype=F16, seed=11)
    ref_out, ref_lse, grad_out, grad_lse, want = reference_grads(q, k, v, cu_q, cu_k, None, (-1, 0), with_lse=want_lse)
    lq, lk, lv = leaves(q, k, v)
    aux = jitattn.AuxRequest(lse=True) if want_lse else None
    result = jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 9, window_size=(-1, 0), enable_gqa=True, return_aux=aux)
    assert standin.calls[-1] == jitattn.AuxRequest(lse=True), "the forward must compute lse when grad is needed"
    if want_lse:
        out, lse = result
        assert lse.shape == (4, q.shape[0]) and lse.dtype == F32
        loss = (out.double() * grad_out).sum() + torch.where(torch.isfinite(lse), lse, 0.0).double().mul(grad_lse).sum()
    else:
        assert isinstance(result, torch.Tensor), "without return_aux the result is out alone, grad or not"
        out = result
        loss = (out.double() * grad_out).sum()
    assert out.requires_grad and out.dtype == F16
    loss.backward()
    check_grads((lq.grad, lk.grad, lv.grad), want, 1e-2, f"varlen_attn autograd lse={want_lse}", ref_lse)
    # The backward sizes its grid from the forward's max_q / max_k: no host sync.
    assert standin_backward.calls == [{"max_q": 11, "max_k": 9}]


class OpLog(TorchDispatchMode):
    """Records every op dispatched under it (torch's test_varlen_attention uses the same mode)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_jitattn_ops_and_get_the_same_gradients(standin):
    """Under a Python dispatch mode the public functions go through the custom ops (an op logger,
    FakeTensorMode and torch's own tests see them), and the op's autograd formula gives the
    gradients of the eager path."""
    q, k, v, cu_q, cu_k, _ = make([6, 0, 11], [9, 3, 4], 4, 2, 64, dtype=F16, seed=13)
    _, ref_lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (-1, 0))
    lq, lk, lv = leaves(q, k, v)
    with OpLog() as log:
        out = jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 9, window_size=(-1, 0), enable_gqa=True)
        out.backward(grad_out.to(F16))
        target = torch.full_like(q, float("nan"))
        jitattn.varlen_attn_out(target, q, k, v, cu_q, cu_k, 11, 9, window_size=(-1, 0), enable_gqa=True)
    assert "jitattn.varlen_attn.default" in log.ops
    assert "jitattn.varlen_attn_backward.default" in log.ops
    assert "jitattn.varlen_attn_out.default" in log.ops
    check_grads((lq.grad, lk.grad, lv.grad), want, 1e-2, "varlen_attn autograd through the op", ref_lse)
    torch.testing.assert_close(target, out.detach(), rtol=0, atol=0)


def test_soft_capped_varlen_attn_is_differentiable(standin):
    """softcap reaches the forward and the backward (through the op's autograd formula)."""
    q, k, v, cu_q, cu_k, _ = make([6, 0, 11], [9, 3, 4], 4, 2, 64, dtype=F16, seed=12)
    q = q * 3
    _, ref_lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (-1, 0), softcap=2.0)
    lq, lk, lv = leaves(q, k, v)
    out = jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 9, window_size=(-1, 0), enable_gqa=True, softcap=2.0)
    out.backward(grad_out.to(F16))
    check_grads((lq.grad, lk.grad, lv.grad), want, 1e-2, "soft cap autograd", ref_lse)
    assert standin_backward.calls == [{"max_q": 11, "max_k": 9, "softcap": 2.0}]


def test_no_grad_calls_skip_the_op_and_the_lse(standin):
    q, k, v, cu_q, cu_k, _ = make([6, 11], [9, 4], 4, 4, 64, dtype=F16)
    out = jitattn.varlen_attn(q, k, v, cu_q, cu_k, 11, 9)
    assert standin.calls == [None] and not out.requires_grad
    lq, lk, lv = leaves(q, k, v)
    with torch.no_grad():
        out = jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 9)
    assert standin.calls == [None, None] and not out.requires_grad


def test_only_key_requiring_grad(standin):
    q, k, v, cu_q, cu_k, _ = make([6, 11], [9, 4], 4, 4, 64, dtype=BF16)
    (lk,) = leaves(k)
    _, _, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (3, 2))
    out = jitattn.varlen_attn(q, lk, v, cu_q, cu_k, 11, 9, window_size=(3, 2))
    out.backward(grad_out.to(BF16))
    assert rel_error(lk.grad, want[1]) < 3e-2


def test_op_called_directly_without_lse_recomputes_it(standin):
    q, k, v, cu_q, cu_k, _ = make([6, 11], [9, 14], 4, 2, 64, dtype=F16, seed=4)
    _, ref_lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (5, 0))
    lq, lk, lv = leaves(q, k, v)
    out, lse = torch.ops.jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 14, None, [5, 0], True, None, None, None,
                                             False)
    assert lse.shape[0] == 0
    out.backward(grad_out.to(F16))
    check_grads((lq.grad, lk.grad, lv.grad), want, 1e-2, "op without return_lse", ref_lse)


def test_seqused_k_is_differentiable(standin):
    q, k, v, cu_q, cu_k, seqused = make([6, 11, 2], None, 4, 2, 64, used=[4, 11, 0], dtype=F16, seed=8)
    _, ref_lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, seqused, (-1, 0))
    lq, lk, lv = leaves(q, k, v)
    out = jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 11, window_size=(-1, 0), enable_gqa=True, seqused_k=seqused)
    out.backward(grad_out.to(F16))
    check_grads((lq.grad, lk.grad, lv.grad), want, 1e-2, "seqused_k", ref_lse)


def test_opcheck_with_requires_grad(standin):
    """opcheck's autograd-registration and AOT-dispatch checks, on the CPU through the stand-in."""
    q, k, v, cu_q, cu_k, _ = make([5, 13, 1], [7, 13, 20], 4, 2, 64, dtype=F16, seed=2)
    lq, lk, lv = leaves(q, k, v)
    for window, return_lse in (([-1, 0], True), ([4, 2], False)):
        args = (lq, lk, lv, cu_q, cu_k, 13, 20, None, window, True, None, None, None, return_lse)
        torch.library.opcheck(torch.ops.jitattn.varlen_attn.default, args)
        torch.library.opcheck(torch.ops.jitattn.varlen_attn.default, args + (3.0,))  # softcap


# ---------------------------------------------------------------- calls that refuse grad
def paged_args(requires_grad=True):
    q = torch.randn(10, 4, 64, dtype=F16, requires_grad=requires_grad)
    pool = torch.randn(3, 4, 4, 64, dtype=F16, requires_grad=requires_grad)
    return (q, pool, pool.detach().clone(), cu([3, 7]), None, 7, 7), {
        "seqused_k": torch.tensor([5, 3], dtype=I32), "block_table": torch.tensor([[2, 0], [1, -1]], dtype=I32)}


def test_paged_call_needing_grad_raises_inference_only():
    args, kwargs = paged_args()
    with pytest.raises(NotImplementedError, match=r"^block_table is an inference-only parameter\. .*torch\.no_grad"):
        jitattn.varlen_attn(*args, **kwargs)
    # A RuntimeError, as torch raises; and without grad the same call gets past it (to the CUDA check).
    assert issubclass(NotImplementedError, RuntimeError)
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):
        jitattn.varlen_attn(*args, **kwargs)


def test_paged_op_needing_grad_raises_at_forward(standin):
    """Direct op callers hit the same error, from the autograd formula's setup."""
    args, kwargs = paged_args()
    op_args = args + (None, [-1, -1], True, kwargs["seqused_k"], kwargs["block_table"], None, False)
    with pytest.raises(NotImplementedError, match="inference-only"):
        torch.ops.jitattn.varlen_attn(*op_args)
    with torch.no_grad():
        out, _ = torch.ops.jitattn.varlen_attn(*op_args)
    assert out.shape == args[0].shape


@pytest.mark.parametrize("which", ["query", "key", "value", "out"])
def test_varlen_attn_out_needing_grad_runs_the_forward_undifferentiated(standin, which):
    """As torch's: inputs that require grad are read as constants, nothing is recorded."""
    q, k, v, cu_q, cu_k, _ = make([6, 4], [9, 4], 4, 4, 64, dtype=F16)
    tensors = {"out": torch.full_like(q, float("nan")), "query": q, "key": k, "value": v}
    tensors[which] = tensors[which].clone().requires_grad_()
    out, lse = jitattn.varlen_attn_out(tensors["out"], tensors["query"], tensors["key"], tensors["value"],
                                       cu_q, cu_k, 6, 9, return_aux=jitattn.AuxRequest(lse=True))
    assert out is tensors["out"] and out.grad_fn is None and lse.grad_fn is None and not lse.requires_grad
    want, want_lse = varlen_attn_reference(q, k, v, cu_q, cu_k, 6, 9)
    rows = slice(0, int(cu_q[-1]))
    assert rel_error(out[rows], want[rows]) < 1e-3 and rel_error(lse[:, rows], want_lse[:, rows]) < 1e-5


def test_documented_default_scale():
    """scale=None is 1/sqrt(D) in the backward as in the forward."""
    q, k, v, cu_q, cu_k, _ = make([4], [6], 2, 2, 64, seed=12)
    out, lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (-1, -1), scale=1 / math.sqrt(64))
    got = varlen_attn_backward(grad_out.float(), None, q, k, v, out.float(), lse.float(), cu_q, cu_k)
    check_grads(got, want, 1e-5, "default scale", lse)


def test_the_ops_autograd_carries_variants_and_their_captured_tensors(standin, monkeypatch):
    """jitattn::varlen_attn's formula with a traced mask_mod and its captures (a list of tensors in
    the op's inputs: the backward returns one None per captured tensor), compiled with fullgraph:
    the backward launch receives the forward's variant with its tensors. The mask here hides nothing
    (one document), so the stand-in's unmasked oracle is the right answer."""
    from jitattn.variants import gallery, trace_mask_mod

    seen = []

    def backward_seeing_variants(*args, score_mod=None, mask_mod=None, **kw):
        seen.append((score_mod, mask_mod))
        return standin_backward(*args, **kw)

    monkeypatch.setattr(backward_launch, "backward", backward_seeing_variants)
    q, k, v, cu_q, cu_k, _ = make([6, 11], [9, 14], 4, 2, 64, dtype=F16, seed=21)
    _, ref_lse, grad_out, _, want = reference_grads(q, k, v, cu_q, cu_k, None, (-1, 0))
    doc_id, flags = torch.zeros(2, 14, dtype=torch.int32), torch.zeros(2, dtype=torch.bool)
    mask = trace_mask_mod(lambda b, h, q_idx, kv_idx: (doc_id[b, q_idx] == doc_id[b, kv_idx]) | flags[b])

    def attend(lq, lk, lv):
        return jitattn.varlen_attn(lq, lk, lv, cu_q, cu_k, 11, 14, window_size=(-1, 0), enable_gqa=True,
                                   mask_mod=mask)

    lq, lk, lv = leaves(q, k, v)
    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(lq, lk, lv)
    out.backward(grad_out.to(F16))
    check_grads((lq.grad, lk.grad, lv.grad), want, 1e-2, "mask_mod through the op", ref_lse)
    assert seen and seen[-1][0] is None and seen[-1][1].key_text == mask.key_text
    assert seen[-1][1].tensors[0] is doc_id and seen[-1][1].tensors[1] is flags
