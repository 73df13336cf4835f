"""The varlen forward's launch from Python (jitattn/varlen/launch.py): the params VarlenKernel.run
packs and a KeptLaunch's re-packing of them, read back from a stand-in C entry point (a small
shared library built here with the host compiler, recording the bytes ctypes hands it), on CPU
tensors: no GPU, no nvcc."""
from __future__ import annotations

import struct
import subprocess
import types

import pytest
import torch

from jitattn.varlen.launch import CAPTURE, CAPTURES_AT, VarlenKernel, params_struct
from jitattn.varlen.spec import VarlenSpec
from tests.conftest import require_host_cxx

RECORDER = r"""
#include <string.h>
static unsigned char last[4096];
extern "C" int jitattn_varlen_params_size(void) { return SIZE; }
extern "C" int jitattn_varlen_launch(const char* p) { memcpy(last, p, SIZE); return 0; }
extern "C" const char* jitattn_varlen_error(void) { return ""; }
extern "C" void recorded(unsigned char* out) { memcpy(out, last, SIZE); }
"""
POINTERS = ("q", "k", "v", "out", "lse", "partial_o", "partial_lse", "cu_q", "cu_k", "used", "table", "bad_page",
            "counter", "mask_map")


@pytest.fixture(scope="module")
def recorder_for(tmp_path_factory):
    """captures -> (library path, read()): a C entry point that records the params it is given."""
    cxx = require_host_cxx("the varlen launch's packing test")
    built = {}

    def build(captures: int):
        if captures not in built:
            size = params_struct(captures).size
            source = tmp_path_factory.mktemp("entry") / "entry.cpp"
            source.write_text(RECORDER)
            library = source.with_suffix(".so")
            subprocess.run([cxx, "-shared", "-fPIC", f"-DSIZE={size}", str(source), "-o", str(library)], check=True)
            built[captures] = library
        return built[captures]

    return build


def kernel_with_recorder(recorder_for, spec: VarlenSpec):
    import ctypes

    captures = spec.params()["num_captures"]
    library = recorder_for(captures)
    module = types.SimpleNamespace(entry=types.SimpleNamespace(library=library, path=library),
                                   ops=types.SimpleNamespace(ctas_per_sm=types.SimpleNamespace(default=lambda d: 2)))
    kernel = VarlenKernel(module, spec)
    reader = ctypes.CDLL(str(library))
    layout = params_struct(captures)

    def last_params() -> dict:
        raw = ctypes.create_string_buffer(layout.size)
        reader.recorded(raw)
        fields = layout.unpack(raw.raw)
        return {"pointers": dict(zip(POINTERS, fields[:14])), "rest": fields[14:]}

    return kernel, last_params


