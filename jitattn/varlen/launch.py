"""How a varlen forward module is launched: its C entry point, called through ctypes with packed
VarlenParams (templates/varlen/params.h), the outputs allocated here through torch's caching
allocator on the query's device."""
from __future__ import annotations

import math
import struct

import torch

from jitattn.kernel import CEntryKernel

LOG2E = 1.4426950408889634

# VarlenParams in native layout: 14 pointers, mask_map_heads, 11 int64 strides, 13 ints, 3 floats,
# the device; then one Capture per captured tensor (data, 4 int64 strides, 4 int sizes); padded to
# 8 bytes. The binding static_asserts the same offsets, and VarlenKernel compares sizes on load.
VARLEN_PARAMS = "@14Pi11q13i3fi"
CAPTURE = "P4q4i"
MAX_CAPTURE_DIMS = 4


def params_struct(num_captures: int) -> struct.Struct:
    return struct.Struct(VARLEN_PARAMS + CAPTURE * num_captures + "0q")


_STRIDE_PAD = tuple((0,) * (MAX_CAPTURE_DIMS - dims) for dims in range(MAX_CAPTURE_DIMS + 1))
_SIZE_PAD = tuple((1,) * (MAX_CAPTURE_DIMS - dims) for dims in range(MAX_CAPTURE_DIMS + 1))


def capture_fields(tensors) -> list:
    """Captured tensors as the kernels read them (capture.h), flat: per tensor its data (null when
    empty), strides in elements (0 past its dims), sizes (1 past its dims)."""
    fields = []
    for t in tensors:
        dims = t.dim()
        fields.append(t.data_ptr() if t.numel() else 0)
        fields += t.stride() + _STRIDE_PAD[dims] + tuple(t.shape) + _SIZE_PAD[dims]
    return fields


