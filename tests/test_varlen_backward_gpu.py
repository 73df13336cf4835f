"""varlen_attn's backward on a GPU (skipped without one): the backward kernels
(templates/varlen/backward*.cu*) after the real forward, against float64.

The oracle: autograd through the float64 reference (jitattn.reference.varlen_attn_reference),
or, for batches too large for autograd's float64 logits, the float64 closed-form gradients
(jitattn.reference_backward with compute_dtype=float64, itself checked against float64 autograd
in tests/test_varlen_backward.py). Key/value rows that must not be read hold NaN
(tests/varlen_utils.make_batch), freed allocator blocks are NaN-poisoned before each backward
(an unwritten gradient or workspace row reads NaN), and NaN never passes.

On an sm_90 GPU head_dim 64, 128 and 256 run the Hopper (wgmma) rung by default; the tests marked
with a `rung` parameter, and half the random configurations at those head dims, run the
mma.sync rung too (forced, as JITATTN_WGMMA=0 would). JITATTN_TEST_BACKWARD_PRODUCER=1 / 0
runs the wgmma rung with / without its producer warpgroup; JITATTN_TEST_BACKWARD_PERSISTENT=1 / 0
its D64 / D128 producer kernels persistent (a CTA per SM) / not; JITATTN_TEST_BACKWARD_DQ_KERNEL=0 the
D256 producer kernel with dQ inside (not the dq_kernel variant); JITATTN_TEST_BACKWARD_ROWS80=0 every
full D128 producer call on the persistent 64-row kernel instead of the 80-row tile (spec.TILE80_HEAD_DIMS),
=all every D128 producer call but a soft-capped one on the 80-row tile (spec.TILE80_FEATURES; conftest.py).

Every gradient is compared relatively (Frobenius, ||g - ref|| / ||ref||) and absolutely (max
|g - ref| against the largest gradient entry of the case): with one visible key per row the
true dQ and dK are exactly zero, which only the absolute check can judge. Exact zeros where the
contract says so: dq on rows with no visible key, dk / dv on keys no query sees.

JITATTN_TEST_DEVICE=cpu dry-runs the test logic on the CPU against stand-ins (the references)
for the kernels; the CUDA-only tests (graphs, memory, timing) skip there.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random

import pytest
import torch

import jitattn
import jitattn.varlen.ops  # noqa: F401  (registers torch.ops.jitattn.varlen_attn*)
from jitattn.jit.loader import get_module
from jitattn.reference import varlen_attn_reference
from jitattn.reference_backward import varlen_attn_backward as closed_form_backward
from tests.gpu_utils import poison_allocator, rel_error
from tests.varlen_utils import DEVICE, Batch, make_batch, reference

pytestmark = pytest.mark.gpu

F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64
REL_TOL = {F16: 1e-2, BF16: 3e-2}  # ||g - ref|| / ||ref||
ABS_TOL = {F16: 1e-2, BF16: 4e-2}  # max |g - ref| / (largest |ref| entry of dq, dk, dv)
AUTOGRAD_BUDGET = 1 << 26  # float64 logits (sum Lq * Lk * H_q) above which the closed form is the oracle
HEAD_DIMS = [32, 48, 64, 80, 96, 128, 144, 192, 256]  # cache/gpu-tests.toml builds these
CPU = DEVICE == "cpu"
cuda_only = pytest.mark.skipif(CPU, reason="CUDA-only (dry run on the CPU)")


# ---------------------------------------------------------------- running and the oracle
@pytest.fixture(autouse=True)
def _standins_on_cpu(monkeypatch):
    """Dry run (JITATTN_TEST_DEVICE=cpu): the references stand in for the kernels."""
    if not CPU:
        return
    from jitattn import checks as _checks
    from jitattn.varlen import api as varlen_api
    from jitattn.varlen import backward_launch as varlen_backward_launch
    from jitattn.varlen import ops as varlen_ops

    def forward(call, remember_as=None):  # jitattn.varlen.forward.forward's contract: a checked VarlenCall in
        args = call
        o, lse = varlen_attn_reference(call.query, call.key, call.value, call.cu_seq_q, call.cu_seq_k, call.max_q,
                                       call.max_k, scale=args.scale, window_size=(args.window_left, args.window_right),
                                       seqused_k=call.seqused_k, block_table=call.block_table,
                                       softcap=args.softcap or None)
        if not args.return_lse:
            lse = lse[:0]
        return o.to(call.query.dtype), lse.float()

    def backward(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k=None, *, scale=None,
                 window_size=(-1, -1), max_q=None, max_k=None, deterministic=None, softcap=None, score_mod=None,
                 mask_mod=None):
        if score_mod is not None or mask_mod is not None:
            pytest.skip("the dry run's closed-form backward takes no variant")
        return closed_form_backward(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k,
                                    scale=scale, window_size=window_size, softcap=softcap)

    monkeypatch.setattr(varlen_api, "forward", forward)
    monkeypatch.setattr(varlen_ops, "forward", forward)
    monkeypatch.setattr(varlen_backward_launch, "backward", backward)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: next(iter(named.values())).device)


@pytest.fixture(autouse=True)
def _backward_variant(monkeypatch):
    """The GPU suite's variant knobs, each a public override of the call rule (override_spec):
    JITATTN_TEST_BACKWARD_PRODUCER=1 (0): every wgmma backward with (without) the producer warpgroup;
    JITATTN_TEST_BACKWARD_PERSISTENT=1: the producer kernels at D64 / D128 persistent (a CTA per SM,
    deterministic mode too), 0: a CTA per key tile; JITATTN_TEST_BACKWARD_DQ_KERNEL=0: D256's dQ in
    the main kernel again; JITATTN_TEST_BACKWARD_CONSUMER_REGS=224 (or 240): the producer kernels
    at D128 with that register split (VarlenBackwardSpec.consumer_regs; the default is 240 there);
    (JITATTN_TEST_BACKWARD_ROWS80=0 / all: tests/conftest.py, for every GPU test.)"""
    from jitattn.varlen.plan import override_spec

    with contextlib.ExitStack() as stack:
        producer = os.environ.get("JITATTN_TEST_BACKWARD_PRODUCER")
        if producer is not None:
            stack.enter_context(override_spec("varlen_backward", when={"wgmma": True}, producer=producer == "1"))
        persistent = os.environ.get("JITATTN_TEST_BACKWARD_PERSISTENT")
        if persistent == "1":
            for head_dim in (64, 128):
                stack.enter_context(override_spec("varlen_backward", when={"producer": True, "head_dim": head_dim},
                                                  persistent=True))
        elif persistent is not None:
            stack.enter_context(override_spec("varlen_backward", persistent=False))
        if os.environ.get("JITATTN_TEST_BACKWARD_DQ_KERNEL") == "0":
            stack.enter_context(override_spec("varlen_backward", dq_kernel=False))
        regs = os.environ.get("JITATTN_TEST_BACKWARD_CONSUMER_REGS")
        if regs is not None:
            stack.enter_context(override_spec("varlen_backward", when={"producer": True, "head_dim": 128},
                                              consumer_regs=int(regs)))
        yield


@pytest.fixture(params=["default", "mma"])
def rung(request):
    """Run the test on the default rung (wgmma at head_dim 64/128/256 on sm_90) and on mma.sync."""
    from jitattn.varlen.plan import override_spec

    with override_spec("varlen_backward", wgmma=False) if request.param == "mma" else contextlib.nullcontext():
        yield request.param


def leaves(b: Batch, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in (b.query, b.key, b.value)]


def grad_out_for(b: Batch, seed: int, gain: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(b.query.shape, generator=g, device=DEVICE) * gain).to(b.query.dtype)


def grad_lse_for(b: Batch, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1000)
    return torch.randn(b.query.shape[1], b.query.shape[0], generator=g, device=DEVICE)


def poison_for_backward(b: Batch) -> None:
    """NaN-fill freed blocks the size of dq and of the fp32 workspace (dQ accumulator + 2, and
    the most the binding adds: the deterministic counters and the work counter), so a workspace
    row no kernel writes reads NaN."""
    if CPU:
        return
    t_q, h_q, d = b.query.shape
    h_kv, n = b.key.shape[1], b.cu_seq_q.numel() - 1
    counters = h_kv * (t_q * (h_q // h_kv) // 64 + n + 1)  # the binding's sem_stride at block_m 64 (the most)
    poison_allocator(max(1, t_q * h_q * d * b.query.element_size()), count=4)
    poison_allocator(max(1, t_q * h_q * (d + 2) * 4 + (counters + 1) * 4), count=4)


def run_backward(b: Batch, window, grad_out, *, scale=None, grad_lse=None, num_splits=None, softcap=None):
    """jitattn.varlen_attn forward + backward -> (dq, dk, dv)."""
    q, k, v = leaves(b)
    kw = b.kwargs()
    if scale is not None:
        kw["scale"] = scale
    if softcap is not None:
        kw["softcap"] = softcap
    if num_splits is not None:
        kw["num_splits"] = num_splits
    aux = jitattn.AuxRequest(lse=True) if grad_lse is not None else None
    result = jitattn.varlen_attn(q, k, v, *b.args()[3:], window_size=window, return_aux=aux, **kw)
    out, lse = result if grad_lse is not None else (result, None)
    assert isinstance(out, torch.Tensor) and out.requires_grad, "varlen_attn lost the autograd graph"
    loss = (out.float() * grad_out.float()).sum()
    if grad_lse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse).sum()
    poison_for_backward(b)
    loss.backward()
    return q.grad, k.grad, v.grad


def oracle(b: Batch, window, grad_out, *, scale=None, grad_lse=None, softcap=None):
    """Float64 (lse, (dq, dk, dv)): autograd through the reference when its logits fit
    AUTOGRAD_BUDGET, else the closed form on float64 inputs."""
    work = sum(lq * lk for lq, lk in zip(b.len_q, b.len_k)) * b.query.shape[1]
    if work <= AUTOGRAD_BUDGET:
        q, k, v = leaves(b, F64)
        out, lse = varlen_attn_reference(q, k, v, b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k, scale=scale,
                                         window_size=window, enable_gqa=b.enable_gqa, seqused_k=b.seqused_k,
                                         softcap=softcap)
        loss = (out * grad_out.double()).sum()
        if grad_lse is not None:
            loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(grad_lse.double()).sum()
        if loss.requires_grad:  # not when no query sees any key
            loss.backward()
        return lse.detach(), tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (q, k, v))
    out, lse = reference(b, window, scale=scale, softcap=softcap)  # float64, a few heads at a time
    q, k, v = (t.double() for t in (b.query, b.key, b.value))
    grads = closed_form_backward(grad_out.double(), None if grad_lse is None else grad_lse.double(), q, k, v, out,
                                 lse, b.cu_seq_q, b.cu_seq_k, b.seqused_k, scale=scale, window_size=window,
                                 softcap=softcap, compute_dtype=F64)
    return lse, grads


def check_grads(b: Batch, got, ref, what) -> dict:
    """Each gradient in its input's shape and dtype, finite, within REL_TOL relatively and
    ABS_TOL absolutely; exact zeros on query rows with no visible key and on keys no query
    sees. Returns the errors (for messages)."""
    ref_lse, want = ref
    what = f"{what} [{b.describe()}]"
    dtype = b.query.dtype
    scale = max(w.abs().max().item() if w.numel() else 0.0 for w in want)
    errors = {}
    for name, g, w, t in zip(("dq", "dk", "dv"), got, want, (b.query, b.key, b.value)):
        assert g is not None, f"{what}: no {name}"
        assert g.shape == t.shape and g.dtype == t.dtype, f"{what}: {name} {tuple(g.shape)} {g.dtype}"
        assert not torch.isnan(g).any(), f"{what}: NaN in {name} (an unwritten row, or a row that must not be read)"
        assert torch.isfinite(g).all(), f"{what}: inf in {name}"
        if not g.numel():
            continue
        max_abs = (g.double() - w).abs().max().item()
        assert max_abs <= ABS_TOL[dtype] * max(scale, 1e-6), \
            f"{what}: {name} max abs error {max_abs:.3e} > {ABS_TOL[dtype]:.0e} x largest gradient {scale:.3e}"
        ref_norm = w.norm().item()
        if ref_norm > 1e-6 * max(scale, 1e-30) * math.sqrt(w.numel()):  # not a gradient that is exactly zero
            err = rel_error(g, w)
            assert err < REL_TOL[dtype], f"{what}: {name} relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"
            errors[name] = err
    unseen_q = torch.isneginf(ref_lse).T
    assert (got[0][unseen_q] == 0).all(), f"{what}: dq non-zero on a query row with no visible key"
    unseen_k = (want[1] == 0).all(-1) & (want[2] == 0).all(-1)  # (T_k, H_kv): whole rows, not coincidences
    for name, g in (("dk", got[1]), ("dv", got[2])):
        assert (g[unseen_k] == 0).all(), f"{what}: {name} non-zero on a key row no query sees"
    return errors


def check_case(b: Batch, window, what, seed=0, scale=None, with_lse=False, softcap=None, **kw) -> dict:
    grad_out = grad_out_for(b, seed)
    grad_lse = grad_lse_for(b, seed) if with_lse else None
    got = run_backward(b, window, grad_out, scale=scale, grad_lse=grad_lse, softcap=softcap, **kw)
    return check_grads(b, got, oracle(b, window, grad_out, scale=scale, grad_lse=grad_lse, softcap=softcap), what)


# ---------------------------------------------------------------- >= 200 seeded random configurations
WINDOW_KINDS = ("full", "causal", "sliding", "general", "right-only", "left-only", "one-key")


def random_config(seed: int):
    """A random batch: GQA 1/2/4/8, every window kind, seqused_k, empty sequences, lengths 1..16k
    (one config in 12 has a long sequence), lse gradient on or off, head_dim 32..256, a scale."""
    rng = random.Random(seed)
    dtype = rng.choice([F16, BF16])
    head_dim = HEAD_DIMS[seed % len(HEAD_DIMS)]
    group = [1, 2, 4, 8][(seed // len(HEAD_DIMS)) % 4]
    h_kv = rng.choice([1, 2]) if group < 8 else 1
    kind = WINDOW_KINDS[seed % len(WINDOW_KINDS)]
    n = rng.randint(1, 5)
    short = 300 if CPU else 1100

    def length():
        return rng.choice([0, 1, rng.randint(1, 64), rng.randint(1, short), rng.randint(1, short)])

    len_q = [length() for _ in range(n)]
    len_k = [rng.choice([lq, length()]) for lq in len_q]
    if seed % 12 == 5 and not CPU:  # a long sequence, few heads
        len_q[0] = len_k[0] = rng.choice([2048, 4099, 8192, 16384])
        group, h_kv = rng.choice([1, 2]), 1
    if kind == "one-key":
        len_k = list(len_q)  # with (0, 0) each row sees exactly its own key
    if sum(len_q) == 0:
        len_q[0] = 1
    window = {"full": (-1, -1), "causal": (-1, 0), "sliding": (rng.randint(0, 300), 0),
              "general": (rng.randint(0, 200), rng.randint(0, 200)), "right-only": (-1, rng.randint(0, 40)),
              "left-only": (rng.randint(0, 40), -1), "one-key": (0, 0)}[kind]
    use_seqused = rng.random() < 0.25
    slack = [rng.randint(0, 17) for _ in range(n)] if use_seqused else None
    b = make_batch(len_q, len_k, h_kv * group, h_kv, head_dim, dtype, seed=seed, use_seqused=use_seqused, slack=slack)
    scale = rng.choice([None, None, None, 0.05 + 0.25 * rng.random()])
    return b, window, kind, scale, rng.random() < 0.3


@pytest.mark.parametrize("seed", range(240))
def test_random_configuration_matches_float64(seed):
    from jitattn.varlen.plan import override_spec

    b, window, kind, scale, with_lse = random_config(seed)
    mma = (seed // len(HEAD_DIMS)) % 2  # half of each head_dim's configs on the mma.sync rung
    with override_spec("varlen_backward", wgmma=False) if mma else contextlib.nullcontext():
        errors = check_case(b, window, f"seed {seed} {kind} window={window} scale={scale} lse={with_lse}", seed=seed,
                            scale=scale, with_lse=with_lse)
    if kind == "one-key" and not with_lse:
        assert set(errors) <= {"dv"}, f"with one visible key dq and dk are exactly zero, yet compared relatively: {errors}"


def test_random_configurations_cover_the_space():
    """The sweep above really spans what it claims (a property of the generator)."""
    configs = [random_config(seed) for seed in range(240)]
    assert {b.query.shape[-1] for b, *_ in configs} == set(HEAD_DIMS)
    assert {b.query.shape[1] // b.key.shape[1] for b, *_ in configs} == {1, 2, 4, 8}
    assert {kind for _, _, kind, _, _ in configs} == set(WINDOW_KINDS)
    assert any(b.seqused_k is not None for b, *_ in configs)
    assert any(0 in b.len_q or 0 in b.len_k for b, *_ in configs)
    assert any(lse for *_, lse in configs) and not all(lse for *_, lse in configs)
    assert {b.query.dtype for b, *_ in configs} == {F16, BF16}
    if not CPU:
        assert max(max(b.len_k) for b, *_ in configs) == 16384 and min(min(b.len_q) for b, *_ in configs) <= 1


# ---------------------------------------------------------------- named cases
WINDOWS = {"causal": (-1, 0), "full": (-1, -1), "sliding": (128, 0), "general": (37, 11)}
LEN_Q = [1, 300, 17, 129, 64]
LEN_K = [40, 300, 17, 400, 64]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_gradients_match_reference(window, dtype, head_dim, rung):
    b = make_batch(LEN_Q, LEN_K, 4, 4, head_dim, dtype, seed=head_dim)
    check_case(b, WINDOWS[window], window)


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("group", [2, 4, 8])
def test_gqa_gradients_sum_over_the_group(window, group, rung):
    b = make_batch(LEN_Q, LEN_K, 2 * group, 2, 128, BF16, seed=5 + group)
    check_case(b, WINDOWS[window], f"gqa{group} {window}")


SOFT_CAP = 1.5  # logits of these inputs are ~N(0, 1) (scale 1/sqrt(D)): the cap bends most of them


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("window", ["causal", "general", "full"])
def test_soft_cap_gradients_match_reference(window, dtype, head_dim, rung):
    """Logits cap * tanh(scale * s / cap) (Gemma-2): GQA 4, with an lse gradient; the uncapped
    oracle is far from what the kernels compute (the cap is not dropped)."""
    b = make_batch(LEN_Q, LEN_K, 8, 2, head_dim, dtype, seed=40 + head_dim)
    grad_out, grad_lse = grad_out_for(b, 4), grad_lse_for(b, 4)
    got = run_backward(b, WINDOWS[window], grad_out, grad_lse=grad_lse, softcap=SOFT_CAP)
    check_grads(b, got, oracle(b, WINDOWS[window], grad_out, grad_lse=grad_lse, softcap=SOFT_CAP), f"softcap {window}")
    _, uncapped = oracle(b, WINDOWS[window], grad_out, grad_lse=grad_lse)
    assert rel_error(got[0], uncapped[0]) > 10 * REL_TOL[dtype], "soft cap: dq is the uncapped one"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_poly_tanh_soft_cap_gradients_match_reference(head_dim):
    """The forward and the backward with poly_tanh (VarlenSpec / VarlenBackwardSpec: the same
    tanh per logit, so the backward's P matches the forward's lse): cap 1.5 puts these logits on
    both sides of the cubic's reach."""
    from jitattn.varlen.plan import override_spec

    b = make_batch(LEN_Q, LEN_K, 8, 2, head_dim, BF16, seed=60 + head_dim)
    grad_out, grad_lse = grad_out_for(b, 6), grad_lse_for(b, 6)
    with override_spec("varlen", poly_tanh=True), override_spec("varlen_backward", poly_tanh=True):
        got = run_backward(b, WINDOWS["causal"], grad_out, grad_lse=grad_lse, softcap=SOFT_CAP)
    check_grads(b, got, oracle(b, WINDOWS["causal"], grad_out, grad_lse=grad_lse, softcap=SOFT_CAP),
                "poly_tanh softcap")


