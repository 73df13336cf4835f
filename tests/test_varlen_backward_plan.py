"""How the varlen backward plans its launch (jitattn/varlen/backward_launch.py), on the CPU: the
specialization, the grid, the arguments and the outputs that reach the kernel. The module is a
stand-in that records the launch and marks what it writes; the kernels run in
tests/test_varlen_backward_gpu.py."""
import math
import types

import pytest
import torch

from jitattn.kernel import fresh_memos
from jitattn.varlen import backward_launch as launch
from jitattn.varlen.plan import override_spec
from jitattn.varlen.spec import VarlenBackwardSpec

F16, BF16, I32 = torch.float16, torch.bfloat16, torch.int32
NAMES = ("dout", "dlse", "q", "k", "v", "out", "lse", "cu_q", "cu_k", "used", "dq", "dk", "dv", "n_blocks", "left",
         "right", "scale", "scale_log2", "softcap", "deterministic", "m_blocks")  # m_blocks: dq_kernel only


@pytest.fixture
def launches(monkeypatch):
    """Every launch as (spec, named args); the stand-in writes 1 into dq, 2 into dk, 3 into dv
    (the real kernels write every row of all three)."""
    recorded = []

    def fake_get_module(spec):
        def run(*args):
            named = dict(zip(NAMES, args))
            recorded.append((spec, named))
            named["dq"].fill_(1)
            named["dk"][:1].fill_(2)
            named["dv"][:1].fill_(3)

        return types.SimpleNamespace(ops=types.SimpleNamespace(run=types.SimpleNamespace(default=run)))

    monkeypatch.setattr(launch, "get_module", fake_get_module)
    monkeypatch.delenv("JITATTN_WGMMA", raising=False)
    monkeypatch.delenv("JITATTN_SPEC_OVERRIDES", raising=False)
    with fresh_memos():
        yield recorded


def on_hopper(monkeypatch, hopper: bool = True):
    """The inputs (CPU tensors) stand for tensors on an sm_90 GPU, or on another."""
    monkeypatch.setattr(launch, "is_hopper", lambda device: hopper)


def inputs(len_q, len_k, h_q=8, h_kv=2, d=128, dtype=BF16, lse=True):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=I32)
    t_q, t_k = sum(len_q), sum(len_k)
    q = torch.randn(t_q, h_q, d).to(dtype)
    k, v = torch.randn(t_k, h_kv, d).to(dtype), torch.randn(t_k, h_kv, d).to(dtype)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse_t = torch.randn(h_q, t_q) if lse else torch.empty(0, t_q)
    return dict(grad_out=dout, grad_lse=None, query=q, key=k, value=v, out=out, lse=lse_t, cu_seq_q=cu(len_q),
                cu_seq_k=cu(len_k), seqused_k=None)


def call(launches, window=(-1, 0), lengths=([100, 300], [100, 500]), shape=None, max_q=300, max_k=500, **kw):
    """launch.backward on fresh inputs -> ((dq, dk, dv), (spec, named run args), inputs)."""
    args = {**inputs(*lengths, **(shape or {})), **kw}
    result = launch.backward(**args, window_size=window, max_q=max_q, max_k=max_k)
    return result, launches[-1] if launches else None, args


@pytest.mark.parametrize("head_dim, tile", [(32, (128, 64, 1)), (64, (128, 64, 1)), (128, (128, 64, 1)),
                                            (144, (64, 64, 2)), (256, (64, 64, 2))])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_spec_is_the_tuned_tile_of_the_head_dim(launches, head_dim, tile, dtype):
    _, (spec, run), _ = call(launches, shape=dict(d=head_dim, dtype=dtype))
    assert spec == VarlenBackwardSpec(head_dim, {F16: "float16", BF16: "bfloat16"}[dtype])
    assert (spec.block_n, spec.block_m, spec.warps_q) == tile and not spec.wgmma


@pytest.mark.parametrize("head_dim, hopper, knob, want", [
    (64, True, None, True), (128, True, None, True), (128, True, "0", False), (256, True, None, True),
    (96, True, None, False), (128, False, None, False)])
