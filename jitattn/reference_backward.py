"""The torch backward of varlen_attn (float32 or float64): the test oracle of the backward kernels (never a
runtime path; jitattn/varlen_backward_launch.py runs the kernels). Plain torch ops, chunked, on
any device; it syncs once (the sequence metadata is read on the host).

For sequence i (query rows q0:q0+Lq, keys k0:k0+Lk, Lk = seqused_k[i] if given), query head h and
its kv head h // (H_q // H_kv), with the window mask of shared/spec/varlen.md (bottom-right aligned):

    P  = exp(scale * Q K^T - lse)             (0 where masked, and on rows with lse = -inf)
    (with a soft cap c: exp(c * tanh(scale * Q K^T / c) - lse), and dS below times 1 - tanh^2)
    dV = P^T dO        dP = dO V^T        D = rowsum(dO * O) - dlse
    dS = P * (dP - D)  dQ = scale * dS K  dK = scale * dS^T Q

summed over the query heads of a kv head's group for dK / dV. The lse gradient (dlse) is exact
(d lse_r / d s_rc = P_rc). The work goes one sequence and at most MAX_CHUNK_ROWS query rows at a
time, each chunk's float32 logits at most CHUNK_ELEMENTS (H_q x rows x keys), and only over the
keys the chunk's window can see: memory stays bounded for long (16k+) sequences.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

MAX_CHUNK_ROWS = 1024
CHUNK_ELEMENTS = 1 << 25  # float32 logits per chunk (128 MiB); a few tensors of this size are live at once


def varlen_attn_backward(
    grad_out: Tensor,
    grad_lse: Tensor | None,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor | None,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    seqused_k: Tensor | None = None,
    *,
    scale: float | None = None,
    window_size=(-1, -1),
    softcap: float | None = None,
    max_rows: int = MAX_CHUNK_ROWS,
    chunk_elements: int = CHUNK_ELEMENTS,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the dtypes (and layouts) of query, key, value, for arguments that passed
    varlen_attn's checks (unpaged). lse (H_q, T_q) natural log as the forward returned it; None
    or (0, T_q) recomputes it from the logits. grad_lse None or (0, T_q) means no lse gradient.
    Query rows outside every sequence, key/value rows outside every sequence or past
    seqused_k[i], and rows with no visible key get zero gradient. softcap (None or 0: none): the
    forward's logits softcap * tanh(scale * q.k / softcap). Runs on any device, in
    compute_dtype (float64: the GPU tests' oracle for sequences too long for autograd)."""
    _, heads_q, head_dim = query.shape
    heads_kv = key.shape[1]
    group = heads_q // heads_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    left, right = (int(w) for w in window_size)
    have_lse = lse is not None and lse.shape[0] == heads_q
    have_dlse = grad_lse is not None and grad_lse.shape[0] == heads_q
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    num_seqs = cu_seq_q.shape[0] - 1
    metadata = [cu_seq_q, cu_seq_k] + ([] if seqused_k is None else [seqused_k])
    host = torch.cat([t.to(torch.int64) for t in metadata]).tolist()  # the one sync
    starts_q, starts_k = host[:num_seqs + 1], host[num_seqs + 1:2 * num_seqs + 2]
    used = None if seqused_k is None else host[2 * num_seqs + 2:]
    device = query.device

    def heads_first(t: Tensor, rows: slice) -> Tensor:
        """(rows, H_q, D) -> (H_kv, group * rows, D) in compute_dtype: a kv head's query heads side by side."""
        return t[rows].to(compute_dtype).permute(1, 0, 2).reshape(heads_kv, -1, head_dim)

    def row_stat(t: Tensor, rows: slice) -> Tensor:
        """(H_q, T_q) -> (H_kv, group, rows) in compute_dtype."""
        return t[:, rows].to(compute_dtype).reshape(heads_kv, group, -1)

    for i in range(num_seqs):
        q0, len_q = starts_q[i], starts_q[i + 1] - starts_q[i]
        k0 = starts_k[i]
        len_k = used[i] if used is not None else starts_k[i + 1] - k0
        if len_q <= 0 or len_k <= 0:
            continue  # no query sees a key: every gradient of the sequence is zero
        offset = len_k - len_q  # row r sees keys [r + offset - left, r + offset + right]
        k = key[k0:k0 + len_k].to(compute_dtype).transpose(0, 1)  # (H_kv, Lk, D)
        v = value[k0:k0 + len_k].to(compute_dtype).transpose(0, 1)
        dk_acc = torch.zeros(heads_kv, len_k, head_dim, dtype=compute_dtype, device=device)
        dv_acc = torch.zeros_like(dk_acc)
        step = max(1, min(max_rows, chunk_elements // (heads_q * len_k)))
        for r0 in range(0, len_q, step):
            r1 = min(len_q, r0 + step)
            n = r1 - r0
            c0 = 0 if left < 0 else max(0, r0 + offset - left)  # the keys any row of the chunk sees
            c1 = len_k if right < 0 else min(len_k, r1 - 1 + offset + right + 1)
            if c1 <= c0:
                continue  # no row of the chunk sees a key: zero gradient
            m = c1 - c0
            rows = slice(q0 + r0, q0 + r1)
            q = heads_first(query, rows)  # (H_kv, group*n, D)
            kc, vc = k[:, c0:c1], v[:, c0:c1]
            s = torch.matmul(q, kc.transpose(1, 2)).mul_(scale).view(heads_kv, group, n, m)
            if softcap:  # s = softcap * tanh(x / softcap); ds/dx = 1 - tanh^2 (`slope`)
                th = s.div_(softcap).tanh_()
                slope = (1 - th * th).view(heads_kv, group * n, m)
                s = th.mul(softcap)
            partial = (left >= 0 and c0 < r1 - 1 + offset - left) or (right >= 0 and c1 - 1 > r0 + offset + right)
            if partial:
                r = torch.arange(r0, r1, device=device)[:, None] + offset
                c = torch.arange(c0, c1, device=device)[None, :]
                hidden = torch.zeros(n, m, dtype=torch.bool, device=device)
                if left >= 0:
                    hidden |= c < r - left
                if right >= 0:
                    hidden |= c > r + right
                s.masked_fill_(hidden, float("-inf"))
            row_lse = row_stat(lse, rows) if have_lse else torch.logsumexp(s, dim=-1)
            # A row with no visible key (lse = -inf) gets P = exp(s - inf) = 0: it contributes nothing.
            row_lse = row_lse.masked_fill(torch.isneginf(row_lse), float("inf"))
            p = s.sub_(row_lse[..., None]).exp_().view(heads_kv, group * n, m)
            do = heads_first(grad_out, rows)
            d = (do * heads_first(out, rows)).sum(-1)  # (H_kv, group*n)
            if have_dlse:
                d -= row_stat(grad_lse, rows).reshape(heads_kv, -1)
            dv_acc[:, c0:c1].baddbmm_(p.transpose(1, 2), do)
            ds = torch.matmul(do, vc.transpose(1, 2)).sub_(d[..., None]).mul_(p)  # (H_kv, group*n, m)
            if softcap:
                ds.mul_(slope)
            dk_acc[:, c0:c1].baddbmm_(ds.transpose(1, 2), q, alpha=scale)
            dq_chunk = torch.matmul(ds, kc).mul_(scale)  # (H_kv, group*n, D)
            dq[rows] = dq_chunk.view(heads_q, n, head_dim).transpose(0, 1).to(dq.dtype)
        dk[k0:k0 + len_k] = dk_acc.transpose(0, 1).to(dk.dtype)
        dv[k0:k0 + len_k] = dv_acc.transpose(0, 1).to(dv.dtype)
    return dq, dk, dv