def test_one_visible_key_gives_zero_dq_and_dk_and_dv_equal_to_do(rung):
    """Window (0, 0) with Lq = Lk: row r sees key r alone, P = 1, so dS = 0 exactly in exact
    arithmetic: dq = dk = 0 and dv = dO. Only an absolute comparison can judge dq and dk."""
    b = make_batch([300, 64, 1], [300, 64, 1], 4, 2, 128, BF16, seed=30)
    grad_out = grad_out_for(b, 3)
    dq, dk, dv = run_backward(b, (0, 0), grad_out)
    largest = grad_out.abs().max().item()
    assert dq.abs().max().item() <= ABS_TOL[BF16] * largest and dk.abs().max().item() <= ABS_TOL[BF16] * largest
    want_dv = grad_out.double().view(-1, 2, 2, 128).sum(2)  # the two query heads of each KV head
    assert rel_error(dv[:want_dv.shape[0]], want_dv) < REL_TOL[BF16]


def test_gqa_decode_shaped_batch():
    """max_q * group <= 16 takes the decode tile shape (and splits the keys) in the forward."""
    b = make_batch([1, 2, 1, 1], [700, 33, 1, 2000], 8, 2, 128, F16, seed=6)
    check_case(b, (-1, 0), "decode-shaped")


@pytest.mark.parametrize("window", [(-1, 0), (0, 2), (3, 0)])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_zero_length_sequences_and_rows_without_keys(window, dtype, rung):
    # a sequence without keys, one without queries, and Lq > Lk (the first Lq - Lk rows of a
    # causal window see no key)
    b = make_batch([5, 0, 7, 3, 9], [0, 5, 2, 3, 20], 4, 2, 64, dtype, seed=8)
    check_case(b, window, f"empty window={window}")


