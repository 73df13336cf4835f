"""varlen_attn / varlen_attn_out behave as torch.nn.attention.varlen's, where torch's own tests look
(CPU; the GPU side is tests/test_varlen_dropin_gpu.py): the error texts, varlen_attn_out under
grad (eager and compiled), and the output's layout (eager and compiled).

The real `forward` runs (checks, plan, launch arguments); only the compiled module is a stand-in
that computes the float64 reference into the tensor it is given, as the binding writes its
output, so layouts and values are what the kernel would leave.
"""
import math
import types

import pytest
import torch

import jitattn
import jitattn.varlen.forward as varlen_forward
from jitattn import checks as _checks
from jitattn.reference import varlen_attn_reference
from jitattn.varlen import ops as varlen_ops
from jitattn.kernel import fresh_memos
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.varlen_stand_in import stand_in_forward_kernels

F16, I32 = torch.float16, torch.int32
TORCH_VARLEN = pytest.importorskip("torch.nn.attention.varlen")


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32)


def rel_error(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.fixture
def module(monkeypatch):
    """A stand-in for the compiled kernel: its `run` takes VarlenKernel.run's arguments and writes the
    reference into `out` when given (the strides it has), else into a new contiguous tensor (what
    the kernel allocates). CPU tensors pass the device check."""
    calls = []

    def run(spec, q, k, v, cu_q, cu_k, used, table, out, bad_page, pack, m_blocks, splits, min_tiles, left, right,
            scale_log2, softcap, want_lse, build_mask_map, captures):
        calls.append({"out": out, "splits": splits, "split_min_tiles": min_tiles})
        ref, lse = varlen_attn_reference(q, k, v, cu_q, cu_k, 0, 0, scale=scale_log2 / varlen_forward.LOG2E,
                                         window_size=(left, right), enable_gqa=True, seqused_k=used,
                                         block_table=table, softcap=softcap)
        result = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        result.copy_(ref)
        return result, (lse.float() if want_lse else None)

    stand_in_forward_kernels(monkeypatch, run)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    with fresh_memos():  # the kernel memo and the device's arch are looked up again
        yield calls


def batch(h_q=4, h_kv=2, d=64, seed=0, layout="packed"):
    """Two sequences (5 and 9 query tokens over 7 and 12 keys); the query in `layout`."""
    g = torch.Generator().manual_seed(seed)
    len_q, len_k = [5, 9], [7, 12]
    t_q, t_k = sum(len_q), sum(len_k)
    if layout == "packed":
        q = torch.randn(t_q, h_q, d, generator=g)
    elif layout == "heads-first":  # (H, T, D) memory, as a (B, H, L, D) projection leaves it
        q = torch.randn(h_q, t_q, d, generator=g).transpose(0, 1)
    elif layout == "qkv-slice":  # q of a fused (T, 3, H, D) projection: not dense
        q = torch.randn(t_q, 3, h_q, d, generator=g)[:, 0]
    else:
        raise ValueError(layout)
    k = torch.randn(t_k, h_kv, d, generator=g)
    v = torch.randn(t_k, h_kv, d, generator=g)
    return [q.to(F16), k.to(F16), v.to(F16), cu(len_q), cu(len_k), max(len_q), max(len_k)]


# ---------------------------------------------------------------- error texts
@pytest.mark.parametrize("h_q,h_kv,gqa", [(8, 2, False), (8, 3, True), (2, 4, True)])
@pytest.mark.parametrize("paged", [False, True])
def test_head_count_errors_begin_with_torchs_own_words(h_q, h_kv, gqa, paged):
    """torch's varlen_attn raises these before it needs a GPU, so its text is compared directly."""
    q = torch.randn(6, h_q, 64, dtype=F16)
    if paged:
        kv = torch.randn(3, 4, h_kv, 64, dtype=F16)
        args = (q, kv, kv.clone(), cu([6]), None, 6, 8)
        kwargs = {"seqused_k": torch.tensor([8], dtype=I32), "block_table": torch.tensor([[0, 1]], dtype=I32)}
    else:
        kv = torch.randn(8, h_kv, 64, dtype=F16)
        args, kwargs = (q, kv, kv.clone(), cu([6]), cu([8]), 6, 8), {}
    for ours_fn, torch_fn, extra in ((jitattn.varlen_attn, TORCH_VARLEN.varlen_attn, ()),
                                     (jitattn.varlen_attn_out, TORCH_VARLEN.varlen_attn_out, (torch.empty_like(q),))):
        with pytest.raises(ValueError) as theirs:
            torch_fn(*extra, *args, enable_gqa=gqa, **kwargs)
        with pytest.raises(ValueError) as ours:
            ours_fn(*extra, *args, enable_gqa=gqa, **kwargs)
        assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))
        assert len(str(ours.value)) > len(str(theirs.value))  # and our explanation after them
    assert ("multiple of kv heads" in str(ours.value)) == gqa


@pytest.mark.parametrize("scale", [0, 0.0, -0.5, -3, math.nan, float("-inf")])
@pytest.mark.parametrize("api", ["varlen_attn", "varlen_attn_out"])
def test_invalid_scale_says_torchs_words(api, scale):
    """torch (its `_validate_scale`, newer than the torch of this CI) says exactly this."""
    args = batch()
    extra = (torch.empty_like(args[0]),) if api == "varlen_attn_out" else ()
    with pytest.raises(ValueError) as ours:
        getattr(jitattn, api)(*extra, *args, scale=scale, enable_gqa=True)
    assert str(ours.value) == f"scale must be greater than 0, got {scale}"
    validate = getattr(TORCH_VARLEN, "_validate_scale", None)
    if validate is not None:
        with pytest.raises(ValueError) as theirs:
            validate(scale)
        assert str(ours.value) == str(theirs.value)


