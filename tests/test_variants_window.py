"""Masks that are windows (jitattn/variants/window.py): the launch layer runs a mask_mod made of
bounds on q_idx - kv_idx as the built-in window. Checked against the reference mask on every
(q_idx, kv_idx) of a grid, for the gallery and for random conjunctions; the planner picks the
built-in kernels with the intersected window, forward and backward; JITATTN_LOWER_WINDOWS=0 keeps
the hook."""
from __future__ import annotations

import random
import types

import pytest
import torch

from jitattn.variants import gallery, reference_mask, trace_mask_mod
from jitattn.variants.tree import Variant
from jitattn.variants.window import lower_window, window_of
from tests.varlen_stand_in import stand_in_forward_kernels
from tests.varlen_utils import window_visibility

GRID = 48


def _window_mask(left: int, right: int) -> torch.Tensor:
    return window_visibility(GRID, GRID, left, right)


def _mask_on_grid(v: Variant) -> torch.Tensor:
    q = torch.arange(GRID).view(-1, 1)
    kv = torch.arange(GRID).view(1, -1)
    zero = torch.zeros((), dtype=torch.long)
    return reference_mask(v, zero, zero, q, kv).expand(GRID, GRID)


def test_the_gallery_windows_lower_and_the_rest_do_not():
    assert window_of(trace_mask_mod(gallery.causal)) == (-1, 0)
    assert window_of(trace_mask_mod(gallery.sliding_window(1024))) == (1024, 0)
    assert window_of(trace_mask_mod(gallery.document(torch.zeros(2, 8, dtype=torch.int32)))) is None
    assert window_of(trace_mask_mod(gallery.prefix_lm(torch.ones(2, dtype=torch.int32)))) is None
    cases = {
        (lambda b, h, q, kv: (kv <= q + 3) & (kv > q - 10)): (9, 3),
        (lambda b, h, q, kv: q == kv): (0, 0),
        (lambda b, h, q, kv: kv - q <= 0): (-1, 0),
        (lambda b, h, q, kv: (q - kv >= -2) & (q >= kv - 5) & (q - kv < 7)): (6, 2),
        (lambda b, h, q, kv: q > kv): None,  # the diagonal hidden: no built-in window says that
        (lambda b, h, q, kv: (q >= kv) | (kv < 4)): None,
        (lambda b, h, q, kv: (q >= kv) & (h == 0)): None,
        (lambda b, h, q, kv: q * 2 >= kv): None,
        (lambda b, h, q, kv: q - kv <= (1 << 30)): None,  # a huge offset keeps the hook
    }
    for fn, want in cases.items():
        v = trace_mask_mod(fn)
        assert window_of(v) == want, v
        if want is not None:
            assert torch.equal(_mask_on_grid(v), _window_mask(*want)), v


def _random_bound(rng):
    """A comparison of two linear index expressions whose q_idx - kv_idx parts cancel to +-1."""
    c1, c2 = rng.randint(-6, 6), rng.randint(-6, 6)
    sides = [("q", c1), ("kv", c2)]
    rng.shuffle(sides)
    op = rng.choice(["ge", "gt", "le", "lt", "eq"])

    def expr(name, c, q, kv):
        base = q if name == "q" else kv
        return base + c if c >= 0 else base - (-c)

    def fn(b, h, q, kv, sides=sides, op=op):
        left, right = (expr(name, c, q, kv) for name, c in sides)
        return {"ge": left >= right, "gt": left > right, "le": left <= right, "lt": left < right,
                "eq": left == right}[op]
    return fn


def test_random_conjunctions_lower_exactly():
    rng = random.Random(3)
    lowered = 0
    for _ in range(300):
        parts = [_random_bound(rng) for _ in range(rng.randint(1, 3))]

        def mask(b, h, q, kv, parts=parts):
            result = parts[0](b, h, q, kv)
            for part in parts[1:]:
                result = result & part(b, h, q, kv)
            return result
        v = trace_mask_mod(mask)
        window = window_of(v)
        grid = _mask_on_grid(v)
        if window is None:  # only masks the kernels' windows cannot say: the diagonal hidden, or nothing shown
            assert not torch.diagonal(grid).all() or not grid.any()
            continue
        lowered += 1
        assert torch.equal(grid, _window_mask(*window)), (v, window)
    assert lowered > 50


def test_lower_window_intersects_with_the_calls_window():
    causal = trace_mask_mod(gallery.causal)
    sliding = trace_mask_mod(gallery.sliding_window(100))
    assert lower_window(causal, -1, -1) == (None, -1, 0)
    assert lower_window(causal, 30, 5) == (None, 30, 0)
    assert lower_window(sliding, 200, -1) == (None, 100, 0)
    assert lower_window(sliding, 20, 3) == (None, 20, 0)
    assert lower_window(causal, -1, -1, enabled=False) == (causal, -1, -1)
    document = trace_mask_mod(gallery.document(torch.zeros(2, 8, dtype=torch.int32)))
    assert lower_window(document, 7, 0) == (document, 7, 0)
    assert lower_window(None, 7, 0) == (None, 7, 0)


@pytest.fixture
def planner(monkeypatch):
    """The specs and windows the forward and backward launch, with stand-in modules."""
    import jitattn.varlen.backward_launch as backward_launch
    from jitattn.kernel import fresh_memos
    from jitattn import checks as _checks

    seen = []

    def forward_run(spec, q, k, v, cu_q, cu_k, used, table, out, bad_page, pack, m_blocks, splits, min_tiles, left,
                    right, scale_log2, softcap, want_lse, build_mask_map, captures):
        seen.append(("fwd", spec, left, right, captures))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    def backward_module(spec):
        def run(dout, dlse, q, k, v, out, lse, cu_q, cu_k, used, dq, dk, dv, n_blocks, left, right, *rest):
            seen.append(("bwd", spec, left, right, rest[4:]))
        return types.SimpleNamespace(ops=types.SimpleNamespace(run=types.SimpleNamespace(default=run)))

    stand_in_forward_kernels(monkeypatch, forward_run)
    monkeypatch.setattr(backward_launch, "get_module", backward_module)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    monkeypatch.delenv("JITATTN_LOWER_WINDOWS", raising=False)
    with fresh_memos():
        yield seen


def _call(mask_mod, window=(-1, -1)):
    import jitattn.varlen.backward_launch as backward_launch
    from jitattn.varlen.checks import AuxRequest, varlen_call
    from jitattn.varlen.forward import forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(40, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    forward(varlen_call(q, k, v, cu, cu, 25, 25, window_size=window, return_aux=AuxRequest(lse=True),
                        mask_mod=mask_mod))
    backward_launch.backward(torch.randn_like(q), None, q, k, v, q, torch.zeros(2, 40), cu, cu, window_size=window,
                             max_q=25, max_k=25, mask_mod=mask_mod)


def test_the_planner_runs_a_window_mask_on_the_built_in_kernels(planner, monkeypatch):
    _call(trace_mask_mod(gallery.sliding_window(10)), window=(30, -1))
    assert [(kind, spec.mask_mod, left, right) for kind, spec, left, right, _ in planner] == \
        [("fwd", "", 10, 0), ("bwd", "", 10, 0)]
    planner.clear()
    monkeypatch.setenv("JITATTN_LOWER_WINDOWS", "0")
    causal = trace_mask_mod(gallery.causal)
    _call(causal)
    assert [(kind, spec.mask_mod, left, right) for kind, spec, left, right, _ in planner] == \
        [("fwd", causal.key_text, -1, -1), ("bwd", causal.key_text, -1, -1)]
