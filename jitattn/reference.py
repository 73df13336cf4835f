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


def varlen_attn_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softcap: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T_q, H_q, D] in compute_dtype, lse [H_q, T_q] natural log) for shared/spec/varlen.md.

    Sequence i: query rows cu_seq_q[i]:cu_seq_q[i+1] (Lq of them) and Lk = seqused_k[i] if given,
    else cu_seq_k[i+1] - cu_seq_k[i]. Unpaged, its keys are rows cu_seq_k[i]:cu_seq_k[i]+Lk of
    key/value; with block_table, key/value are a page pool (total_pages, page_size, H_kv, D) and
    logical key c is pool[block_table[i, c // page_size], c % page_size] (cu_seq_k is unused).
    Query head h uses kv head h // (H_q // H_kv). Windows are bottom-right aligned: row r may
    attend c iff (left < 0 or c >= r + Lk - Lq - left) and (right < 0 or c <= r + Lk - Lq + right).
    Rows with no key to attend, and query rows past cu_seq_q[-1], output zeros and lse = -inf.
    softcap (None or 0: none): logits softcap * tanh(scale * q.k / softcap) before the mask.
    max_q / max_k and enable_gqa are accepted for signature parity and not used.
    """
    del max_q, max_k, enable_gqa
    total_q, num_heads_q, head_dim = query.shape
    num_heads_kv = key.shape[-2]
    group = num_heads_q // num_heads_kv
    scale = (1.0 / math.sqrt(head_dim)) if scale is None else float(scale)
    left, right = (int(w) for w in window_size)
    device = query.device
    starts_q = [int(x) for x in cu_seq_q.tolist()]
    starts_k = None if cu_seq_k is None else [int(x) for x in cu_seq_k.tolist()]
    used = None if seqused_k is None else [int(x) for x in seqused_k.tolist()]
    out = torch.zeros(total_q, num_heads_q, head_dim, dtype=compute_dtype, device=device)
    lse = torch.full((num_heads_q, total_q), float("-inf"), dtype=compute_dtype, device=device)
    for i in range(len(starts_q) - 1):
        q0, q1 = starts_q[i], starts_q[i + 1]
        len_q = q1 - q0
        len_k = used[i] if used is not None else starts_k[i + 1] - starts_k[i]
        if len_q <= 0 or len_k <= 0:
            continue  # every row of the sequence has no key: zeros and -inf, already there
        c = torch.arange(len_k, device=key.device)
        if block_table is not None:
            page_size = key.shape[1]
            pages = block_table[i].to(device=key.device, dtype=torch.long)[c // page_size]
            k, v = key[pages, c % page_size], value[pages, c % page_size]  # [Lk, H_kv, D]
        else:
            k0 = starts_k[i]
            k, v = key[k0 : k0 + len_k], value[k0 : k0 + len_k]
        qd = query[q0:q1].to(device=device, dtype=compute_dtype)  # [Lq, H_q, D]
        kd = k.to(device=device, dtype=compute_dtype).repeat_interleave(group, dim=1)  # [Lk, H_q, D]
        vd = v.to(device=device, dtype=compute_dtype).repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qd, kd) * scale  # [H_q, Lq, Lk]
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        r = torch.arange(len_q, device=device)[:, None]
        col = torch.arange(len_k, device=device)[None, :]
        allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
        if left >= 0:
            allowed &= col >= r + len_k - len_q - left
        if right >= 0:
            allowed &= col <= r + len_k - len_q + right
        logits = logits.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [H_q, Lq]; -inf where a row has no key
        finite = torch.isfinite(row_lse)
        probs = torch.exp(logits - torch.where(finite, row_lse, 0.0)[..., None])
        probs = torch.where(allowed[None] & finite[..., None], probs, 0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vd)
        lse[:, q0:q1] = row_lse
    return out, lse
