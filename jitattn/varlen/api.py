"""jitattn.varlen_attn / varlen_attn_out: a drop-in for torch.nn.attention.varlen.

See shared/spec/varlen.md. The public functions: each checks its arguments once into a VarlenCall
(jitattn/varlen/checks.py) for `forward` (jitattn/varlen/forward.py: spec -> module -> launch),
which the eager call and the registered custom ops (jitattn/varlen/ops.py) share.

Eager calls skip the torch.library dispatcher (its Python custom-op path costs more than the
whole launch, and its first call imports torch._dynamo); eager calls that autograd must record
(an input requires grad) go through `EagerVarlenAttn` (jitattn/varlen/backward.py), a plain
autograd.Function with the op's launches and formula. Under torch.compile, Python dispatch modes
and functorch transforms the public functions call the registered ops instead (`_needs_the_op`):
the compiler treats them as opaque and shapes them through their fake kernels, and a mode (an op
logger, FakeTensorMode) sees `jitattn.varlen_attn` / `jitattn.varlen_attn_out` as torch's sees
its own ops.
The ops are registered on first use of either (`ops_registered`), or by `import jitattn.varlen.ops`.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from jitattn.kernel import call_memo, evict_oldest
from jitattn.lazy_ops import trace_time_constant
from jitattn.varlen.checks import AuxRequest, needs_grad, varlen_call
from jitattn.varlen.forward import WARM_ENTRIES, forward, remembered, run_remembered, warm_forward, warm_key

__all__ = ["AuxRequest", "varlen_attn", "varlen_attn_out"]
_NO_CONTEXT = contextlib.nullcontext()


@trace_time_constant
def ops_registered() -> bool:
    """Register the custom ops (import jitattn/varlen/ops.py) on first use: registering three
    torch.library ops costs more than the rest of an eager first call, which never uses them.
    Under torch.compile dynamo runs this at trace time (jitattn/lazy_ops.py), so the ops
    exist before the call to them is traced."""
    import jitattn.varlen.ops  # noqa: F401

    return True


def _needs_the_op() -> bool:
    """Whether a call must go through the custom op: torch.compile (and export) trace it, Python
    dispatch modes (FakeTensorMode, a FlopCounter, an op logger) and functorch transforms must see
    it. Plain eager calls skip the dispatcher."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._are_functorch_transforms_active())


def _variant_op_args(score_mod, mask_mod) -> tuple:
    """The ops' trailing variant arguments (jitattn/varlen/variant_args.py): none without variants;
    under torch.compile the tracing runs outside the graph."""
    if score_mod is None and mask_mod is None:
        return ()
    from jitattn.varlen import variant_args

    if torch.compiler.is_compiling():
        return variant_args.op_arguments_outside_trace(score_mod, mask_mod)
    return variant_args.op_arguments(score_mod, mask_mod)


def _eager(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
           block_table, num_splits, out, return_aux, softcap, score_mod, mask_mod):
    """(out, lse) of an eager call without grad: a warm call (its shapes, scalars and variants seen
    before: forward.warm_key) launches its remembered plan and skips the checks and the planning."""
    memo = warm_key(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
                    block_table, num_splits, out, return_aux, softcap, score_mod, mask_mod)
    result = None if memo is None else warm_forward(memo, query, key, value, cu_seq_q, cu_seq_k, seqused_k,
                                                    block_table, out, score_mod, mask_mod)
    if result is None:
        call = varlen_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                           enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=num_splits,
                           out=out, return_aux=return_aux, softcap=softcap, score_mod=score_mod, mask_mod=mask_mod)
        result = forward(call) if memo is None else forward(call, remember_as=memo)
    return result


class _WarmGradCall(NamedTuple):
    """What EagerVarlenAttn reads of a checked call, for a warm one: this call's tensors, variants
    and sizes, and the scale and soft cap the checks resolved (None: 1 / sqrt(D); None: 0) for
    its key the first time."""

    cu_seq_q: torch.Tensor | None
    cu_seq_k: torch.Tensor | None
    seqused_k: torch.Tensor | None
    scale: float
    max_q: int
    max_k: int
    softcap: float
    score_mod: object
    mask_mod: object


# Eager calls with grad, warm as the no-grad ones are: forward.py remembers the plan under the
# call's warm_key (which holds requires_grad and the grad mode, so these keys are their own), and
# this memo the checked scale and soft cap beside it. A training step's layers then skip the checks and
# the planning, which otherwise cost its forward more host time than the launch itself
# (notes/variants-h100.md, "What the backward column measures").
_warm_grad: dict = call_memo()
_WITH_LSE = AuxRequest(lse=True)  # the backward needs the forward's lse


