"""The public APIs as torch.library custom ops, with fake kernels.

torch.compile sees `jitattn::varlen_attn`, `jitattn::varlen_attn_out` (mutates `out`) and
`jitattn::single_decode_with_kv_cache` as opaque ops whose output shapes come from the fake
kernels below, so compiled graphs have no break; the real kernels allocate through torch's
caching allocator on the current stream and never sync, so CUDA graphs capture them. The public
functions call these ops only while compiling; eager calls go straight to the implementation.

Op arguments are what the schema language can say: window_size is a list of two ints, return_aux
becomes return_lse, and ops always return lse (an empty (0, T_q) tensor when it was not asked for).
"""
from __future__ import annotations

import torch
from torch import Tensor

from jitattn import decode as _decode
from jitattn import varlen as _varlen
from jitattn.varlen_checks import AuxRequest, check_varlen_args


def _aux(return_lse: bool) -> AuxRequest | None:
    return AuxRequest(lse=True) if return_lse else None


@torch.library.custom_op("jitattn::varlen_attn", mutates_args=())
def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None,
                max_q: int, max_k: int, scale: float | None, window_size: list[int], enable_gqa: bool,
                seqused_k: Tensor | None, block_table: Tensor | None, num_splits: int | None,
                return_lse: bool) -> tuple[Tensor, Tensor]:
    out, lse = _varlen.forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                               window_size=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k,
                               block_table=block_table, num_splits=num_splits, return_aux=_aux(return_lse))
    return out, lse


@varlen_attn.register_fake
def _varlen_attn_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                      seqused_k, block_table, num_splits, return_lse):
    check_varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                      window_size=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k,
                      block_table=block_table, num_splits=num_splits, return_aux=_aux(return_lse))
    return torch.empty_like(query, memory_format=torch.contiguous_format), _lse_like(query, return_lse)


@torch.library.custom_op("jitattn::varlen_attn_out", mutates_args=("out",))
def varlen_attn_out(out: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                    cu_seq_k: Tensor | None, max_q: int, max_k: int, scale: float | None, window_size: list[int],
                    enable_gqa: bool, seqused_k: Tensor | None, block_table: Tensor | None,
                    num_splits: int | None, return_lse: bool) -> Tensor:
    _, lse = _varlen.forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k,
                             block_table=block_table, num_splits=num_splits, return_aux=_aux(return_lse), out=out)
    return lse


@varlen_attn_out.register_fake
def _varlen_attn_out_fake(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                          enable_gqa, seqused_k, block_table, num_splits, return_lse):
    check_varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                      window_size=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k,
                      block_table=block_table, num_splits=num_splits, out=out, return_aux=_aux(return_lse))
    return _lse_like(query, return_lse)


def _lse_like(query: Tensor, return_lse: bool) -> Tensor:
    heads = query.shape[1] if return_lse else 0
    return query.new_empty((heads, query.shape[0]), dtype=torch.float32)


@torch.library.custom_op("jitattn::single_decode_with_kv_cache", mutates_args=())
def single_decode_with_kv_cache(q: Tensor, k: Tensor, v: Tensor, kv_layout: str, pos_encoding_mode: str,
                                use_tensor_cores: bool, q_scale: float | None, k_scale: float | None,
                                v_scale: float | None, window_left: int, logits_soft_cap: float | None,
                                sm_scale: float | None, rope_scale: float | None,
                                rope_theta: float | None) -> tuple[Tensor, Tensor]:
    return _decode.single_decode_with_kv_cache(
        q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
        logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse=True)


@single_decode_with_kv_cache.register_fake
def _single_decode_fake(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale,
                        window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta):
    # Shapes only: the real call validates everything before it launches.
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0],), dtype=torch.float32)