def tensors(seed: int, batch=2, heads_q=8, heads_kv=2, len_k=40, head_dim=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, 1, head_dim, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(batch, heads_kv, len_k, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    # views as the transformers integration launches them: (T_q, H_q, D) and (rows, H_kv, D)
    q_view = q.as_strided((batch, heads_q, head_dim), (q.stride(0), q.stride(1), 1))
    k_view, v_view = (t.as_strided(((batch - 1) * len_k + len_k, heads_kv, head_dim), (t.stride(2), t.stride(1), 1))
                      for t in (k, v))
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    cu_k = torch.arange(0, (batch + 1) * len_k, len_k, dtype=torch.int32)
    used = torch.full((batch,), len_k, dtype=torch.int32)
    return (q, k, v), (q_view, k_view, v_view), (cu_q, cu_k, used)


# pack, m_blocks, splits, min_tiles, window left / right, scale_log2, softcap
SCALARS = (4, 1, 3, 2, -1, 0, 0.18, 0.0)


def test_a_kept_launch_packs_what_run_packs_with_its_own_tensors(recorder_for):
    """The params of KeptLaunch.run on new tensors of the kept layout equal VarlenKernel.run's for
    the same tensors, field for field, but for what each call allocates (out, the split partials),
    which point at that call's own buffers."""
    kernel, last = kernel_with_recorder(recorder_for, VarlenSpec(head_dim=64, dtype="bfloat16", paged=False,
                                                                 decode=True))
    _, views, starts = tensors(0)
    kept = kernel.keep(*views, *starts, *SCALARS, False, (), (2, 1, 8, 64))
    for seed in (1, 2):
        bases, views, starts = tensors(seed)
        out = kept.run(*bases, *starts)
        assert out.shape == (2, 1, 8, 64) and out.is_contiguous()
        got = last()
        kernel.run(*views, *starts, None, None, None, *SCALARS, False, False, ())
        want = last()
        assert got["rest"] == want["rest"]  # strides, sizes, scalars, device
        for name in ("q", "k", "v", "cu_q", "cu_k", "used"):
            assert got["pointers"][name] == want["pointers"][name] != 0, name
        assert got["pointers"]["out"] == out.data_ptr()
        for name in ("lse", "table", "bad_page", "counter", "mask_map"):
            assert got["pointers"][name] == want["pointers"][name] == 0, name
        partial_o, partial_lse = got["pointers"]["partial_o"], got["pointers"]["partial_lse"]
        assert partial_o and partial_lse == partial_o + 3 * 8 * 2 * 64 * 4  # splits x H_q x T_q x D floats
        # one allocation: the partials lie past out's rows, in out's storage
        assert partial_o == out.data_ptr() + out.numel() * out.element_size()
        assert out.untyped_storage().nbytes() >= out.numel() * out.element_size() + 3 * 8 * 2 * (64 + 1) * 4


def test_a_kept_launch_for_longer_keys_packs_what_a_new_keep_packs(recorder_for):
    """KeptLaunch.for_keys (a decode step's first layer: the cache one key longer, in a new tensor
    with other strides) writes the params a launch kept anew for those keys would hold, field for
    field but the per-call allocations."""
    kernel, last = kernel_with_recorder(recorder_for, VarlenSpec(head_dim=64, dtype="bfloat16", paged=False,
                                                                 decode=True))
    _, views, starts = tensors(0, len_k=40)
    kept = kernel.keep(*views, *starts, *SCALARS, False, (), (2, 1, 8, 64))
    bases, longer, starts = tensors(1, len_k=41)
    assert longer[1].stride() != views[1].stride()  # (tokens, heads): the head stride follows the length
    derived = kept.for_keys(*((tuple(t.shape), t.stride()) for t in longer[1:]))
    fresh = kernel.keep(*longer, *starts, *SCALARS, False, (), (2, 1, 8, 64))
    got, want = [], []
    for launch, into in ((derived, got), (fresh, want)):
        launch.run(*bases, *starts)
        into.append(last())
    (got,), (want,) = got, want
    assert got["rest"] == want["rest"]  # the strides, total_k and every scalar
    for name in ("q", "k", "v", "cu_q", "cu_k", "used"):
        assert got["pointers"][name] == want["pointers"][name] != 0, name
    assert derived.sizes == fresh.sizes and derived.alloc_shape == fresh.alloc_shape


def test_the_scratch_layout_is_aligned_and_disjoint():
    """_Scratch's one allocation: each part 16-byte aligned, in order, none overlapping the next."""
    from jitattn.varlen.launch import _Scratch

    # (partials, head_dim, mask map elements, map heads, counter)
    for sizes in ((3, 64, 10, 2, True), (5, 96, 0, 0, True), (0, 128, 7, 1, True), (2, 64, 0, 0, False),
                  (0, 64, 0, 0, False)):
        partials, head_dim, map_elements, _, counter = sizes
        nbytes, (o, lse, count, mask_map) = _Scratch.layout(sizes)
        parts = [(o, partials * head_dim * 4), (lse, partials * 4), (count, 4 if counter else 0),
                 (mask_map, map_elements * 4)]
        end = 0
        for at, size in parts:
            assert (at is None) == (size == 0), sizes
            if at is not None:
                assert at % 16 == 0 and at >= end, sizes
                end = at + size
        assert nbytes >= end and nbytes % 16 == 0
        scratch = _Scratch(sizes, None, 4096)
        assert (scratch.partial_o, scratch.counter, scratch.mask_map) == tuple(
            0 if at is None else 4096 + at for at in (o, count, mask_map))


def test_a_kept_launch_repacks_its_captures_whatever_their_strides(recorder_for):
    """A padded call's captured tensors are new per call (the mask's plan): each call packs their
    fields anew, so a capture with other strides than the first call's is read as it lies."""
    from jitattn.integrations.transformers import _padding_variant

    variant = _padding_variant(1)
    spec = VarlenSpec(head_dim=64, dtype="bfloat16", paged=False, decode=True, mask_mod=variant.key_text)
    kernel, last = kernel_with_recorder(recorder_for, spec)
    _, views, starts = tensors(0)
    whole, first = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.int32)
    mask = torch.ones(2, 40, dtype=torch.bool)
    kept = kernel.keep(*views, *starts, *SCALARS, False, (whole, first, mask), (2, 1, 8, 64))
    bases, _, starts = tensors(1)
    wide = torch.ones(40, 4, dtype=torch.bool).t()[:2]  # (2, 40) with strides (1, 4)
    kept.run(*bases, *starts, (whole, first, wide))
    captures = last()["rest"][-3 * 9:]
    fields = struct.unpack("@" + CAPTURE * 3, struct.pack("@" + CAPTURE * 3, *captures))
    mask_fields = fields[18:]
    assert mask_fields[0] == wide.data_ptr() and mask_fields[1:3] == (1, 4) and mask_fields[5:7] == (2, 40)
    assert fields[0] == whole.data_ptr() and fields[9] == first.data_ptr()
    with pytest.raises(ValueError, match="3 captured tensors"):
        kept.run(*bases, *starts, (whole, first))


def test_keep_refuses_an_output_shape_that_is_not_the_rows_of_q(recorder_for):
    kernel, _ = kernel_with_recorder(recorder_for, VarlenSpec(head_dim=64, dtype="bfloat16", paged=False, decode=True))
    _, views, starts = tensors(0)
    with pytest.raises(ValueError, match="out_shape"):
        kernel.keep(*views, *starts, *SCALARS, False, (), (2, 2, 8, 64))


def test_the_capture_offset_is_where_params_struct_puts_the_first_capture():
    one = params_struct(1)
    fields = [0] * 14 + [0] * 12 + [0] * 13 + [0.0] * 3 + [0] + [7, 1, 2, 3, 4, 5, 6, 7, 8]
    packed = one.pack(*fields)
    assert struct.unpack_from("@" + CAPTURE, packed, CAPTURES_AT) == (7, 1, 2, 3, 4, 5, 6, 7, 8)
