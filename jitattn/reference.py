"""Float64 (or float32) torch reference implementations: the test oracle. Run on CPU or GPU.

They implement the contracts in shared/spec/ literally, with no tiling or tricks.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

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
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
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
    score_mod(score, b, h, q_idx, kv_idx) / mask_mod(b, h, q_idx, kv_idx) (FlexAttention's
    signatures, issue 46): b is the sequence, h the query head, kv_idx the key's position in its
    sequence and q_idx = r + Lk - Lq (bottom-right aligned, as the windows). score_mod's score is
    scale * q.k and its result replaces it (a soft cap then caps that result); mask_mod's False, a
    window's exclusion and a score of -inf all hide the key. Both are called on broadcast index
    tensors (`evaluate_mod`), so the functions FlexAttention users write work unchanged.
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
        positions = (_positions(i, num_heads_q, len_q, len_k, device)
                     if score_mod is not None or mask_mod is not None else None)
        if score_mod is not None:
            logits = evaluate_mod(score_mod, "score_mod", (logits, *positions), logits.shape).to(compute_dtype)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        r = torch.arange(len_q, device=device)[:, None]
        col = torch.arange(len_k, device=device)[None, :]
        allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
        if left >= 0:
            allowed &= col >= r + len_k - len_q - left
        if right >= 0:
            allowed &= col <= r + len_k - len_q + right
        allowed = allowed.expand(num_heads_q, len_q, len_k)
        if mask_mod is not None:
            visible = evaluate_mod(mask_mod, "mask_mod", positions, allowed.shape)
            if visible.dtype != torch.bool:
                raise TypeError(f"mask_mod must return a bool tensor, got {visible.dtype}")
            allowed = allowed & visible
        if score_mod is not None:
            # a score_mod's -inf hides the key like a mask (and, masked, passes no NaN gradient)
            allowed = allowed & ~torch.isneginf(logits.detach())
        logits = logits.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # [H_q, Lq]; -inf where a row has no key
        finite = torch.isfinite(row_lse)
        probs = torch.exp(logits - torch.where(finite, row_lse, 0.0)[..., None])
        probs = torch.where(allowed & finite[..., None], probs, 0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vd)
        lse[:, q0:q1] = row_lse
    return out, lse


def _positions(seq: int, num_heads: int, len_q: int, len_k: int, device) -> tuple[torch.Tensor, ...]:
    """(b, h, q_idx, kv_idx) of sequence `seq` as int64 tensors that broadcast to (H_q, Lq, Lk):
    b 0-d, h (H_q, 1, 1), q_idx (1, Lq, 1) bottom-right aligned (r + Lk - Lq), kv_idx (1, 1, Lk)."""
    b = torch.tensor(seq, device=device)
    h = torch.arange(num_heads, device=device).view(-1, 1, 1)
    q_idx = (torch.arange(len_q, device=device) + (len_k - len_q)).view(1, -1, 1)
    kv_idx = torch.arange(len_k, device=device).view(1, 1, -1)
    return b, h, q_idx, kv_idx


def evaluate_mod(fn: Callable, name: str, args: tuple, shape: torch.Size) -> torch.Tensor:
    """fn(*args) over every (h, q_idx, kv_idx) of one sequence, as a tensor of `shape`.

    FlexAttention's functions are written for scalar indices. Called on broadcast index tensors
    most of them (arithmetic, torch.where, `bias[h, q_idx - kv_idx]`, `doc_id[q_idx]`) already
    compute every element at once. One that does not broadcast (`bias[h][q_idx]` indexes bias's
    first dim twice) raises or gives a result of another shape: that one runs under torch.vmap,
    as torch's own math reference runs them all (torch/_higher_order_ops/flex_attention.py).
    """
    device = args[-1].device
    try:
        with _BoundsCheckedIndexing():
            result = torch.as_tensor(fn(*args), device=device)
        if result.dim() <= len(shape):
            return torch.broadcast_to(result, shape)
    except (IndexError, RuntimeError, ValueError):
        pass  # the vmap below runs it again and raises its error if it is one
    result = _vmapped(fn, args)
    if result.shape != shape:
        raise ValueError(f"{name} must return one value per (b, h, q_idx, kv_idx); under torch.vmap it "
                         f"returned shape {tuple(result.shape)} for {tuple(shape)} positions")
    return result


class _BoundsCheckedIndexing(TorchFunctionMode):
    """`captured[i0, i1, ...]` with index tensors raises IndexError when an index is out of range,
    read on the host first: on a GPU the indexing itself would fail by a device-side assert, which
    ends the process, so the broadcast attempt of a function that needs vmap could not fall back."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            tensor, index = args[0], args[1]
            index = index if isinstance(index, tuple) else (index,)
            if all(isinstance(i, (int, torch.Tensor)) and not isinstance(i, bool) for i in index):
                for dim, i in enumerate(index[: tensor.dim()]):
                    if isinstance(i, torch.Tensor) and i.numel() and i.dtype != torch.bool:
                        size = tensor.shape[dim]
                        if int(i.min()) < -size or int(i.max()) >= size:
                            raise IndexError(f"index out of range for dim {dim} of size {size}")
        return func(*args, **(kwargs or {}))


def _vmapped(fn: Callable, args: tuple) -> torch.Tensor:
    """fn under three nested torch.vmap (over h, q_idx, kv_idx; b is one sequence's 0-d index),
    with torch's rewrite of `tensor[index_tensor]` that vmap needs (TransformGetItemToIndex)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    *score, b, h, q_idx, kv_idx = args
    score_dims = (0,) if score else ()
    mapped = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
        mapped = torch.vmap(mapped, in_dims=score_dims + dims)
    with TransformGetItemToIndex():
        result = mapped(*score, b, h.flatten(), q_idx.flatten(), kv_idx.flatten())
    return result