def test_batch_without_any_visible_key_gives_zero_gradients():
    b = make_batch([3, 4], [0, 0], 4, 4, 64, F16, seed=9)
    got = run_backward(b, (-1, -1), grad_out_for(b, 0))
    for g in got:
        assert g is not None and not torch.isnan(g).any() and (g == 0).all()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (256, 0)])
def test_skewed_lengths_with_a_2k_sequence(window, dtype, rung):
    len_q = [1, 2048, 17, 300, 0, 64, 5, 900]
    len_k = [33, 2048, 17, 520, 5, 0, 1, 450]
    b = make_batch(len_q, len_k, 8, 2, 128, dtype, seed=10)
    check_case(b, window, f"skewed window={window}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_query_rows_past_the_last_sequence_are_never_read(head_dim, rung):
    """A static-shape buffer (a CUDA graph's) has rows after cu_seq_q[-1] that belong to no
    sequence; here they hold NaN in q and in the output's gradient. The last sequence's partial
    query tile must not read them: a TMA box would, and NaN x (P = 0) would reach dK / dV."""
    b = make_batch([70, 133], [70, 133], 4, 2, head_dim, BF16, seed=41)
    nan_rows = torch.full((37, *b.query.shape[1:]), float("nan"), device=b.query.device, dtype=b.query.dtype)
    padded = dataclasses.replace(b, query=torch.cat([b.query, nan_rows]))
    grad_out = grad_out_for(b, 0)
    got = run_backward(padded, (-1, 0), torch.cat([grad_out, nan_rows]))
    n = b.query.shape[0]
    check_grads(b, (got[0][:n], got[1], got[2]), oracle(b, (-1, 0), grad_out), "NaN rows after the last sequence")


def test_seqused_k_is_supported_with_grad(rung):
    """seqused_k (inference-only in torch) is differentiable here: keys past seqused_k[i] (NaN in
    the batch) get zero gradient."""
    b = make_batch([6, 40, 3], [20, 33, 0], 4, 2, 128, BF16, seed=12, use_seqused=True, slack=[5, 17, 4])
    check_case(b, (-1, 0), "seqused_k")


def test_explicit_scale_and_num_splits():
    b = make_batch([2, 1], [900, 1500], 4, 4, 64, F16, seed=13)
    check_case(b, (-1, -1), "scale=0.05 splits=4", scale=0.05, num_splits=4)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_lse_gradient(dtype, rung):
    """A loss that uses the returned lse gets its gradient too (torch's varlen_attn ignores it)."""
    b = make_batch([7, 130, 2], [7, 200, 0], 4, 2, 64, dtype, seed=14)
    check_case(b, (20, 0), "grad through lse", seed=1, with_lse=True)


def test_op_called_without_lse_recomputes_it():
    """jitattn::varlen_attn called directly with return_lse=False saves an empty lse: the
    backward runs a forward for it."""
    b = make_batch([6, 110], [9, 140], 4, 2, 64, F16, seed=4)
    grad_out = grad_out_for(b, 2)
    q, k, v = leaves(b)
    out, lse = torch.ops.jitattn.varlen_attn(q, k, v, b.cu_seq_q, b.cu_seq_k, b.max_q, b.max_k, None, [5, 0], True,
                                             None, None, None, False)
    assert lse.shape[0] == 0
    out.backward(grad_out)
    check_grads(b, (q.grad, k.grad, v.grad), oracle(b, (5, 0), grad_out), "op without return_lse")


@pytest.mark.parametrize("head_dim", [64, 256])
def test_strided_inputs_and_gradients(head_dim, rung):
    """q, k, v as views of a fused qkv projection (token stride 3 * H * D): read in place; the
    gradients come back shaped and strided like empty_like of the inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(15)
    lens = [33, 200, 1]
    qkv = torch.randn(sum(lens), 3, 4, head_dim, generator=g, device=DEVICE).to(BF16)
    cu = torch.tensor([0, 33, 233, 234], dtype=torch.int32, device=DEVICE)
    b = Batch(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 200, 200, lens, lens)
    check_case(b, (-1, 0), "qkv views")


def test_long_sequence_memory_stays_bounded():
    """One 16k causal sequence: the backward's extra memory is the O(T H D) workspace (the fp32
    dQ accumulator, lse, delta) and the gradients, far below the (H_q, 16k, 16k) logits."""
    if CPU:
        pytest.skip("CUDA-only: memory statistics")
    n, h_q, h_kv, d = 16384, 8, 2, 128
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
    budget = n * h_q * (d + 2) * 4 + 3 * n * h_q * d * 2 + (64 << 20)  # workspace + dq, dk, dv (+ dO copies)
    assert extra < budget, f"backward of one 16k sequence used {extra / 2**20:.0f} MiB beyond its inputs"
    check_grads(b, (q.grad, k.grad, v.grad), oracle(b, (-1, 0), grad_out), "16k causal")


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("head_dim, group, window", [(64, 1, (-1, 0)), (128, 4, (-1, -1)), (128, 2, (300, 0)),
                                                     (256, 2, (100, 7)), (256, 4, (-1, -1)), (96, 8, (-1, 0)),
                                                     (144, 1, (-1, -1))])
def test_deterministic_mode_is_bitwise_reproducible(head_dim, group, window, rung):
    b = make_batch([1000, 37, 513, 0, 1400], [1000, 60, 513, 4, 1400], 2 * group, 2, head_dim, BF16, seed=head_dim)
    grad_out = grad_out_for(b, 7)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = run_backward(b, window, grad_out)
        second = run_backward(b, window, grad_out)
    finally:
        torch.use_deterministic_algorithms(previous)
    for name, x, y in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(x, y), f"deterministic mode: {name} differs between two runs"
    check_grads(b, first, oracle(b, window, grad_out), "deterministic")
    fast = run_backward(b, window, grad_out)
    for name, x, y in zip(("dq", "dk", "dv"), first, fast):
        assert rel_error(y, x) < 1e-2, f"deterministic and default {name} disagree"
    # dK and dV never take atomics: bitwise the same in both modes.
    assert torch.equal(first[1], fast[1]) and torch.equal(first[2], fast[2])


# ---------------------------------------------------------------- the 80-row tile (spec.TILE80_HEAD_DIMS)
@pytest.fixture
def rows80(monkeypatch):
    """The 80-row tile on (the default; also under JITATTN_TEST_BACKWARD_ROWS80=0) and the backward specs the calls looked up, by name
    (the call memos empty, so each call's kernel is looked up again under the new rule)."""
    from jitattn.kernel import fresh_memos
    from jitattn.varlen import backward_launch
    from jitattn.varlen import spec as spec_module

    monkeypatch.setattr(spec_module, "TILE80_HEAD_DIMS", spec_module.TILE80_FITS)
    built = []
    real = backward_launch.get_module

    def recording(spec):
        built.append(spec.name)
        return real(spec)

    monkeypatch.setattr(backward_launch, "get_module", recording)
    with fresh_memos():
        yield built


@cuda_only
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_full_d128_calls_on_the_80_row_tile_match_float64(rows80, group, dtype):
    """FlashAttention-3's non-causal D128 tile (80 query rows a step, dQ = (K^T dS^T)^T): lengths on
    and off its 80-row steps, an empty sequence, seqused_k, GQA; a causal call keeps 64 rows unless
    spec.TILE80_FEATURES lists windows."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 80-row tile is the sm_90 producer kernel's")
    b = make_batch([80, 1, 79, 0, 81, 160, 333, 1100], [80, 7, 79, 5, 81, 160, 400, 1100], 2 * group, 2, 128, dtype,
                   seed=80 + group, use_seqused=True, slack=[0, 3, 0, 1, 5, 0, 2, 9])
    check_case(b, (-1, -1), f"80-row tile, group {group}", with_lse=True)
    assert rows80 and all(name.endswith("_n128m80q1") for name in rows80), rows80
    rows80.clear()
    check_case(b, (-1, 0), "causal beside the 80-row tile")
    from jitattn.varlen import spec as spec_module

    causal80 = "window" in spec_module.TILE80_FEATURES
    assert rows80 and all(name.endswith("_n128m80q1") == causal80 for name in rows80), rows80


@cuda_only
def test_the_80_row_tile_is_bitwise_reproducible_in_deterministic_mode(rows80):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 80-row tile is the sm_90 producer kernel's")
    b = make_batch([1000, 37, 513, 0, 1400], [1000, 60, 513, 4, 1400], 8, 2, 128, BF16, seed=81)
    grad_out = grad_out_for(b, 9)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = run_backward(b, (-1, -1), grad_out)
        second = run_backward(b, (-1, -1), grad_out)
    finally:
        torch.use_deterministic_algorithms(previous)
    for name, x, y in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(x, y), f"80-row tile, deterministic mode: {name} differs between two runs"
    check_grads(b, first, oracle(b, (-1, -1), grad_out), "80-row tile, deterministic")
    assert all(name.endswith("_n128m80q1") for name in rows80), rows80


# ---------------------------------------------------------------- the op: opcheck, torch.compile, graphs
@cuda_only
def test_opcheck_with_requires_grad():
    """opcheck's autograd-registration and AOT-dispatch checks of jitattn::varlen_attn, and the
    backward op itself, with and without max_q / max_k."""
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
    torch.library.opcheck(torch.ops.jitattn.varlen_attn_backward.default, args + (b.max_q, b.max_k))


@cuda_only
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
    check_grads(b, (q.grad, k.grad, v.grad), oracle(b, (-1, 0), grad_out), "compiled")
    eager = leaves(b)
    model(*eager).backward()
    for g, e in zip((q.grad, k.grad, v.grad), eager):
        assert rel_error(g, e.grad) < 1e-3, "compiled and eager gradients differ"


@cuda_only
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_graph_captures_forward_and_backward_and_replays_new_data(deterministic, rung):
    """A training step's attention (forward + backward) captured once, replayed with new q, k,
    v, dO and new sequence boundaries (same shapes and maxima): no host sync anywhere."""
    h_q, h_kv, d = 8, 2, 128
    lens_a, lens_b = [700, 300, 24], [24, 600, 400]
    total, longest = sum(lens_a), 700
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    static = {"q": torch.randn(total, h_q, d, device="cuda", dtype=BF16),
              "k": torch.randn(total, h_kv, d, device="cuda", dtype=BF16),
              "v": torch.randn(total, h_kv, d, device="cuda", dtype=BF16),
              "do": torch.randn(total, h_q, d, device="cuda", dtype=BF16), "cu": cu(lens_a)}
    leaves_ = [static[n].requires_grad_() for n in ("q", "k", "v")]

    def step():
        for t in leaves_:
            t.grad = None
        out = jitattn.varlen_attn(*leaves_, static["cu"], static["cu"], longest, longest, window_size=(-1, 0),
                                  enable_gqa=True)
        out.backward(static["do"])

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()  # warm-up on a side stream, as torch's CUDA-graph docs ask
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        for t in leaves_:
            t.grad = None
        with torch.cuda.graph(graph):
            out = jitattn.varlen_attn(*leaves_, static["cu"], static["cu"], longest, longest, window_size=(-1, 0),
                                      enable_gqa=True)
            out.backward(static["do"])
        grads = [t.grad for t in leaves_]
        for lens, seed in ((lens_b, 1), (lens_a, 2)):
            g = torch.Generator(device="cuda").manual_seed(seed)
            with torch.no_grad():
                for name in ("q", "k", "v", "do"):
                    static[name].copy_(torch.randn(static[name].shape, generator=g, device="cuda"))
                static["cu"].copy_(cu(lens))
            graph.replay()
            torch.cuda.synchronize()
            b = Batch(static["q"].detach(), static["k"].detach(), static["v"].detach(), static["cu"], static["cu"],
                      longest, longest, lens, lens, enable_gqa=True)
            check_grads(b, [t.clone() for t in grads], oracle(b, (-1, 0), static["do"]), f"graph replay {lens}")
    finally:
        torch.use_deterministic_algorithms(previous)


@cuda_only
def test_hopper_runs_the_wgmma_rung_at_head_dim_64_128_and_256(monkeypatch):
    from jitattn.kernel import fresh_memos
    from jitattn.varlen import backward_launch as launch
    from jitattn.varlen.spec import DQ_KERNEL_HEAD_DIMS, PERSISTENT_HEAD_DIMS, PRODUCER_HEAD_DIMS

    if not launch.wgmma_allowed(torch.device("cuda")):
        pytest.skip("not an sm_90 GPU (or JITATTN_WGMMA=0)")
    planned = []
    monkeypatch.setattr(launch, "get_module", lambda spec: planned.append(spec) or get_module(spec))
    for head_dim in (64, 128, 256):
        b = make_batch([40], [40], 2, 2, head_dim, BF16, seed=head_dim)
        with fresh_memos():  # the call looks its kernel up again: `planned` sees its spec
            run_backward(b, (-1, 0), grad_out_for(b, 0))
        spec = planned[-1]
        assert spec.head_dim == head_dim and not torch.are_deterministic_algorithms_enabled()
        assert spec.wgmma and spec.producer is (head_dim in PRODUCER_HEAD_DIMS)
        assert spec.dq_kernel is (spec.producer and head_dim in DQ_KERNEL_HEAD_DIMS)
        # persistent where its head dim is, but never on the 80-row tile (a causal call takes it
        # where spec.TILE80_FEATURES lists "window": JITATTN_TEST_BACKWARD_ROWS80=all)
        assert spec.persistent is (spec.producer and head_dim in PERSISTENT_HEAD_DIMS and spec.block_m != 80)


# ---------------------------------------------------------------- refusals (also tested on the CPU)
def test_paged_with_grad_raises():
    b = make_batch([3, 5], [40, 9], 4, 4, 64, F16, seed=19, paged=True, page_size=16)
    q, k, v = leaves(b)
    with pytest.raises(NotImplementedError, match="^block_table is an inference-only parameter"):
        jitattn.varlen_attn(q, k, v, *b.args()[3:], **b.kwargs())


def test_varlen_attn_out_with_grad_runs_and_records_nothing():
    b = make_batch([3, 5], [40, 9], 4, 4, 64, F16, seed=20)
    q, k, v = leaves(b)
    out = jitattn.varlen_attn_out(torch.empty_like(q), q, k, v, *b.args()[3:])
    assert out.grad_fn is None
    assert torch.equal(out, jitattn.varlen_attn(*b.args())), "under grad or not, the same forward"


# ---------------------------------------------------------------- training follows SDPA's
class TinyLM(torch.nn.Module):
    """A 2-layer pre-norm transformer on packed sequences; attention through jitattn.varlen_attn
    or SDPA with a block-diagonal causal mask (the same function)."""

    def __init__(self, vocab=64, width=256, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "norm1": torch.nn.LayerNorm(width), "norm2": torch.nn.LayerNorm(width),
                "qkv": torch.nn.Linear(width, (heads + 2 * kv_heads) * self.head_dim),
                "proj": torch.nn.Linear(width, width),
                "mlp": torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))}))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens, cu, longest, attention):
        x = self.embed(tokens)
        for blk in self.blocks:
            qkv = blk["qkv"](blk["norm1"](x)).view(x.shape[0], -1, self.head_dim)
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            x = x + blk["proj"](attention(q, k, v, cu, longest).reshape(x.shape[0], -1))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(x)


def jitattn_attention(q, k, v, cu, longest):
    return jitattn.varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), enable_gqa=True)


def sdpa_attention(q, k, v, cu, longest):
    t = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device), cu.diff().long(), output_size=t)
    pos = torch.arange(t, device=q.device)
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask)
    return out.transpose(0, 1)


def copy_task_batch(gen, device, lengths):
    """Packed sequences whose second half repeats the first: attention can learn it."""
    rows = []
    for n in lengths:
        half = torch.randint(1, 64, (n // 2,), generator=gen, device=device)
        rows.append(torch.cat([half, half, half[: n - 2 * (n // 2)]]))
    tokens = torch.cat(rows)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return tokens, cu


def test_training_loss_follows_sdpa():
    """Same init, same data, 40 Adam steps in bf16 autocast: the loss curves of the jitattn and
    the SDPA model stay within bf16 noise of each other (measured on the H200: within 1e-4
    relative), and both learn (the copy task's loss falls)."""
    steps = 12 if CPU else 40
    torch.manual_seed(0)
    models = {"jitattn": TinyLM().to(DEVICE)}
    models["sdpa"] = TinyLM().to(DEVICE)
    models["sdpa"].load_state_dict(models["jitattn"].state_dict())
    attention = {"jitattn": jitattn_attention, "sdpa": sdpa_attention}
    opts = {name: torch.optim.Adam(m.parameters(), lr=3e-3) for name, m in models.items()}
    losses = {name: [] for name in models}
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for _ in range(steps):
        lengths = [int(x) for x in torch.randint(16, 200, (6,), generator=gen, device=DEVICE).tolist()]
        tokens, cu = copy_task_batch(gen, DEVICE, lengths)
        for name, model in models.items():
            with torch.autocast(DEVICE, dtype=BF16):
                logits = model(tokens[:-1], _trim(cu, tokens.numel() - 1), max(lengths), attention[name])
                loss = torch.nn.functional.cross_entropy(logits.float(), tokens[1:])
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            losses[name].append(loss.item())
    ours, theirs = losses["jitattn"], losses["sdpa"]
    gaps = [abs(a - b) / b for a, b in zip(ours, theirs)]
    assert sum(gaps) / len(gaps) < 0.02 and max(gaps) < 0.06, f"loss curves diverge: jitattn {ours}, SDPA {theirs}"
    if not CPU:
        for curve in (ours, theirs):
            assert sum(curve[-5:]) < 0.97 * sum(curve[:5]), f"no learning: {ours}, {theirs}"


def _trim(cu, total):
    """cu_seq of the inputs tokens[:-1]: the last sequence is one shorter."""
    cu = cu.clone()
    cu[-1] = total
    return cu