def _eager_with_grad(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                     seqused_k, block_table, num_splits, softcap, score_mod, mask_mod):
    """(out, lse) of an eager call that autograd records: the op's launches and formula without
    the dispatcher (jitattn/varlen/backward.py EagerVarlenAttn), warm when its key was seen."""
    from jitattn.varlen.backward import EagerVarlenAttn, check_differentiable

    check_differentiable(block_table)
    memo = warm_key(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa, seqused_k,
                    block_table, num_splits, None, _WITH_LSE, softcap, score_mod, mask_mod)
    launch = None if memo is None else remembered(memo)
    checked = None if launch is None else _warm_grad.get(memo)
    if checked is not None:
        call = _WarmGradCall(cu_seq_q, cu_seq_k, seqused_k, checked[0], max_q, max_k, checked[1], score_mod, mask_mod)
        run = functools.partial(_run_warm, launch, query, key, value)
        return EagerVarlenAttn.apply(run, call, list(window_size), query, key, value)
    call = varlen_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                       enable_gqa=enable_gqa, seqused_k=seqused_k, num_splits=num_splits, return_aux=_WITH_LSE,
                       softcap=softcap, score_mod=score_mod, mask_mod=mask_mod)
    run = forward if memo is None else functools.partial(forward, remember_as=memo)
    result = EagerVarlenAttn.apply(run, call, list(window_size), query, key, value)
    if memo is not None and remembered(memo) is not None:  # planned, and ready as given (forward.py)
        if len(_warm_grad) >= WARM_ENTRIES:
            evict_oldest(_warm_grad)
        _warm_grad[memo] = (call.scale, call.softcap)
    return result


def _run_warm(launch, query, key, value, call: _WarmGradCall):
    """EagerVarlenAttn's forward launch for a warm call: the remembered plan on this call's tensors."""
    return run_remembered(launch, query, key, value, call.cu_seq_q, call.cu_seq_k, call.seqused_k, None, None,
                          call.score_mod, call.mask_mod)


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    score_mod=None,
    mask_mod=None,
):
    """Attention over packed variable-length sequences.

    query (T_q, H_q, D); key/value (T_k, H_kv, D), or with block_table a page pool
    (total_pages, page_size, H_kv, D); cu_seq_q/cu_seq_k int32 (N+1,) sequence starts. Returns
    out (T_q, H_q, D) in query's dtype, or (out, lse) with return_aux=AuxRequest(lse=True), lse
    (H_q, T_q) float32 natural log. Windows are (left, right), bottom-right aligned; -1 is
    unbounded. num_splits=1 makes a sequence's result independent of the rest of the batch.
    out takes query's layout (torch.empty_like(query), as torch's). Differentiable in query, key,
    value unless paged (jitattn/varlen/backward.py), and, beyond torch (whose newest lse is not
    differentiable), through lse too; seqused_k with grad is a superset as well.
    softcap (beyond torch's API, FlashAttention's name and meaning): logits become
    softcap * tanh(scale * q.k / softcap) (Gemma-2's attn_logit_softcapping); None or 0: none.
    score_mod(score, b, h, q_idx, kv_idx) -> score and mask_mod(b, h, q_idx, kv_idx) -> bool
    (beyond torch's API, FlexAttention's signatures: docs/variants.md): b the sequence's index,
    h the query head, kv_idx the key's position in its sequence, q_idx the query's, aligned
    bottom-right like the windows (row + k_len - q_len); score is scale * q.k. Traced once into
    an expression tree that jitattn compiles into the forward and backward kernels; tensors they
    read are kernel arguments (new values never recompile). Windows, GQA, seqused_k, lse and
    num_splits compose with them; softcap and score_mod do not (write the cap in the score_mod).
    """
    want_lse = return_aux is not None and getattr(return_aux, "lse", False) is True
    grad = needs_grad(query, key, value)
    through_op = _needs_the_op()
    if grad and not through_op:
        # Eager with grad: the op's launches and formula without the dispatcher, whose first
        # custom-op call imports torch._dynamo (why: notes/first-call.md).
        out, lse = _eager_with_grad(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                                    enable_gqa, seqused_k, block_table, num_splits, softcap, score_mod, mask_mod)
    elif grad or through_op:
        # The op carries the autograd formula, which needs the lse: asked for whenever grad is.
        ops_registered()
        if grad:
            from jitattn.varlen.backward import check_differentiable

            check_differentiable(block_table)
        out, lse = torch.ops.jitattn.varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, list(window_size), enable_gqa,
            seqused_k, block_table, num_splits, want_lse or grad, softcap, *_variant_op_args(score_mod, mask_mod))
    else:
        out, lse = _eager(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                          seqused_k, block_table, num_splits, None, return_aux, softcap, score_mod, mask_mod)
    return (out, lse) if want_lse else out


def varlen_attn_out(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: AuxRequest | None = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    softcap: float | None = None,
    score_mod=None,
    mask_mod=None,
):
    """varlen_attn writing into `out` (T_q, H_q, D), query's dtype and device; returns `out`, or
    (out, lse) with return_aux=AuxRequest(lse=True). Rows of `out` outside every sequence are
    left as they were. Not differentiable (as torch's): inputs that require grad are read as
    constants, and autograd records nothing (use varlen_attn for a backward pass). softcap as
    for varlen_attn, and score_mod / mask_mod."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor of query's shape (T_q, H_q, D), got {type(out).__name__}")
    want_lse = return_aux is not None and getattr(return_aux, "lse", False) is True
    if _needs_the_op():
        # The op has no autograd formula: what it writes and returns is not differentiable.
        ops_registered()
        lse = torch.ops.jitattn.varlen_attn_out(
            out, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, list(window_size), enable_gqa,
            seqused_k, block_table, num_splits, want_lse, softcap, *_variant_op_args(score_mod, mask_mod))
    else:
        # no_grad: the kernel's writes are no autograd op anyway; the copy into an `out` the
        # kernel cannot write in place (and a leaf `out` that requires grad) must not be one either.
        with torch.no_grad() if needs_grad(out, query, key, value) else _NO_CONTEXT:
            out, lse = _eager(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                              seqused_k, block_table, num_splits, out, return_aux, softcap, score_mod, mask_mod)
    return (out, lse) if want_lse else out