def test_infinite_scale_is_refused_too():
    """torch lets +inf through to NaN logits; a superset: we refuse it, naming it."""
    with pytest.raises(ValueError, match=r"^scale must be finite, got inf$"):
        jitattn.varlen_attn(*batch(), scale=math.inf, enable_gqa=True)


def test_valid_scales_reach_the_kernel(module):
    out = jitattn.varlen_attn(*batch(), scale=1, enable_gqa=True)  # an int is a scale too
    want, _ = varlen_attn_reference(*batch(), scale=1.0, enable_gqa=True)
    assert rel_error(out[:14], want[:14]) < 1e-3


# ---------------------------------------------------------------- varlen_attn_out under grad
def _leafs(args, which):
    args = list(args)
    index = {"query": 0, "key": 1, "value": 2}[which]
    args[index] = args[index].clone().requires_grad_()
    return args


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_varlen_attn_out_under_grad_runs_eagerly(module, which):
    args = _leafs(batch(seed=3), which)
    out = torch.full_like(args[0], float("nan"), requires_grad=False)
    result, lse = jitattn.varlen_attn_out(out, *args, enable_gqa=True, window_size=(-1, 0),
                                          return_aux=jitattn.AuxRequest(lse=True))
    want, want_lse = varlen_attn_reference(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                                           enable_gqa=True, window_size=(-1, 0))
    assert result is out and out.grad_fn is None and not lse.requires_grad
    assert rel_error(out, want) < 1e-3 and rel_error(lse, want_lse) < 1e-6


def test_varlen_attn_out_into_a_leaf_that_requires_grad(module):
    """torch's out variant writes into such an `out` too; autograd records nothing."""
    args = batch(seed=4)
    out = torch.zeros_like(args[0]).requires_grad_()
    jitattn.varlen_attn_out(out, *args, enable_gqa=True)
    want, _ = varlen_attn_reference(*args, enable_gqa=True)
    assert out.grad_fn is None and out.is_leaf and rel_error(out.detach(), want) < 1e-3


def test_varlen_attn_out_under_grad_runs_compiled(module):
    """A torch.compile'd module that calls varlen_attn_out on activations (which require grad)."""
    torch._dynamo.reset()
    args = _leafs(batch(seed=5), "query")

    def block(q, k, v, cu_q, cu_k):
        out = torch.empty_like(q)
        jitattn.varlen_attn_out(out, q * 2, k, v, cu_q, cu_k, 9, 12, enable_gqa=True)
        return out

    compiled = torch.compile(block, fullgraph=True)(*args[:5])
    eager = block(*args[:5])
    want, _ = varlen_attn_reference(args[0].detach() * 2, *args[1:], enable_gqa=True)
    assert rel_error(compiled.detach(), want) < 1e-3 and torch.equal(compiled.detach(), eager.detach())


# ---------------------------------------------------------------- the output's layout
@pytest.mark.parametrize("layout", ["packed", "heads-first", "qkv-slice"])
def test_output_takes_the_querys_layout(module, layout):
    """torch allocates `torch.empty_like(query)`: a dense query's strides are kept."""
    args = batch(layout=layout, seed=6)
    out = jitattn.varlen_attn(*args, enable_gqa=True)
    assert out.stride() == torch.empty_like(args[0]).stride(), (out.stride(), args[0].stride())
    if layout == "heads-first":
        assert out.stride() == args[0].stride() and not out.is_contiguous()
        assert module[-1]["out"] is out, "the kernel writes the query-shaped output in place (no copy)"
    want, _ = varlen_attn_reference(*args, enable_gqa=True)
    assert rel_error(out, want) < 1e-3


@pytest.mark.parametrize("layout", ["packed", "heads-first"])
def test_compiled_output_strides_equal_eager(module, layout):
    """The fake kernel allocates what the eager call returns (inductor asserts the strides)."""
    torch._dynamo.reset()
    args = batch(layout=layout, seed=7)

    def attend(q, k, v, cu_q, cu_k):
        return jitattn.varlen_attn(q, k, v, cu_q, cu_k, 9, 12, enable_gqa=True, window_size=(-1, 0))

    eager = attend(*args[:5])
    compiled = torch.compile(attend, fullgraph=True)(*args[:5])
    assert compiled.stride() == eager.stride() == torch.empty_like(args[0]).stride()
    assert torch.equal(compiled, eager)


def test_fake_kernel_takes_symbolic_max_lengths(monkeypatch):
    """Under torch.compile with dynamic shapes max_q / max_k arrive as SymInts (flex_attention
    passes its key length): the fake kernel keeps them symbolic instead of refusing them."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    args = batch()
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        max_q, max_k = fakes[0].shape[0], fakes[1].shape[0]
        assert isinstance(max_k, torch.SymInt)
        out, lse = varlen_ops._varlen_attn_fake(*fakes[:5], max_q, max_k, None, [-1, -1], True, None, None, None,
                                                True)
    assert out.shape == args[0].shape and lse.shape == (4, 14)
    with pytest.raises(TypeError, match="max_k must be an int"):
        varlen_ops._varlen_attn_fake(*args[:5], 9, 12.0, None, [-1, -1], True, None, None, None, True)


@pytest.mark.parametrize("layout", ["packed", "heads-first", "qkv-slice"])
def test_fake_kernel_allocates_empty_like_query(monkeypatch, layout):
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    args = batch(layout=layout)
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out, lse = varlen_ops._varlen_attn_fake(*fakes, None, [-1, -1], True, None, None, None, True)
    assert out.shape == args[0].shape and out.stride() == torch.empty_like(args[0]).stride()
    assert lse.shape == (4, 14) and lse.dtype == torch.float32
