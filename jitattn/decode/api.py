"""jitattn.single_decode_with_kv_cache: a drop-in for FlashInfer's function of that name.

Reads top-down: validate -> spec -> module -> launch (the split: jitattn/decode/plan.py). See
shared/spec/decode.md. The op `jitattn::single_decode_with_kv_cache` that torch.compile sees is
jitattn/decode/ops.py, registered on first use (`ops_registered`: a compiled call, or call it).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from jitattn import checks as check
from jitattn.decode.launch import DecodeKernel
from jitattn.decode.plan import full_wave_min_tiles, split, split_budget
from jitattn.decode.spec import DecodeSpec
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.kernel import call_memo
from jitattn.lazy_ops import trace_time_constant

LOG2E = 1.4426950408889634
LAYOUTS = ("NHD", "HND")
POS_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")

_KV_DOC = "[kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND)"
# call shape and device -> (kernel, group tiles, half a wave of CTAs, None or (CTAs in a wave,
# full_wave_min_tiles): see split_budget)
_kernels: dict[tuple, tuple] = call_memo()


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
):
    """Attention of one query token per head over a whole KV cache.

    q: [num_qo_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim] ("NHD") or
    [num_kv_heads, kv_len, head_dim] ("HND"). Returns out [num_qo_heads, head_dim] in q's dtype,
    and with return_lse=True also lse [num_qo_heads] (float32, base 2).

    use_tensor_cores=False still runs the tensor-core kernel where it is faster: GQA groups of 4
    or more (fp8 K/V included) and RoPE with fp16/bf16 K/V (the rule and its measurements:
    DecodeSpec.for_call).
    """
    if torch.compiler.is_compiling():  # the registered op (jitattn/decode/ops.py): opaque to the compiler
        ops_registered()
        out, lse = torch.ops.jitattn.single_decode_with_kv_cache(
            q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
            logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return (out, lse) if return_lse else out
    # Host time matters here (a decode step is a few microseconds of GPU work): the common,
    # valid case is checked inline and the named checks run only to raise or to decide.
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
            and q.dim() == 2 and k.dim() == 3 and v.dim() == 3):
        check.tensor("q", q, 2, "[num_qo_heads, head_dim]")
        check.tensor("k", k, 3, _KV_DOC)
        check.tensor("v", v, 3, _KV_DOC)
    if kv_layout != "NHD":
        check.choice("kv_layout", kv_layout, LAYOUTS)
    hnd = kv_layout == "HND"
    if pos_encoding_mode != "NONE":
        check.choice("pos_encoding_mode", pos_encoding_mode, POS_MODES)
    if use_tensor_cores is not False:
        check.boolean("use_tensor_cores", use_tensor_cores)
    if return_lse is not False:
        check.boolean("return_lse", return_lse)
    if window_left != -1 or type(window_left) is not int:
        window_left = check.integer("window_left", window_left, -1)
    # Fold every logit scale into one multiplier of q (sm_scale * q_scale * k_scale, in log2 units).
    scale = 1.0 / math.sqrt(max(q.shape[1], 1)) if sm_scale is None else check.positive_float("sm_scale", sm_scale, 1.0)
    if q_scale is not None:
        scale *= check.positive_float("q_scale", q_scale, 1.0)
    if k_scale is not None:
        scale *= check.positive_float("k_scale", k_scale, 1.0)
    if v_scale is not None:
        check.positive_float("v_scale", v_scale, 1.0)
    cap = 0.0 if logits_soft_cap is None else _soft_cap(logits_soft_cap)
    if rope_scale is not None:
        check.positive_float("rope_scale", rope_scale, 1.0)
    if rope_theta is not None:
        check.positive_float("rope_theta", rope_theta, 1e4)

    dtype = q.dtype
    if dtype not in check.Q_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {dtype}")
    kv_dtype = k.dtype
    if kv_dtype != v.dtype:
        raise TypeError(f"k and v must have the same dtype, got k {kv_dtype} and v {v.dtype}")
    fp8 = kv_dtype in check.FP8_DTYPES
    if kv_dtype != dtype and not fp8:
        raise TypeError(f"k/v dtype must match q ({dtype}) or be float8_e4m3fn/float8_e5m2, got {kv_dtype}")
    kv_shape = k.shape
    if kv_shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(kv_shape)} and v {tuple(v.shape)}")
    num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads, kv_head_dim = (kv_shape[1], kv_shape[0], kv_shape[2]) if hnd else kv_shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim of k/v ({kv_head_dim}) must equal head_dim of q ({head_dim})")
    check.head_dim("q.shape[1]", head_dim)
    if fp8 and head_dim % 32:
        raise ValueError(f"head_dim (q.shape[1]) must be a multiple of 32 with fp8 k/v, got {head_dim}")
    if num_kv_heads < 1 or num_qo_heads < 1:
        raise ValueError(f"need at least one head, got num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_len < 1:
        raise ValueError(f"kv_len must be >= 1, got an empty KV cache (k shape {tuple(kv_shape)})")
    if kv_len >= 2**31:
        raise ValueError(f"kv_len must be < 2**31, got {kv_len}")
    device = q.device
    # The device check comes last, so every other error is testable with CPU tensors.
    if device.type != "cuda" or k.device != device or v.device != device:
        check.cuda_device({"q": q, "k": k, "v": v})

    group_size = num_qo_heads // num_kv_heads
    # The kernel for this call shape on this device (DecodeSpec.for_call decides tensor cores and
    # the group tile), with its group tiles and how many CTAs its split may use on the device.
    device_index = q.get_device()
    key = (head_dim, dtype, kv_dtype, pos_encoding_mode, cap > 0, group_size, use_tensor_cores, device_index)
    entry = _kernels.get(key)
    if entry is None:
        spec = DecodeSpec.for_call(head_dim, check.DTYPE_NAMES[dtype], check.DTYPE_NAMES[kv_dtype], pos_encoding_mode,
                                   cap > 0, group_size, use_tensor_cores)
        kernel = DecodeKernel(get_module(spec))
        wave, full_wave_tiles = kernel.capacity(device), full_wave_min_tiles(spec)
        entry = _kernels[key] = (kernel, -(-group_size // spec.group_tile), wave // 2,
                                 None if full_wave_tiles is None else (wave, full_wave_tiles))
    kernel, group_tiles, budget, full_wave = entry

    q, k, v = check.vectors_ready(q, k, v)
    kv_begin = kv_len - 1 - window_left if 0 <= window_left < kv_len - 1 else 0
    rows, ctas_per_chunk = kv_len - kv_begin, num_kv_heads * group_tiles
    if full_wave is not None:  # a kernel with per-key work: a full wave once each CTA gets enough
        budget = split_budget(*full_wave, -(-rows // kernel.tile_rows) * ctas_per_chunk)
    chunk_len, num_chunks = split(rows, ctas_per_chunk, kernel.tile_rows, budget)

    q_factor = scale / cap if cap > 0 else scale * LOG2E
    # A split's partials are merged by a second kernel (merge_chunks, a programmatic dependent
    # launch): merging in clusters, by the last CTA of a head, or in one thread's registers
    # measured slower or no faster (notes/decode-h200.md, "The merge of a split's partials").
    # Outputs and the split's fp32 partials ([chunks, heads, D] o, then [chunks, heads] lse)
    # come from torch's allocator, on q's device and stream. No lse asked for: none written.
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((num_qo_heads,), dtype=torch.float32) if return_lse else None
    workspace = q.new_empty((num_chunks * num_qo_heads * (head_dim + 1),), dtype=torch.float32) if num_chunks > 1 else None
    k_strides, v_strides = k.stride(), v.stride()
    if hnd:
        k_strides, v_strides = (k_strides[1], k_strides[0]), (v_strides[1], v_strides[0])
    rope_turns0, rope_ratio = (_rope_frequencies(head_dim, rope_theta, rope_scale) if pos_encoding_mode == "ROPE_LLAMA"
                               else _NO_ROPE)
    kernel.launch(q, k, v, out, lse, workspace, k_strides, v_strides, kv_begin, kv_len, group_size, group_tiles,
                  chunk_len, num_chunks, q_factor, cap * LOG2E, 1.0 if v_scale is None else v_scale,
                  rope_turns0, rope_ratio, device_index)
    if env.debug():
        torch.cuda.synchronize(device)
    return (out, lse) if return_lse else out


@trace_time_constant
def ops_registered() -> bool:
    """Register `jitattn::single_decode_with_kv_cache` (import jitattn/decode/ops.py) on first
    use: an eager call never uses it, and registering it costs a first call more than the call
    (notes/host-time.md). Under
    torch.compile dynamo runs this at trace time (jitattn/lazy_ops.py), so the op exists
    before the call to it is traced."""
    from jitattn.decode import ops

    ops.register(single_decode_with_kv_cache)
    return True


def _soft_cap(value) -> float:
    """FlashInfer's convention: 0 means no cap; otherwise a finite cap > 0."""
    return 0.0 if value == 0 and not isinstance(value, bool) else check.positive_float("logits_soft_cap", value, 0.0)


_NO_ROPE = (0.0, 0.0)  # rope_turns0/rope_ratio of kernels without RoPE (unread)


def _rope_frequencies(head_dim: int, rope_theta: float | None, rope_scale: float | None) -> tuple[float, float]:
    """(turns0, ratio): dim i's RoPE frequency in turns per position is turns0 * ratio**i, i.e.
    theta^(-2i/D) / scale / (2 pi). The kernel builds its table from these two with multiplies
    (a double pow per dim there had been a long chain at the start of every RoPE CTA)."""
    theta = 1e4 if rope_theta is None else rope_theta
    scale = 1.0 if rope_scale is None else rope_scale
    return 1.0 / (scale * 2.0 * math.pi), theta ** (-2.0 / head_dim)
