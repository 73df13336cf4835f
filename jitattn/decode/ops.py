"""`jitattn::single_decode_with_kv_cache`: the decode API as a torch.library op, for torch.compile.

Registered on first use (jitattn.decode.api.ops_registered: a compiled call, or a caller that
wants the op), not on import of the API: an eager call never uses it. `register` takes the
implementation, so this module needs nothing from the API's module. The varlen ops live in
jitattn/varlen/ops.py.
"""
from __future__ import annotations

import threading

import torch

_LIBRARY: torch.library.Library | None = None
_lock = threading.Lock()


def register(implementation) -> None:
    """Define the op over `implementation` (single_decode_with_kv_cache), once per process.

    Defined from a schema string rather than with @custom_op: the same op, registered faster
    (notes/host-time.md)."""
    global _LIBRARY
    with _lock:
        if _LIBRARY is not None:
            return
        library = torch.library.Library("jitattn", "FRAGMENT")
        library.define(
            "single_decode_with_kv_cache(Tensor q, Tensor k, Tensor v, str kv_layout, str pos_encoding_mode, "
            "bool use_tensor_cores, float? q_scale, float? k_scale, float? v_scale, int window_left, "
            "float? logits_soft_cap, float? sm_scale, float? rope_scale, float? rope_theta) -> (Tensor, Tensor)")

        def op(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
               logits_soft_cap, sm_scale, rope_scale, rope_theta):
            return implementation(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale,
                                  v_scale, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                  return_lse=True)

        library.impl("single_decode_with_kv_cache", op, "CompositeExplicitAutograd")
        torch.library.register_fake("jitattn::single_decode_with_kv_cache", _fake, lib=library)
        _LIBRARY = library


def _fake(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
          logits_soft_cap, sm_scale, rope_scale, rope_theta):
    # Shapes only: the real call validates everything before it launches.
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0],), dtype=torch.float32)
