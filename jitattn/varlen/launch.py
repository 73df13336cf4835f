"""How a varlen forward module is launched: its C entry point, called through ctypes with packed
VarlenParams (templates/varlen/params.h), the outputs allocated here through torch's caching
allocator on the query's device."""
from __future__ import annotations

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
        device = q.device
        head_dim = self.head_dim
        if out is None:
            out = torch.empty((total_q, heads_q, head_dim), dtype=q.dtype, device=device)
        lse = torch.empty((heads_q, total_q), dtype=torch.float32, device=device) if want_lse else None
        partial_o = partial_lse = 0
        if num_splits > 1:
            partials = num_splits * heads_q * total_q
            workspace = torch.empty(partials * (head_dim + 1), dtype=torch.float32, device=device)
            partial_o = workspace.data_ptr()
            partial_lse = partial_o + partials * head_dim * 4
        counter = torch.empty(1, dtype=torch.int32, device=device) if self.persistent else None  # zeroed in C
        num_seqs = cu_seq_q.shape[0] - 1
        num_heads_kv = k.shape[-2]
        mask_map = map_heads = None
        if build_mask_map:
            map_heads = num_heads_kv if self.mask_map_per_head else 1
            mask_map = torch.empty(num_seqs * num_m_blocks * map_heads * 4, dtype=torch.int32, device=device)
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
        fields = capture_fields(captures) if captures else ()
        q_strides, out_strides = q.stride(), out.stride()
        params = self._params.pack(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
            partial_o, partial_lse, cu_seq_q.data_ptr(), 0 if cu_seq_k is None else cu_seq_k.data_ptr(),
            0 if seqused_k is None else seqused_k.data_ptr(), 0 if block_table is None else block_table.data_ptr(),
            0 if bad_page is None else bad_page.data_ptr(), 0 if counter is None else counter.data_ptr(),
            0 if mask_map is None else mask_map.data_ptr(), map_heads or 0,
            q_strides[0], q_strides[1], out_strides[0], out_strides[1], *k_strides, *v_strides,
            0 if block_table is None else block_table.stride(0),
            num_seqs, heads_q, num_heads_kv, total_q, k.shape[0], pack, num_m_blocks, num_splits, split_min_tiles,
            window_left, window_right, page_shift, page_mask, scale_log2, cap_scale, scale,
            q.get_device(), *fields)
        self.call(params)
        return out, lse