class VarlenKernel(CEntryKernel):
    """A varlen forward module (jitattn_varlen_launch through ctypes): `run` allocates what the
    kernels write (the output unless given, the lse when asked for, the split partials, the
    persistent grid's work counter, the mask map), packs VarlenParams and launches. What the
    spec fixes (head_dim, paged, the soft cap's form, persistent, the mask map's layout, the
    captures) is read once here."""

    def __init__(self, module, spec):
        params = spec.params()
        self._params = params_struct(params["num_captures"])
        super().__init__(module, "varlen", self._params.size)
        self.head_dim = spec.head_dim
        self.paged = spec.paged
        self.soft_cap = spec.soft_cap
        self.exact_soft_cap = spec.exact_soft_cap
        self.persistent = spec.persistent
        self.mask_map = bool(params["mask_map"])
        self.mask_map_per_head = bool(params["mask_map_per_head"])

    def run(self, q, k, v, cu_seq_q, cu_seq_k, seqused_k, block_table, out, bad_page, pack, num_m_blocks,
            num_splits, split_min_tiles, window_left, window_right, scale_log2, softcap, want_lse, build_mask_map,
            captures):
        """Fill `out` (allocated when None: (T_q, H_q, D), contiguous, q's dtype) and, when want_lse, a
        new lse (H_q, T_q) float32 (else None). Returns (out, lse). Inputs are checked and ready
        (jitattn/varlen/forward.py): CUDA, on one device, 16-byte rows."""
        total_q, heads_q = q.shape[0], q.shape[1]
        if out is None:
            out = torch.empty((total_q, heads_q, self.head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((heads_q, total_q), dtype=torch.float32, device=q.device) if want_lse else None
        sizes = self._scratch_sizes(q, k, cu_seq_q, num_m_blocks, num_splits, build_mask_map)
        scratch = _Scratch(sizes, q.device)
        self.call(self._params.pack(*self._fields(
            q, k, v, out.data_ptr(), out.stride(), lse, scratch, cu_seq_q, cu_seq_k, seqused_k, block_table, bad_page,
            pack, num_m_blocks, num_splits, split_min_tiles, window_left, window_right, scale_log2, softcap, captures)))
        return out, lse

    def keep(self, q, k, v, cu_seq_q, cu_seq_k, seqused_k, pack, num_m_blocks, num_splits, split_min_tiles,
             window_left, window_right, scale_log2, softcap, build_mask_map, captures, out_shape) -> "KeptLaunch":
        """run()'s launch (no block table, no lse, a new output of `out_shape`: (..., H_q, D)
        contiguous over q's T_q rows), packed once for calls on tensors of the same layout."""
        total_q, heads_q = q.shape[0], q.shape[1]
        if math.prod(out_shape[:-2]) != total_q or tuple(out_shape[-2:]) != (heads_q, self.head_dim):
            raise ValueError(f"out_shape {tuple(out_shape)} is not ({total_q} rows, {heads_q}, {self.head_dim})")
        sizes = self._scratch_sizes(q, k, cu_seq_q, num_m_blocks, num_splits, build_mask_map)
        # Packed with null pointers where each call allocates (KeptLaunch.run writes them): the
        # output contiguous, (token, head) strides (H_q x D, D).
        params = self._params.pack(*self._fields(
            q, k, v, 0, (heads_q * self.head_dim, self.head_dim), None, _Scratch.unallocated(sizes), cu_seq_q,
            cu_seq_k, seqused_k, None, None, pack, num_m_blocks, num_splits, split_min_tiles, window_left,
            window_right, scale_log2, softcap, captures))
        return KeptLaunch(self, params, tuple(out_shape), q.dtype, q.device, sizes, len(captures))

    def _scratch_sizes(self, q, k, cu_seq_q, num_m_blocks, num_splits, build_mask_map) -> tuple:
        """What a launch allocates besides out (`_Scratch`): (float32 elements of the split partials,
        head_dim, int32 elements of the mask map, mask map heads, whether the persistent grid's work
        counter is needed)."""
        partials = num_splits * q.shape[1] * q.shape[0] if num_splits > 1 else 0
        map_heads = map_elements = 0
        if build_mask_map:
            map_heads = k.shape[-2] if self.mask_map_per_head else 1
            map_elements = (cu_seq_q.shape[0] - 1) * num_m_blocks * map_heads * 4
        return partials, self.head_dim, map_elements, map_heads, self.persistent

    def _fields(self, q, k, v, out_ptr, out_strides, lse, scratch, cu_seq_q, cu_seq_k, seqused_k, block_table,
                bad_page, pack, num_m_blocks, num_splits, split_min_tiles, window_left, window_right, scale_log2,
                softcap, captures) -> list:
        """VarlenParams' fields in VARLEN_PARAMS order, then the captures' (the output as its pointer
        and its (token, head) strides)."""
        num_seqs = cu_seq_q.shape[0] - 1
        num_heads_kv = k.shape[-2]
        if self.paged:  # a page pool: (pages, page_size, H_kv, D)
            k_strides, v_strides = k.stride()[:3], v.stride()[:3]
            page_size = k.shape[1]
            page_shift = (page_size - 1).bit_length()
            page_mask = page_size - 1
        else:
            k_strides, v_strides = (0, *k.stride()[:2]), (0, *v.stride()[:2])
            page_shift = page_mask = 0
        scale = scale_log2 / LOG2E
        if self.soft_cap:  # logits cap * tanh(scale * s / cap), in log2 units (score.cuh's SoftCapScore)
            cap_scale = (2.0 * scale_log2 if self.exact_soft_cap else scale) / softcap
            scale_log2 = softcap * LOG2E
        else:
            cap_scale = 0.0
        q_strides = q.stride()
        return [
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out_ptr, 0 if lse is None else lse.data_ptr(),
            scratch.partial_o, scratch.partial_lse, cu_seq_q.data_ptr(), 0 if cu_seq_k is None else cu_seq_k.data_ptr(),
            0 if seqused_k is None else seqused_k.data_ptr(), 0 if block_table is None else block_table.data_ptr(),
            0 if bad_page is None else bad_page.data_ptr(), scratch.counter, scratch.mask_map, scratch.map_heads,
            q_strides[0], q_strides[1], out_strides[0], out_strides[1], *k_strides, *v_strides,
            0 if block_table is None else block_table.stride(0),
            num_seqs, q.shape[1], num_heads_kv, q.shape[0], k.shape[0], pack, num_m_blocks, num_splits, split_min_tiles,
            window_left, window_right, page_shift, page_mask, scale_log2, cap_scale, scale,
            q.get_device(), *(capture_fields(captures) if captures else ())]


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


class _Scratch:
    """What a launch allocates besides its outputs (sizes from VarlenKernel._scratch_sizes), as the
    pointers the params take (0 where not needed), all in one allocation laid out by `layout`: the
    split partials (o, then lse), the persistent grid's work counter (zeroed in C, on the launch's
    stream), the mask map. The tensor lives until the launch is queued."""

    __slots__ = ("tensors", "partial_o", "partial_lse", "counter", "mask_map", "map_heads")

    def __init__(self, sizes: tuple, device: torch.device | None, base: int | None = None):
        """Allocated on `device` (None: null pointers), or at `base`, an address with layout(sizes)[0]
        bytes the caller allocated (KeptLaunch: past its output's rows)."""
        self.map_heads = sizes[3]
        self.tensors = []
        nbytes, offsets = self.layout(sizes)
        if base is None and device is not None and nbytes:
            self.tensors.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
            base = self.tensors[0].data_ptr()
        self.partial_o, self.partial_lse, self.counter, self.mask_map = (
            0 if base is None or at is None else base + at for at in offsets)

    @staticmethod
    def layout(sizes: tuple) -> tuple:
        """(bytes, the offsets of partial_o, partial_lse, counter, mask_map: None where not needed),
        each 16-byte aligned."""
        partials, head_dim, map_elements, _, counter = sizes
        offsets, end = [], 0
        for needed, nbytes in ((partials, partials * head_dim * 4), (partials, partials * 4), (counter, 4),
                               (map_elements, map_elements * 4)):
            offsets.append(end if needed else None)
            end += _aligned(nbytes) if needed else 0
        return end, tuple(offsets)

    @classmethod
    def unallocated(cls, sizes: tuple) -> "_Scratch":
        """The pointers of nothing allocated (a KeptLaunch's packed template)."""
        return cls(sizes, None)


# The params' pointer fields, first in VarlenParams: q, k, v, out, lse, partial_o, partial_lse,
# cu_seq_q, cu_seq_k, seqused_k, block_table, bad_page, work_counter, mask_map.
_POINTERS = struct.Struct("@14P")
# Where the key / value strides (page, token, head; then value's) and total_k sit in VarlenParams:
# after q's and out's two strides, and the fifth of the 13 ints (KeptLaunch.for_keys).
_KV_STRIDES = struct.Struct("@6q")
KV_STRIDES_AT = struct.calcsize("@14Pi4q")
_INT = struct.Struct("@i")
TOTAL_K_AT = struct.calcsize("@14Pi11q") + 4 * _INT.size
CAPTURES_AT = struct.calcsize(VARLEN_PARAMS + "0P")  # the first Capture's offset (pointer-aligned)


class KeptLaunch:
    """One VarlenKernel launch packed once (VarlenKernel.keep) and run again on tensors of the same
    layout: shapes, strides, dtypes and device, which the caller vouches for (the transformers
    integration keys its warm calls by them). A call allocates what run() allocates and writes the
    pointers and the captures' fields into a copy of the params; every other field is the first
    call's. Its whole host cost is one allocation and one pack (notes/transformers-host.md): what
    run() allocates besides the output (_Scratch) rides in rows past the output's, so a decode
    call that splits its keys pays one allocator call, not two."""

    __slots__ = ("kernel", "params", "out_shape", "dtype", "device", "sizes", "num_captures", "alloc_shape",
                 "out_bytes")

    def __init__(self, kernel: VarlenKernel, params: bytes, out_shape: tuple, dtype, device, sizes: tuple,
                 num_captures: int):
        self.kernel, self.params, self.out_shape, self.dtype, self.device = kernel, params, out_shape, dtype, device
        self.sizes, self.num_captures = sizes, num_captures
        row_bytes = math.prod(out_shape[1:]) * dtype.itemsize
        self.out_bytes = out_shape[0] * row_bytes
        scratch_bytes = _Scratch.layout(sizes)[0]
        # out's first dimension grown by the rows the scratch takes (16-byte aligned after out's)
        extra = -(-scratch_bytes // row_bytes) if scratch_bytes and row_bytes % 16 == 0 else 0
        self.alloc_shape = (out_shape[0] + extra,) + tuple(out_shape[1:]) if extra else None

    def for_keys(self, k: tuple, v: tuple) -> "KeptLaunch":
        """This launch for key / value views of another length (a decode step's cache one key
        longer, in a new tensor: jitattn/integrations/transformers.py), given as (size, stride)
        of the (T_k, H_kv, D) views, whose launch plan is this one's (the same split count and mask
        map: forward.for_max_k returned the launch itself): their strides and T_k written into a
        copy of the params, every other field kept."""
        if self.kernel.paged:
            raise ValueError("for_keys re-packs packed keys, not a page pool")
        (k_size, k_stride), (_, v_stride) = k, v
        params = bytearray(self.params)
        _KV_STRIDES.pack_into(params, KV_STRIDES_AT, 0, *k_stride[:2], 0, *v_stride[:2])
        _INT.pack_into(params, TOTAL_K_AT, k_size[0])
        return KeptLaunch(self.kernel, bytes(params), self.out_shape, self.dtype, self.device, self.sizes,
                          self.num_captures)

    def run(self, q, k, v, cu_seq_q, cu_seq_k, seqused_k, captures=()) -> torch.Tensor:
        """The output (out_shape) of the kept launch on these tensors (q, k, v of the kept layout)."""
        if len(captures) != self.num_captures:
            raise ValueError(f"this launch takes {self.num_captures} captured tensors, got {len(captures)}")
        if self.alloc_shape is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            scratch = _Scratch(self.sizes, self.device)
        else:  # one allocation: out, then the scratch; out keeps it alive, as long as the output lives
            whole = torch.empty(self.alloc_shape, dtype=self.dtype, device=self.device)
            out = whole[:self.out_shape[0]]
            scratch = _Scratch(self.sizes, None, whole.data_ptr() + self.out_bytes)
        params = bytearray(self.params)
        _POINTERS.pack_into(params, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0, scratch.partial_o,
                            scratch.partial_lse, cu_seq_q.data_ptr(), 0 if cu_seq_k is None else cu_seq_k.data_ptr(),
                            0 if seqused_k is None else seqused_k.data_ptr(), 0, 0, scratch.counter, scratch.mask_map)
        if captures:  # their fields whole: a capture's strides may differ from the first call's
            fields = capture_fields(captures)
            struct.pack_into("@" + CAPTURE * len(captures), params, CAPTURES_AT, *fields)
        self.kernel.call(bytes(params))
        return out
