"""The varlen APIs as torch.library custom ops, with fake kernels and the autograd formula.

torch.compile sees `jitattn::varlen_attn` and `jitattn::varlen_attn_out` (mutates `out`), defined
here (`jitattn::single_decode_with_kv_cache` is defined in jitattn/decode/api.py, so a decode-only
process does not pay for importing the varlen side: notes/host-time.md), as opaque ops whose output shapes
come from their fake kernels, so compiled graphs have no break; the real kernels allocate through
torch's caching allocator on the current stream and never sync, so CUDA graphs capture them. The
public functions call these ops only while compiling or recording grad; eager calls go straight
to `forward`.

`jitattn::varlen_attn` has an autograd formula (jitattn/varlen/backward.py; not for block_table);
`jitattn::varlen_attn_out` has none, like torch's out variant.

Op arguments are what the schema language can say: window_size is a list of two ints, return_aux
becomes return_lse, and ops always return lse (an empty (0, T_q) tensor when it was not asked for).
`softcap` (jitattn's logit soft cap, beyond torch's API) and the variants (a traced score_mod /
mask_mod as its canonical text, their captured tensors as a list: jitattn/varlen/variant_args.py)
come last with defaults, so calls written for torch's argument list still bind.
"""
from __future__ import annotations

import torch
from torch import Tensor

from jitattn.varlen import backward as _backward
from jitattn.varlen.checks import AuxRequest, VarlenCall, varlen_call
from jitattn.varlen.variant_args import VARIANT_ARGS, variants_of
from jitattn.varlen.forward import forward


def _call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
          block_table, num_splits, return_lse, softcap, score_mod, mask_mod, captures, out=None) -> VarlenCall:
    """The checked call of an op's arguments (the schema's order; return_lse for return_aux; the
    variants as their canonical texts and captured tensors)."""
    score, mask = variants_of(score_mod, mask_mod, captures)
    return varlen_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                       window_size=tuple(window_size), enable_gqa=enable_gqa, seqused_k=seqused_k,
                       block_table=block_table, num_splits=num_splits, out=out,
                       return_aux=AuxRequest(lse=True) if return_lse else None, softcap=softcap,
                       score_mod=score, mask_mod=mask)


# The schemas, spelled out: a list of tensors that may be absent (the variants' captures) is
# beyond what torch infers from type hints. torch's argument list first, then softcap and the
# variants with defaults, so calls written for torch's argument list still bind.
_ARGS = ("Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, SymInt max_q, SymInt max_k, "
         "float? scale, SymInt[] window_size, bool enable_gqa, Tensor? seqused_k, Tensor? block_table, "
         "SymInt? num_splits, bool return_lse, float? softcap=None, " + VARIANT_ARGS)


@torch.library.custom_op("jitattn::varlen_attn", mutates_args=(), schema=f"({_ARGS}) -> (Tensor, Tensor)")
def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None,
                max_q: int, max_k: int, scale: float | None, window_size: list[int], enable_gqa: bool,
                seqused_k: Tensor | None, block_table: Tensor | None, num_splits: int | None,
                return_lse: bool, softcap: float | None = None, score_mod: str | None = None,
                mask_mod: str | None = None, captures: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    return forward(_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                         seqused_k, block_table, num_splits, return_lse, softcap, score_mod, mask_mod, captures))


@varlen_attn.register_fake
def _varlen_attn_fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                      seqused_k, block_table, num_splits, return_lse, softcap=None, score_mod=None, mask_mod=None,
                      captures=None):
    _call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
          block_table, num_splits, return_lse, softcap, score_mod, mask_mod, captures)
    return torch.empty_like(query), _lse_like(query, return_lse)  # the query's layout, as eager's


# Backward (non-paged): jitattn/varlen/backward.py, itself the opaque op jitattn::varlen_attn_backward.
varlen_attn.register_autograd(_backward.backward, setup_context=_backward.setup_context)


@torch.library.custom_op("jitattn::varlen_attn_out", mutates_args=("out",),
                         schema=f"(Tensor(a0!) out, {_ARGS}) -> Tensor")
def varlen_attn_out(out: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                    cu_seq_k: Tensor | None, max_q: int, max_k: int, scale: float | None, window_size: list[int],
                    enable_gqa: bool, seqused_k: Tensor | None, block_table: Tensor | None,
                    num_splits: int | None, return_lse: bool, softcap: float | None = None,
                    score_mod: str | None = None, mask_mod: str | None = None,
                    captures: list[Tensor] | None = None) -> Tensor:
    _, lse = forward(_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                           seqused_k, block_table, num_splits, return_lse, softcap, score_mod, mask_mod, captures,
                           out))
    return lse


@varlen_attn_out.register_fake
def _varlen_attn_out_fake(out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                          enable_gqa, seqused_k, block_table, num_splits, return_lse, softcap=None, score_mod=None,
                          mask_mod=None, captures=None):
    _call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
          block_table, num_splits, return_lse, softcap, score_mod, mask_mod, captures, out)
    return _lse_like(query, return_lse)


def _lse_like(query: Tensor, return_lse: bool) -> Tensor:
    heads = query.shape[1] if return_lse else 0
    return query.new_empty((heads, query.shape[0]), dtype=torch.float32)
