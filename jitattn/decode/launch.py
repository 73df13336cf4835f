"""How a decode module is launched: its C entry point, called through ctypes with packed parameters."""
from __future__ import annotations

import struct

from jitattn.kernel import CEntryKernel

# DecodeParams (templates/decode/params.h) in native layout: 7 pointers, 5 int64 strides,
# 7 ints, 3 floats, 2 doubles, the device, padded to 8 bytes. The binding static_asserts the
# same offsets, and DecodeKernel compares sizes on load.
DECODE_PARAMS = struct.Struct("@7P5q7i3f2di0q")


class DecodeKernel(CEntryKernel):
    """A decode module, launched through its C entry point `jitattn_decode_launch` (ctypes):
    a decode step is a few microseconds of GPU work, and a boxed torch op call with 14 arguments
    cost more host time than that. The caller allocates every output; `launch` packs the
    pointers and scalars and launches on torch's current stream of `device`. `tile_rows` is the
    kernel's pipeline stage in rows (its TILE, read from the module rather than mirrored)."""

    def __init__(self, module):
        super().__init__(module, "decode", DECODE_PARAMS.size)
        self.tile_rows = self.library.jitattn_decode_tile_rows()

    def launch(self, q, k, v, out, lse, workspace, k_strides, v_strides, kv_begin, kv_end, group_size,
               group_tiles, chunk_len, num_chunks, q_scale, cap_log2e, v_scale, rope_turns0, rope_ratio,
               device_index):
        """k_strides/v_strides: (token stride, head stride) in elements. `lse` may be None (not
        written); `workspace` holds the fp32 partials when num_chunks > 1: [chunks, heads, D] o,
        then [chunks, heads] lse. rope_turns0/rope_ratio: see decode._rope_frequencies."""
        num_heads, head_dim = q.shape
        partial_o = partial_lse = 0
        if workspace is not None:
            partial_o = workspace.data_ptr()
            partial_lse = partial_o + num_chunks * num_heads * head_dim * 4
        params = DECODE_PARAMS.pack(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
            partial_o, partial_lse, q.stride(0), k_strides[0], k_strides[1], v_strides[0], v_strides[1],
            kv_begin, kv_end, num_heads // group_size, group_size, group_tiles, chunk_len, num_chunks,
            q_scale, cap_log2e, v_scale, rope_turns0, rope_ratio, device_index)
        self.call(params)
