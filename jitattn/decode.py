"""jitattn.single_decode_with_kv_cache: a drop-in for FlashInfer's function of that name.

Reads top-down: validate -> spec -> module -> launch. See shared/spec/decode.md.
"""
from __future__ import annotations

import math

import torch

from jitattn import _checks as check
from jitattn.jit import env
from jitattn.jit.loader import get_module
from jitattn.jit.spec import DecodeSpec

LOG2E = 1.4426950408889634
MAX_CHUNKS = 256  # keep in sync with templates/decode/kernels.cu.j2 (max_chunks)
CTAS_PER_SM = 4  # split target: this many CTAs per SM fill the memory pipeline (see _split)
LAYOUTS = ("NHD", "HND")
POS_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")

_modules: dict[tuple, object] = {}  # (spec fields) -> loaded module: the per-call fast path
_num_sms: dict[int, int] = {}


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
    """
    q = check.tensor("q", q, 2, "[num_qo_heads, head_dim]")
    kv_doc = "[kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND)"
    k = check.tensor("k", k, 3, kv_doc)
    v = check.tensor("v", v, 3, kv_doc)
    hnd = check.choice("kv_layout", kv_layout, LAYOUTS) == "HND"
    check.choice("pos_encoding_mode", pos_encoding_mode, POS_MODES)
    check.boolean("use_tensor_cores", use_tensor_cores)
    check.boolean("return_lse", return_lse)
    window_left = check.integer("window_left", window_left, -1)
    scale = check.positive_float("sm_scale", sm_scale, 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0)
    scale *= check.positive_float("q_scale", q_scale, 1.0) * check.positive_float("k_scale", k_scale, 1.0)
    out_scale = check.positive_float("v_scale", v_scale, 1.0)
    cap = 0.0 if logits_soft_cap is None else _soft_cap(logits_soft_cap)
    check.positive_float("rope_scale", rope_scale, 1.0)
    check.positive_float("rope_theta", rope_theta, 1e4)

    if q.dtype not in check.DTYPE_NAMES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k.dtype != v.dtype:
        raise TypeError(f"k and v must have the same dtype, got k {k.dtype} and v {v.dtype}")
    if k.dtype in check.FP8_DTYPES:
        raise NotImplementedError(f"fp8 KV cache ({k.dtype}) is not implemented yet")
    if k.dtype != q.dtype:
        raise TypeError(f"k/v dtype must match q ({q.dtype}) or be fp8, got {k.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads = (k.shape[1], k.shape[0]) if hnd else (k.shape[0], k.shape[1])
    if k.shape[2] != head_dim:
        raise ValueError(f"head_dim of k/v ({k.shape[2]}) must equal head_dim of q ({head_dim})")
    check.head_dim("q.shape[1]", head_dim)
    if num_kv_heads < 1 or num_qo_heads < 1:
        raise ValueError(f"need at least one head, got num_qo_heads={num_qo_heads}, num_kv_heads={num_kv_heads}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if kv_len < 1:
        raise ValueError(f"kv_len must be >= 1, got an empty KV cache (k shape {tuple(k.shape)})")
    if kv_len >= 2**31:
        raise ValueError(f"kv_len must be < 2**31, got {kv_len}")
    if pos_encoding_mode != "NONE":
        raise NotImplementedError(f"pos_encoding_mode={pos_encoding_mode!r} is not implemented yet")
    if use_tensor_cores:
        raise NotImplementedError("use_tensor_cores=True is not implemented yet")
    if out_scale != 1.0:
        raise NotImplementedError("v_scale is not implemented yet (it comes with fp8 KV)")
    device = check.cuda_device({"q": q, "k": k, "v": v})  # last: shape/dtype errors are testable on CPU

    group_size = num_qo_heads // num_kv_heads
    group_tile = DecodeSpec.group_tile_for(group_size)
    spec_fields = (head_dim, check.DTYPE_NAMES[q.dtype], check.DTYPE_NAMES[k.dtype], "NONE", cap > 0, group_tile)
    module = _modules.get(spec_fields)
    if module is None:
        module = _modules[spec_fields] = get_module(DecodeSpec(*spec_fields))

    q, k, v = check.vector_ready(q), check.vector_ready(k), check.vector_ready(v)
    kv_begin = max(0, kv_len - 1 - window_left) if window_left >= 0 else 0
    group_tiles = -(-group_size // group_tile)
    chunk_len, num_chunks = _split(kv_len - kv_begin, num_kv_heads * group_tiles, head_dim, device)

    out = torch.empty((num_qo_heads, head_dim), dtype=q.dtype, device=device)
    lse = torch.empty((num_qo_heads,), dtype=torch.float32, device=device) if return_lse else None
    workspace = (
        torch.empty(num_chunks * num_qo_heads * (head_dim + 1), dtype=torch.float32, device=device)
        if num_chunks > 1 else None
    )
    q_factor = scale / cap if cap > 0 else scale * LOG2E
    module.run(q, k, v, out, lse, workspace, hnd, kv_begin, kv_len, group_size, chunk_len, num_chunks,
               q_factor, cap * LOG2E)
    if env.debug():
        torch.cuda.synchronize(device)
    return (out, lse) if return_lse else out


def _soft_cap(value) -> float:
    cap = check.positive_float("logits_soft_cap", value, 0.0) if value != 0 else 0.0
    return cap


def rows_per_tile(head_dim: int) -> int:
    """Rows one pipeline stage holds: 128 threads, pow2(head_dim/8) threads per row, 4 rows each
    (mirrors TILE in templates/decode/kernels.cu.j2)."""
    lanes = 1 << (head_dim // 8 - 1).bit_length()
    return (128 // lanes) * 4


def _split(rows: int, ctas_per_chunk: int, head_dim: int, device: torch.device) -> tuple[int, int]:
    """Split rule: as many chunks as it takes to give every SM CTAS_PER_SM CTAs (one full wave),
    but never a chunk shorter than one tile and never more than MAX_CHUNKS. One chunk means one
    launch (no merge). Chunks are whole tiles so only the last one has a ragged end."""
    sms = _num_sms.get(device.index)
    if sms is None:
        sms = _num_sms[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    tile = rows_per_tile(head_dim)
    tiles = -(-rows // tile)
    wanted = -(-sms * CTAS_PER_SM // ctas_per_chunk)
    chunks = max(1, min(wanted, tiles, MAX_CHUNKS))
    chunk_len = -(-tiles // chunks) * tile
    return chunk_len, -(-rows // chunk_len)