def test_hopper_rung_where_it_covers_the_head_dim(launches, monkeypatch, head_dim, hopper, knob, want):
    """On sm_90 head_dim 64 / 128 / 256 run the wgmma rung (JITATTN_WGMMA=0 turns it off, as for the
    forward), at 128 persistent, at 256 with dQ in its own kernel; other head dims and GPUs the
    mma.sync one."""
    on_hopper(monkeypatch, hopper)
    if knob is not None:
        monkeypatch.setenv("JITATTN_WGMMA", knob)
    _, (spec, _), _ = call(launches, shape=dict(d=head_dim))
    assert spec.wgmma is want
    assert spec == VarlenBackwardSpec(head_dim, "bfloat16", wgmma=want, producer=want,
                                      dq_kernel=want and head_dim == 256, persistent=want and head_dim == 128)


def test_deterministic_mode_plans_a_cta_per_key_tile(launches, monkeypatch):
    """The persistent D128 kernel is the default; under torch.use_deterministic_algorithms the plan
    takes the kernel a CTA per key tile (the persistent one run so measured slower), and the two
    are cached apart."""
    on_hopper(monkeypatch)
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            _, (spec, _), _ = call(launches, shape=dict(d=128))
            assert spec.persistent is not deterministic
    finally:
        torch.use_deterministic_algorithms(previous)
    assert len({spec for spec, _ in launches}) == 2


def test_dq_kernel_where_plan_lists_it(launches, monkeypatch):
    """D256 on sm_90 takes the dQ kernel unless an override turns it off; the call then passes
    the dQ grid (query tiles of 128 packed rows) as the op's last argument."""
    on_hopper(monkeypatch)
    for dq_kernel in (False, True):
        with override_spec("varlen_backward", dq_kernel=dq_kernel):
            _, (spec, run), _ = call(launches, shape=dict(d=256))
        assert spec == VarlenBackwardSpec(256, "bfloat16", wgmma=True, producer=True, dq_kernel=dq_kernel)
        # max_q 300 x 4 query heads per KV head (8 / 2) = 1200 packed rows: 10 tiles of 128
        assert run.get("m_blocks") == (10 if dq_kernel else None)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_producer_warpgroup_at_the_head_dims_that_take_it(launches, monkeypatch, head_dim):
    on_hopper(monkeypatch)
    _, (spec, _), _ = call(launches, shape=dict(d=head_dim))
    assert spec == VarlenBackwardSpec(head_dim, "bfloat16", wgmma=True, producer=True, persistent=head_dim == 128)
    with override_spec("varlen_backward", producer=False):  # the lockstep kernel: no persistent variant either
        _, (spec, _), _ = call(launches, shape=dict(d=head_dim))
    assert spec == VarlenBackwardSpec(head_dim, "bfloat16", wgmma=True)
    on_hopper(monkeypatch, False)  # mma.sync has no producer
    assert not call(launches, shape=dict(d=head_dim))[1][0].producer


