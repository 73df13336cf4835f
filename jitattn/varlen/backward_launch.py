"""The runtime backward of jitattn.varlen_attn: plan the launch and run the kernels
(templates/varlen/backward.cu.j2). No host sync: the grid comes from max_k and the shapes, the
lengths are read on the device, the workspace and outputs come from torch's allocator on the
current stream, so a forward + backward captures into one CUDA graph.

Workspace (allocated by the binding): the fp32 dQ accumulator plus lse and delta per row,
(T_q * H_q) * (D + 2) * 4 bytes, and in deterministic mode H_kv * (T_q * H_q / H_kv / 64 + N + 1)
ints; outputs dq, dk, dv in the inputs' dtype, every row written by the kernels (the preprocess
zeroes the key rows outside every sequence or past seqused_k: no zero fill first). With dq_kernel
(D256 on sm_90: spec.DQ_KERNEL_HEAD_DIMS) the kernels are preprocess, the dK / dV kernel and the dQ
kernel, which writes dq in q's dtype:
the workspace is lse and delta only, (T_q * H_q) * 2 * 4 bytes, no counters in either mode.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from jitattn import checks as check
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.kernel import call_memo
from jitattn.variants.window import lower_window
from jitattn.varlen import overrides
from jitattn.varlen.checks import AuxRequest, varlen_call
from jitattn.varlen.forward import captures_of
from jitattn.varlen.plan import is_hopper
from jitattn.varlen.spec import VarlenBackwardSpec, mask_map_flag, mask_map_layout

LOG2E = 1.4426950408889634
WINDOW_CLAMP = 1 << 30  # a window wider than any sequence: the kernels' 32-bit mask arithmetic stays in range

# (the call facts VarlenBackwardSpec.for_call reads, the override state) -> (run op, spec)
_kernels: dict[tuple, tuple[object, VarlenBackwardSpec]] = call_memo()


def wgmma_allowed(device: torch.device) -> bool:
    """The Hopper rung may run: sm_90, unless JITATTN_WGMMA=0 (as for the forward)."""
    return is_hopper(device) and env.wgmma_enabled()


def num_key_blocks(max_k: int, block_n: int) -> int:
    return -(-max_k // block_n)


def _writable(t: Tensor) -> bool:
    """Whether the kernels can write `t` with 16-byte rows in place."""
    per_vec = 16 // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % per_vec == 0 for s in t.stride()[:-1])


def backward(grad_out: Tensor, grad_lse: Tensor | None, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
             lse: Tensor | None, cu_seq_q: Tensor, cu_seq_k: Tensor, seqused_k: Tensor | None = None, *,
             scale: float | None = None, window_size=(-1, -1), max_q: int | None = None, max_k: int | None = None,
             deterministic: bool | None = None, softcap: float | None = None, score_mod=None,
             mask_mod=None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the dtypes and shapes of query, key, value (dq with query's strides where
    it can). lse (H_q, T_q) as the forward returned it, or None / (0, T_q): recomputed by a
    forward. grad_lse None or (0, T_q): no lse gradient. max_q / max_k: the forward's; None
    sizes the grid by T_q / T_k (correct, but a larger grid). deterministic None: under
    torch.use_deterministic_algorithms(True). softcap: the forward's (None or 0: none);
    score_mod / mask_mod: the forward's traced variants (jitattn.variants.Variant) or None."""
    total_q, heads_q, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    softcap = float(softcap or 0.0)
    # A mask_mod that is a window runs as the built-in window, as in the forward
    # (jitattn/variants/window.py).
    mask_mod, left, right = lower_window(mask_mod, int(window_size[0]), int(window_size[1]), env.lower_mask_windows())
    left, right = min(left, WINDOW_CLAMP), min(right, WINDOW_CLAMP)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if max_q is None:
        max_q = total_q
    if max_k is None:
        max_k = key.shape[0]
    if lse is None or lse.shape[0] != heads_q:
        lse = _forward_lse(query, key, value, cu_seq_q, cu_seq_k, seqused_k, max_q, max_k, scale, (left, right),
                           softcap, score_mod, mask_mod)
    if grad_lse is not None and grad_lse.shape[0] != heads_q:
        grad_lse = None
    hopper = is_hopper(query.device)
    # for_call's arguments in its order (head_dim, dtype, soft cap, deterministic, sm_90,
    # JITATTN_WGMMA there, what the call adds to a full one: its window, as for_call counts the
    # variants from their texts), then the override state (and the variants' canonical texts)
    variants = (score_mod.key_text if score_mod else "", mask_mod.key_text if mask_mod else "")
    features = frozenset({"window"}) if left >= 0 or right >= 0 else frozenset()
    facts = (head_dim, query.dtype, softcap > 0, bool(deterministic), hopper, hopper and env.wgmma_enabled(),
             features, overrides.state(), variants)
    entry = _kernels.get(facts)
    if entry is None:
        spec = VarlenBackwardSpec.for_call(head_dim, check.DTYPE_NAMES[query.dtype], *facts[2:7],
                                           score_mod=variants[0], mask_mod=variants[1])
        entry = _kernels[facts] = (get_module(spec).ops.run.default, spec, mask_map_layout(spec))
    run, spec, map_layout = entry

    # The kernels write every row of dq, dk and dv (the preprocess zeroes the key rows no CTA
    # reaches: outside every sequence, past seqused_k); with no queries nothing runs.
    fill = torch.empty_like if total_q > 0 else torch.zeros_like
    dq, dk, dv = fill(query), fill(key), fill(value)
    targets = [t if _writable(t) else fill(t, memory_format=torch.contiguous_format) for t in (dq, dk, dv)]
    q, k, v = check.vectors_ready(query, key, value)
    grad_out, out = check.vector_ready(grad_out), check.vector_ready(out)
    lse = lse.float()
    if grad_lse is not None:
        grad_lse = grad_lse.float()
    cu_seq_q, cu_seq_k = cu_seq_q.contiguous(), cu_seq_k.contiguous()
    if seqused_k is not None:
        seqused_k = seqused_k.contiguous()
    if total_q > 0:
        # dq_kernel: its grid, query tiles of 128 packed rows (backward_dq.cuh's DQ_ROWS)
        extra = (num_key_blocks(max_q * (heads_q // key.shape[1]), 128),) if spec.dq_kernel else ()
        run(grad_out, grad_lse, q, k, v, out, lse, cu_seq_q, cu_seq_k, seqused_k, targets[0], targets[1], targets[2],
            num_key_blocks(max_k, spec.block_n), left, right, scale, scale * LOG2E, softcap, bool(deterministic),
            *extra, *mask_map_flag(map_layout, max_q * (heads_q // key.shape[1]), spec.block_m,
                                   (cu_seq_q.shape[0] - 1) * num_key_blocks(max_k, spec.block_n), key.shape[1]),
            *captures_of(score_mod, mask_mod))
    for result, target in zip((dq, dk, dv), targets):
        if target is not result:
            result.copy_(target)
    return dq, dk, dv


def _forward_lse(query, key, value, cu_seq_q, cu_seq_k, seqused_k, max_q, max_k, scale, window,
                 softcap=0.0, score_mod=None, mask_mod=None) -> Tensor:
    """The lse of a forward called without it (a direct call of jitattn::varlen_attn with
    return_lse=False): computed again by the forward kernels."""
    import jitattn.varlen.forward as forward_module  # the module, so tests can stand in for its forward

    _, lse = forward_module.forward(varlen_call(
        query.detach(), key.detach(), value.detach(), cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
        window_size=window, enable_gqa=query.shape[1] != key.shape[1], seqused_k=seqused_k, num_splits=1,
        return_aux=AuxRequest(lse=True), softcap=softcap, score_mod=score_mod, mask_mod=mask_mod))
    return lse
