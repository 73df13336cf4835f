"""Autograd of jitattn.varlen_attn (non-paged).

Reads top-down: what is differentiable (the check the public functions and the autograd
registration share); `setup_context` / `backward`, which jitattn/varlen/ops.py registers as the
autograd formula of `jitattn::varlen_attn`; the opaque custom op `jitattn::varlen_attn_backward`,
whose implementation runs the backward kernels (jitattn/varlen/backward_launch.py: preprocess,
main, postprocess; no host sync, so forward + backward capture into one CUDA graph) and whose
fake kernel shapes it for torch.compile.

The gradients are those of shared/spec/varlen.md: dV = P^T dO, dS = P * (dP - D) with
D = rowsum(dO * O) - dlse (the lse gradient is exact; torch's own varlen_attn ignores it),
dQ = scale * dS K, dK = scale * dS^T Q, summed over a KV head's query heads for dK / dV (with a
soft cap, logits cap * tanh(scale * s / cap), dS also takes the slope 1 - tanh^2; with a user
score_mod, its derivative by the chain rule over its tree: jitattn/variants). Under
torch.use_deterministic_algorithms(True) the result is bitwise reproducible (an ordered dQ
accumulation). seqused_k is supported (keys past seqused_k[i] get zero gradient; torch calls it
inference-only). Paged KV (block_table) is not: as in torch, it is inference-only. The float32
torch formula it replaced is the tests' oracle: jitattn/reference_backward.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

from jitattn.varlen import backward_launch as _launch
from jitattn.varlen.variant_args import VARIANT_ARGS, variants_of

# torch's words first (its tests match them), then what to do instead.
PAGED_NOT_DIFFERENTIABLE = (
    "block_table is an inference-only parameter. varlen_attn: paged KV has no backward pass, as in "
    "torch. Call it under torch.no_grad() (or with inputs that do not require grad), or pass packed "
    "key/value (T_k, H_kv, D) with cu_seq_k for a differentiable call")


def check_differentiable(block_table) -> None:
    """Raise NotImplementedError (a RuntimeError, as torch raises) for a paged call that needs grad."""
    if block_table is not None:
        raise NotImplementedError(PAGED_NOT_DIFFERENTIABLE)


# ---------------------------------------------------------------- eager calls with grad
class EagerVarlenAttn(torch.autograd.Function):
    """varlen_attn for eager calls that need grad (non-paged): the forward launch of
    jitattn::varlen_attn and the backward launches of jitattn::varlen_attn_backward, recorded by
    autograd directly, so a trainer that never compiles does not pay the dispatcher's first-call
    import of torch._dynamo; torch.compile, functorch and dispatch modes still get the op
    (api._needs_the_op)."""

    @staticmethod
    def forward(ctx, forward, call, window_size, query, key, value):
        """`forward`: jitattn/varlen/forward.py's, as the caller (api.py) holds it; `call` the
        checked call (its tensors are query, key, value: passed again so autograd sees them);
        `window_size` as the user gave it, for the backward's own clamping."""
        out, lse = forward(call)
        ctx.save_for_backward(query, key, value, call.cu_seq_q, call.cu_seq_k, call.seqused_k, out, lse)
        ctx.scale, ctx.max_q, ctx.max_k, ctx.softcap = call.scale, call.max_q, call.max_k, call.softcap
        ctx.variants = (call.score_mod, call.mask_mod)  # constants of the call (their tensors take no grad)
        ctx.window = [int(w) for w in window_size]
        ctx.set_materialize_grads(False)  # an unused lse gets no zero gradient to fold in
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, cu_seq_q, cu_seq_k, seqused_k, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = _launch.backward(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k,
                                      seqused_k, scale=ctx.scale, window_size=ctx.window, max_q=ctx.max_q,
                                      max_k=ctx.max_k, softcap=ctx.softcap, score_mod=ctx.variants[0],
                                      mask_mod=ctx.variants[1])
        return None, None, None, dq, dk, dv  # forward, call, window_size: not differentiable


# ---------------------------------------------------------------- autograd formula of jitattn::varlen_attn
def setup_context(ctx, inputs, output) -> None:
    # (trailing defaulted arguments may be absent: they default to None)
    (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
     seqused_k, block_table, num_splits, return_lse, softcap, score_mod, mask_mod, captures) = (
        tuple(inputs) + (None,) * (18 - len(inputs)))
    check_differentiable(block_table)
    out, lse = output  # lse is (0, T_q) when the op was called without return_lse: backward recomputes it
    ctx.save_for_backward(query, key, value, cu_seq_q, cu_seq_k, seqused_k, out, lse)
    ctx.scale = scale
    ctx.max_q, ctx.max_k = max_q, max_k
    ctx.window = [int(w) for w in window_size]
    ctx.enable_gqa = enable_gqa
    ctx.softcap = softcap
    ctx.variants = (score_mod, mask_mod, captures)  # texts and tensors: constants (no grad)


def backward(ctx, grad_out: Tensor, grad_lse: Tensor | None):
    query, key, value, cu_seq_q, cu_seq_k, seqused_k, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.jitattn.varlen_attn_backward(
        grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k, ctx.scale, ctx.window,
        ctx.max_q, ctx.max_k, ctx.softcap, *ctx.variants)
    # cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k, block_table,
    # num_splits, return_lse, softcap, score_mod, mask_mod, captures: not differentiable. Shaped
    # like the call's inputs (ctx.needs_input_grad mirrors them: torch versions differ in whether
    # defaulted trailing arguments count, and the captures are a list, one None per tensor).
    rest = tuple([None] * len(n) if isinstance(n, (list, tuple)) else None for n in ctx.needs_input_grad[3:])
    return (dq, dk, dv) + rest


_BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out, "
                    "Tensor lse, Tensor cu_seq_q, Tensor cu_seq_k, Tensor? seqused_k, float? scale, "
                    "SymInt[] window_size, SymInt? max_q=None, SymInt? max_k=None, float? softcap=None, "
                    f"{VARIANT_ARGS}) -> (Tensor, Tensor, Tensor)")


@torch.library.custom_op("jitattn::varlen_attn_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def varlen_attn_backward_op(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor,
                            out: Tensor, lse: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, seqused_k: Tensor | None,
                            scale: float | None, window_size: list[int], max_q: int | None = None,
                            max_k: int | None = None, softcap: float | None = None, score_mod: str | None = None,
                            mask_mod: str | None = None,
                            captures: list[Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """max_q / max_k (the forward's) size the grid; None sizes it by T_q / T_k. Deterministic
    under torch.use_deterministic_algorithms(True), read when the op runs. softcap: the
    forward's logit soft cap (None or 0: none); score_mod / mask_mod / captures: the forward's
    variants (jitattn/varlen/variant_args.py)."""
    score, mask = variants_of(score_mod, mask_mod, captures)
    return _launch.backward(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k,
                            scale=scale, window_size=window_size, max_q=max_q, max_k=max_k, softcap=softcap,
                            score_mod=score, mask_mod=mask)


@varlen_attn_backward_op.register_fake
def _varlen_attn_backward_fake(grad_out, grad_lse, query, key, value, out, lse, cu_seq_q, cu_seq_k, seqused_k,
                               scale, window_size, max_q=None, max_k=None, softcap=None, score_mod=None,
                               mask_mod=None, captures=None):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
