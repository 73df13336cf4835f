"""Float64 (or float32) torch reference implementations: the test oracle. Run on CPU or GPU.

They implement the contracts in shared/spec/ literally, with no tiling or tricks.
"""
from __future__ import annotations

import math

import torch

LOG2E = 1.0 / math.log(2.0)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes by query head (float64), as in the ALiBi paper / FlashInfer."""
    n = 1 << (num_heads.bit_length() - 1)  # largest power of two <= num_heads
    h = torch.arange(num_heads, dtype=torch.float64)
    first = torch.pow(2.0, -8.0 * (h + 1) / n)
    rest = torch.pow(2.0, -4.0 * (2.0 * (h + 1 - n) - 1) / n)
    return torch.where(h < n, first, rest)


def rope_llama(x: torch.Tensor, positions: torch.Tensor, rope_scale: float, rope_theta: float) -> torch.Tensor:
    """Rotate-half RoPE: dims (i, i + D/2) rotated by pos * theta^(-2i/D) / rope_scale.

    x: [..., n, D] with positions [n] (broadcast over leading dims).
    """
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64, device=x.device)
    freq = torch.pow(torch.tensor(rope_theta, dtype=torch.float64), -2.0 * i / d) / rope_scale
    angle = positions.to(torch.float64)[:, None] * freq[None, :]  # [n, D/2]
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def single_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [H_q, D] in compute_dtype, lse [H_q] base 2) for shared/spec/decode.md."""
    qd, kd, vd = (t.to(compute_dtype) for t in (q, k, v))
    if kv_layout == "HND":
        kd, vd = kd.transpose(0, 1), vd.transpose(0, 1)
    kv_len, num_kv_heads, head_dim = kd.shape
    num_qo_heads = qd.shape[0]
    group = num_qo_heads // num_kv_heads
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    scale *= (q_scale or 1.0) * (k_scale or 1.0)
    if pos_encoding_mode == "ROPE_LLAMA":
        positions = torch.arange(kv_len, device=kd.device)
        rs, rt = rope_scale or 1.0, rope_theta or 1e4
        kd = rope_llama(kd.transpose(0, 1), positions, rs, rt).transpose(0, 1)
        qd = rope_llama(qd[:, None, :], positions[-1:], rs, rt)[:, 0, :]
    kd = kd.repeat_interleave(group, dim=1)  # [L, H_q, D]
    vd = vd.repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,lhd->hl", qd, kd) * scale
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    if pos_encoding_mode == "ALIBI":
        j = torch.arange(kv_len, dtype=compute_dtype, device=kd.device)
        logits = logits + alibi_slopes(num_qo_heads).to(compute_dtype).to(kd.device)[:, None] * j[None, :]
    if window_left >= 0:
        j = torch.arange(kv_len, device=kd.device)
        logits = logits.masked_fill((j < kv_len - 1 - window_left)[None, :], float("-inf"))
    out = torch.einsum("hl,lhd->hd", torch.softmax(logits, dim=-1), vd) * (v_scale or 1.0)
    lse = torch.logsumexp(logits, dim=-1) * LOG2E
    return out, lse