def test_wgmma_allowed_reads_the_device_and_the_knob(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.delenv("JITATTN_WGMMA", raising=False)
    with fresh_memos():
        assert launch.wgmma_allowed(torch.device("cuda", 0))
        monkeypatch.setenv("JITATTN_WGMMA", "0")
        assert not launch.wgmma_allowed(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.delenv("JITATTN_WGMMA")
    with fresh_memos():
        assert not launch.wgmma_allowed(torch.device("cuda", 0))
    assert not launch.wgmma_allowed(torch.device("cpu"))


def test_grid_comes_from_max_k_not_from_the_data(launches):
    """No host sync: the key tiles per (sequence, KV head) are ceil(max_k / block_n); without
    max_k (a direct op call) T_k bounds it."""
    _, (spec, run), _ = call(launches, max_q=300, max_k=500)
    assert run["n_blocks"] == math.ceil(500 / spec.block_n)
    args = inputs([100, 300], [100, 500])
    launch.backward(**args, window_size=(-1, 0))
    assert launches[-1][1]["n_blocks"] == math.ceil(600 / spec.block_n)


def test_scale_window_and_flags_reach_the_kernel(launches):
    _, (_, run), _ = call(launches, window=(2**40, 7), scale=0.25)
    assert (run["left"], run["right"]) == (launch.WINDOW_CLAMP, 7)  # wider than any sequence: clamped
    assert run["scale"] == 0.25 and run["scale_log2"] == pytest.approx(0.25 * math.log2(math.e))
    _, (_, run), _ = call(launches, window=(-1, -1))
    assert (run["left"], run["right"]) == (-1, -1) and run["scale"] == pytest.approx(1 / math.sqrt(128))
    assert run["deterministic"] is False and run["softcap"] == 0.0


def test_a_soft_cap_takes_the_capped_backward_and_reaches_it(launches):
    _, (spec, run), _ = call(launches, softcap=50)
    assert spec.soft_cap is True and run["softcap"] == 50.0
    _, (spec, run), _ = call(launches, softcap=None)
    assert spec.soft_cap is False and run["softcap"] == 0.0


def test_deterministic_mode_follows_torch(launches):
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        _, (_, run), _ = call(launches)
        assert run["deterministic"] is True
    finally:
        torch.use_deterministic_algorithms(previous)
    _, (_, run), _ = call(launches)
    assert run["deterministic"] is False


def test_outputs_are_fresh_tensors_shaped_like_the_inputs_and_the_kernels_write_them(launches, monkeypatch):
    """dq / dk / dv come from torch.empty_like (the kernels write every row: the preprocess zeroes
    the key rows no CTA reaches, which tests/test_varlen_backward_schedule.py checks), so no zero
    fill runs before the kernels; the kernels write into exactly these tensors."""
    fills = []
    real_zeros_like = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda *a, **k: fills.append(a[0].shape) or real_zeros_like(*a, **k))
    (dq, dk, dv), (_, run), args = call(launches)
    for g, t in zip((dq, dk, dv), (args["query"], args["key"], args["value"])):
        assert g.shape == t.shape and g.dtype == t.dtype and g.stride() == torch.empty_like(t).stride()
    assert run["dq"] is dq and run["dk"] is dk and run["dv"] is dv  # written in place
    assert (dq == 1).all() and (dk[:1] == 2).all() and (dv[:1] == 3).all()
    assert fills == [], "a zero fill ran before the kernels"


def test_with_no_queries_nothing_runs_and_the_gradients_are_zero(launches):
    """No query rows: no kernel launches (they would have nothing to read), so dk / dv are zero
    filled here: no query sees a key."""
    args = inputs([0, 0], [30, 20])
    before = len(launches)
    dq, dk, dv = launch.backward(**args, window_size=(-1, -1))
    assert len(launches) == before
    assert dq.shape[0] == 0 and (dk == 0).all() and (dv == 0).all()


def test_outputs_the_kernel_cannot_write_in_place_get_the_result_copied(launches):
    """A key tensor that is a view with an odd row stride (not 16-byte rows): dk / dv come back
    with empty_like's strides, the kernel wrote contiguous temporaries."""
    args = inputs([10], [20])
    wide = torch.randn(20, 2, 131).to(BF16)
    args["key"] = wide[:, :, 1:129]  # 16-bit elements at an odd offset: misaligned rows
    launch.backward(**args, window_size=(-1, -1), max_q=10, max_k=20)
    (_, run) = launches[-1]
    assert run["dk"].is_contiguous() and run["dk"].data_ptr() % 16 == 0
    assert run["k"].is_contiguous(), "the kernel reads a 16-byte aligned copy of key"


def test_lse_gradient_is_passed_only_when_it_has_rows(launches):
    args = inputs([10, 20], [30, 5])
    args["grad_lse"] = torch.zeros(0, 30)
    launch.backward(**args, window_size=(-1, 0), max_q=20, max_k=30)
    assert launches[-1][1]["dlse"] is None
    args["grad_lse"] = torch.randn(8, 30, dtype=torch.float64)
    launch.backward(**args, window_size=(-1, 0), max_q=20, max_k=30)
    dlse = launches[-1][1]["dlse"]
    assert dlse.dtype == torch.float32 and dlse.shape == (8, 30)


def test_missing_lse_is_recomputed_by_one_forward_with_one_split(launches, monkeypatch):
    calls = []

    def forward(call):
        calls.append(call)
        return torch.empty_like(call.query), torch.full((call.query.shape[1], call.query.shape[0]), 0.5)

    import jitattn.varlen.forward as forward_module
    from jitattn import checks as _checks

    monkeypatch.setattr(forward_module, "forward", forward)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))  # CPU inputs pass
    args = inputs([10, 20], [30, 5], lse=False)
    launch.backward(**args, window_size=(4, 0), max_q=20, max_k=30)
    call, = calls
    assert (call.max_q, call.max_k) == (20, 30) and call.num_splits == 1 and call.return_lse
    assert (call.window_left, call.window_right) == (4, 0)
    assert (launches[-1][1]["lse"] == 0.5).all()


def test_no_query_rows_launches_nothing_and_gives_zero_gradients(launches):
    args = inputs([0, 0], [30, 5])
    dq, dk, dv = launch.backward(**args, window_size=(-1, -1), max_q=0, max_k=30)
    assert not launches and dq.shape[0] == 0 and (dk == 0).all() and (dv == 0).all()
