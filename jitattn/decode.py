"""jitattn.single_decode_with_kv_cache: a drop-in for FlashInfer's function of that name.

Reads top-down: validate -> spec -> module -> launch. See shared/spec/decode.md.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from jitattn import _checks as check
from jitattn._kernel import DecodeKernel
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.jit.spec import DecodeSpec

LOG2E = 1.4426950408889634
MAX_CHUNKS = 256  # keep in sync with templates/decode/kernels.cu.j2 (max_chunks)
MIN_CHUNK_TILES = 2  # shortest split chunk, in pipeline tiles (see _split)
ROPE_FULL_WAVE_TILES = 24  # RoPE, 16-bit K/V, D128: a full wave from this many tiles per CTA
LAYOUTS = ("NHD", "HND")
POS_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")

_KV_DOC = "[kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND)"
# call shape and device -> (kernel, group tiles, half a wave of CTAs, None or (CTAs in a wave,
# full_wave_min_tiles): see split_budget)
_kernels: dict[tuple, tuple] = {}


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
    if torch.compiler.is_compiling():  # the registered op (end of this file): opaque to the compiler
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
    chunk_len, num_chunks = _split(rows, ctas_per_chunk, kernel.tile_rows, budget)

    q_factor = scale / cap if cap > 0 else scale * LOG2E
    # A split's partials are merged by a second kernel (merge_chunks, a programmatic dependent
    # launch). Merging inside the launch instead, with each KV head's chunks as one thread-block
    # cluster reading each other's shared memory, measured slower on the H200: clusters
    # constrain where CTAs run (32/8 at 32k 50.1 vs 38.6 us, fp8 32/32 at 32k 86 vs 68) and saved
    # under 0.5 us where they did not hurt. The last CTA of each KV head merging after a fence
    # and an atomic count measured no faster than the dependent launch (stand-in kernels as in
    # tools/event_floor.cu, 128 CTAs into 8 merges: 5.02 vs 5.06 us between events), and a merge
    # with every chunk of a (head, column) in one thread's registers, max first, no shared memory,
    # measured the same as merge_chunks (32/8 at 4k 11.2 vs 11.2 us; H200, same run).
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


def full_wave_min_tiles(spec: DecodeSpec) -> int | None:
    """When a kernel's split may use a full wave of CTAs rather than half of one: when every CTA
    of the full wave would still get at least this many tiles (0: always; None: never). Half a
    wave is best wherever the loads are the bottleneck: fewer partials to write and merge, and two
    CTAs per SM already keep 64 KB of loads in flight. Kernels with per-key work beyond the dot
    products want every resident CTA to hide its latency once the work per CTA is long (H200,
    D128, cold L2 split sweeps, µs, half / full wave):
    - RoPE on 16-bit K/V at head_dim 128: full from 24 tiles per CTA. 32/32 32k 149 / 127
      (62 tiles per CTA), 32/4 128k 80.3 / 72.8 (31), 32/8 128k 146 / 129; but 32/8 32k
      39.4 / 40.8 (15.5), 32/4 32k 25.5 / 27.2, 32/8 4k 13.5 / 15.5, 32/32 4k 24.3 / 24.8 (7.8).
    - RoPE at other head dims: always full. D256 has one key block per warp (less ILP) and took
      32/32 4k 58.0 / 44.7, 32k 392 / 267; D64 32/32 4k 18.8 / 16.8, 32/8 32k 28.4 / 26.4
      (32/8 4k 11.1 / 11.8 the one case the other way).
    - fp8 K/V with RoPE, or on tensor cores (widening in registers): always full. fp8 + RoPE
      32/8 32k 38.3 / 35.2, 32/32 4k 24.4 / 22.3; fp8 on tensor cores 32/8 32k 28.4 -> 26.4 and
      128k 86.6 -> 76.1 (4k: 11.6 -> 11.9).
    Half a wave stayed best for every other kernel (fp8 on CUDA cores: 68.8 vs 69.1 at 32/32)."""
    fp8 = spec.dtype_kv.startswith("float8")
    if fp8 and (spec.tensor_cores or spec.pos_encoding == "ROPE_LLAMA"):
        return 0
    if spec.pos_encoding == "ROPE_LLAMA":
        return ROPE_FULL_WAVE_TILES if spec.head_dim == 128 else 0
    return None


def split_budget(wave: int, full_wave_tiles: int | None, cta_tiles: int) -> int:
    """CTAs the split may use (_split's capacity): a full `wave` when `cta_tiles` (the call's
    tiles over all of its KV heads and group tiles) give every CTA of it `full_wave_tiles` tiles
    (full_wave_min_tiles), half a wave otherwise."""
    return wave if full_wave_tiles is not None and cta_tiles >= full_wave_tiles * wave else wave // 2


def _split(rows: int, ctas_per_chunk: int, tile: int, capacity: int) -> tuple[int, int]:
    """(chunk_len, num_chunks) for `rows` KV rows.

    Rule: the most chunks whose CTAs fit in `capacity`, which the caller sets to half a wave
    (SMs x resident CTAs per SM, from the kernel's occupancy, / 2) or, for kernels with per-key
    work and enough of it, a full wave (`split_budget`): never a second, partial wave. No chunk shorter than
    MIN_CHUNK_TILES tiles (short chunks cost more in partials and merging than they gain), and at
    most MAX_CHUNKS. One chunk means one launch and no merge. Chunks are whole tiles, so only the
    last one has a ragged end. This holds from kv_len 1 (one chunk) to 128k, MHA and GQA alike:
    GQA has fewer CTAs per chunk, so it gets more chunks.

    Measured and not taken (H200, same run, cold L2, us): chunks of interleaved tiles (chunk c
    reads tiles c, c + n, ...: every CTA of a head in one narrow address window) ran no faster
    (32/8 4k 11.1 / 11.1, 32k 37.8 / 37.7; 32/32 32k 122.1 / 124.0), and 33 chunks at 32/8,
    which fill 2 CTAs on every SM, ran slower than this rule's 16 (32k 38.5-38.8 vs 37.6,
    8k 15.7-15.8 vs 15.0): more partials cost more than the 4 idle SMs of a 128-CTA split.
    Nor did CTAs sharing all heads' tiles evenly (132 at 32/8, 264 at 32/32), where a share that
    ends one KV head merges its states and restarts the ring on the next (its first tiles issued
    during that merge): the restart costs about a loaded memory latency, more than the 3% it
    balances (32/8 32k 40.6-40.9 vs 38.8 with the same kernel and this rule's 128 CTAs; 32/32
    32k 129.2-129.5 vs 125.0; 4k 12.4 / 24.0 vs 11.7 / 23.2), and that kernel cost 0.5-1 us more
    than this one even on this rule's split (32/8 4k 11.7 vs 11.2, 32k 38.5 vs 37.4; 32/32 4k
    23.0 vs 22.1, 32k 122.8 vs 121.8), with its 64-bit share arithmetic or its merge batch of 5
    back as here alike, and 0.3-0.7 us of it stayed with one segment and no loop: the cost is
    spread over the restructure. An even split needs the ring to run on across the head change,
    with the finished head's states merged outside the ring's memory."""
    tiles = -(-rows // tile)
    chunks = max(1, min(capacity // ctas_per_chunk, -(-tiles // MIN_CHUNK_TILES), MAX_CHUNKS))
    chunk_len = -(-tiles // chunks) * tile
    return chunk_len, -(-rows // chunk_len)



# -- torch.library: what torch.compile sees (the varlen ops live in jitattn/ops.py) ------------
# Defined from a schema string rather than with @custom_op: the same op, ~2 ms less on import,
# which every decode process pays before its first call.
_LIBRARY = torch.library.Library("jitattn", "FRAGMENT")
_LIBRARY.define(
    "single_decode_with_kv_cache(Tensor q, Tensor k, Tensor v, str kv_layout, str pos_encoding_mode, "
    "bool use_tensor_cores, float? q_scale, float? k_scale, float? v_scale, int window_left, "
    "float? logits_soft_cap, float? sm_scale, float? rope_scale, float? rope_theta) -> (Tensor, Tensor)")


def _single_decode_op(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale,
                      window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta):
    return single_decode_with_kv_cache(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale,
                                       v_scale, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                       return_lse=True)


def _single_decode_fake(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale,
                        window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta):
    # Shapes only: the real call validates everything before it launches.
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((q.shape[0],), dtype=torch.float32)


_LIBRARY.impl("single_decode_with_kv_cache", _single_decode_op, "CompositeExplicitAutograd")
torch.library.register_fake("jitattn::single_decode_with_kv_cache", _single_decode_fake, lib=_LIBRARY)
