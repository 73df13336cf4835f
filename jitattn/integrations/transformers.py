"""jitattn as a transformers attention implementation: `register()` adds "jitattn" to AttentionInterface.

    import jitattn.integrations.transformers as jt
    jt.register()
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="jitattn")

Every attention call of the model becomes one `jitattn.varlen_attn` call (prefill, generation
with transformers' KV cache, training, packed sequences), so it is differentiable, compiles,
and needs no flash-attn package. How a call maps (query (B, H_q, L_q, D), key/value
(B, H_kv, L_k, D), bottom-right aligned windows, as FlashAttention's):

- no mask: each batch row is one sequence. Queries are packed (B * L_q, H_q, D); keys of an
  inference call (no grad) are read where they lie, as slots of a strided view with `seqused_k`
  (a KV cache is never copied); with grad they are packed too.
- a padding mask (the 2D (B, L_k) mask transformers hands an implementation that registers
  FlashAttention's mask function, as this one does): unpad -> varlen -> pad, as transformers'
  flash-attn integration does (queries by the mask's last L_q columns: left padding).
- packed sequences (batch 1): `cu_seq_lens_q/k` + `max_length_q/k` (DataCollatorWithFlattening
  with return_flash_attn_kwargs=True) or position_ids that restart (its default).
- `is_causal` -> window (-1, 0); `sliding_window` W -> left W - 1 (a key is seen iff
  q - k < W, as transformers' mask); `scaling` -> scale; GQA -> enable_gqa; `softcap`
  (Gemma-2's `attn_logit_softcapping`) -> varlen_attn's softcap.

Refused with an error naming the argument, never computed some other way: attention dropout
> 0, attention sinks (`s_aux`), 4D or other custom masks, and a padding mask with gaps inside a
row when a sliding window is in effect (the window would count tokens, not positions).
"""
from __future__ import annotations

import torch

NAME = "jitattn"
_DTYPES = (torch.float16, torch.bfloat16)  # what varlen_attn computes in


def register(name: str = NAME) -> str:
    """Add jitattn to transformers' AttentionInterface (and FlashAttention's padding-mask function
    to AttentionMaskInterface under the same name, so the model hands over a 2D mask or None).
    Returns the name for attn_implementation=. Safe to call more than once."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(f"jitattn.integrations.transformers needs transformers >= 5 ({exc}); "
                          "install it with `pip install 'jitattn[transformers]'`") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, L, D) in, (B, L_q, H_q, D) and no
    attention weights out."""
    _refuse(module, query, key, value, attention_mask, dropout, s_aux)
    query, key, value = _half(query, key, value)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    batch, heads_q, len_q, head_dim = query.shape
    heads_kv, len_k = key.shape[1], key.shape[2]
    common = {"scale": scaling, "window_size": _window(causal, sliding_window), "enable_gqa": heads_q != heads_kv,
              "softcap": softcap}
    if attention_mask is not None:
        out = _padded(query, key, value, attention_mask, common, windowed=common["window_size"][0] >= 0)
    else:
        packed = _packed_lengths(batch, len_q, len_k, query.device, kwargs)
        if packed is not None:
            cu, max_len = packed
            q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], head_dim) for t in (query, key, value))
            out = _varlen_attn(q, k, v, cu[0], cu[1], max_len[0], max_len[1], **common)
        else:
            out = _dense(query, key, value, common)
    return out.view(batch, len_q, heads_q, head_dim), None


def _varlen_attn(*args, **kwargs):
    """jitattn.varlen_attn (a seam: the CPU tests put the float64 reference here)."""
    import jitattn

    return jitattn.varlen_attn(*args, **kwargs)


def _refuse(module, query, key, value, attention_mask, dropout, s_aux) -> None:
    if dropout:
        raise ValueError(f"jitattn attention has no attention dropout: dropout={dropout} "
                         f"({type(module).__name__}.attention_dropout); set config.attention_dropout=0.0")
    if s_aux is not None:
        raise ValueError("jitattn attention has no attention sinks (s_aux); use another attn_implementation")
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"jitattn attention needs one head_dim for query, key and value, got query "
                         f"{query.shape[-1]}, key {key.shape[-1]}, value {value.shape[-1]}")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != query.shape[0]):
        raise ValueError(
            f"jitattn attention takes a 2D padding mask (batch, kv_len) or None, got attention_mask of shape "
            f"{tuple(attention_mask.shape)}: custom 4D masks cannot be expressed as varlen sequences (pass the 2D "
            "padding mask, or use attn_implementation='sdpa' for custom masks)")


def _half(query, key, value):
    """fp16/bf16 as they come; float32 under autocast goes to the autocast dtype (as transformers'
    flash-attn integration does); float32 otherwise is an error naming what to do."""
    if query.dtype in _DTYPES and key.dtype == query.dtype and value.dtype == query.dtype:
        return query, key, value
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return query.to(dtype), key.to(dtype), value.to(dtype)
    raise TypeError(f"jitattn attention computes in float16 or bfloat16, got query {query.dtype}, key {key.dtype}, "
                    f"value {value.dtype}: load the model with dtype=torch.bfloat16 (or float16), or run it "
                    "under torch.autocast")


def _window(causal: bool, sliding_window: int | None) -> tuple[int, int]:
    """transformers' sliding window W lets query q see key k iff q - k < W: left = W - 1."""
    left = sliding_window - 1 if sliding_window else -1
    return (left, 0) if causal else (left, left)


def _dense(query, key, value, common):
    """Each batch row one sequence of L_q queries over L_k keys."""
    batch, heads_q, len_q, head_dim = query.shape
    len_k = key.shape[2]
    device = query.device
    q = query.transpose(1, 2).reshape(batch * len_q, heads_q, head_dim)
    cu_q = torch.arange(0, (batch + 1) * len_q, len_q, dtype=torch.int32, device=device)
    grad = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
    slots = None if grad or batch == 1 else (_slots(key), _slots(value))
    if slots is not None and slots[0] is not None and slots[1] is not None and slots[0][1] == slots[1][1]:
        (k, rows), (v, _) = slots
        cu_k = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device=device)
        cu_k[-1] = (batch - 1) * rows + len_k  # the last slot ends with the tensor
        used = torch.full((batch,), len_k, dtype=torch.int32, device=device)
        return _varlen_attn(q, k, v, cu_q, cu_k, len_q, len_k, seqused_k=used, **common)
    k, v = (t.transpose(1, 2).reshape(batch * len_k, t.shape[1], head_dim) for t in (key, value))
    cu_k = torch.arange(0, (batch + 1) * len_k, len_k, dtype=torch.int32, device=device)
    return _varlen_attn(q, k, v, cu_q, cu_k, len_q, len_k, **common)


def _slots(t: torch.Tensor):
    """(B, H, L, D) read in place as (rows, H, D) token rows: batch row i is the slot starting at
    row i * (stride B / stride L), its first L rows used (the rows between belong to other heads,
    never read). (view, rows per slot), or None when the strides do not allow it (or the
    kernel could not read it without a copy)."""
    batch, heads, length, head_dim = t.shape
    s_b, s_h, s_l, s_d = t.stride()
    per_vec = 16 // t.element_size()
    if (s_d != 1 or s_l <= 0 or s_b % s_l or t.data_ptr() % 16
            or any(s % per_vec for s in (s_b, s_h, s_l))):
        return None
    rows = s_b // s_l
    view = t.as_strided(((batch - 1) * rows + length, heads, head_dim), (s_l, s_h, 1))
    return view, rows


def _padded(query, key, value, mask, common, windowed: bool):
    """Unpad by the 2D mask -> varlen -> pad (zeros on padded query rows)."""
    batch, heads_q, len_q, head_dim = query.shape
    mask = mask.to(device=query.device, dtype=torch.bool)
    if key.shape[2] > mask.shape[1]:  # a static cache longer than the mask: only the mask's keys
        key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
    len_k = key.shape[2]
    lens_k = mask.sum(-1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(torch.cumsum(lens_k, 0, dtype=torch.int32), (1, 0))
    rows_k = mask.flatten().nonzero().flatten()
    k, v = (t.transpose(1, 2).reshape(batch * len_k, t.shape[1], head_dim)[rows_k] for t in (key, value))
    q_all = query.transpose(1, 2).reshape(batch * len_q, heads_q, head_dim)
    if len_q == len_k:
        rows_q, cu_q, lens_q = rows_k, cu_k, lens_k
    elif len_q == 1:
        rows_q, cu_q, lens_q = None, torch.arange(batch + 1, dtype=torch.int32, device=query.device), None
    else:  # the last L_q positions are the queries (left padding, as transformers assumes)
        q_mask = mask[:, -len_q:]
        lens_q = q_mask.sum(-1, dtype=torch.int32)
        cu_q = torch.nn.functional.pad(torch.cumsum(lens_q, 0, dtype=torch.int32), (1, 0))
        rows_q = q_mask.flatten().nonzero().flatten()
    # One host read for the lengths (and, with a window, whether a row has gaps).
    stats = [lens_k.max(), lens_q.max() if lens_q is not None else lens_k.max()]
    if windowed:
        stats.append(((mask[:, 1:] & ~mask[:, :-1]).sum(-1) + mask[:, 0]).max())
    host = torch.stack(stats).tolist()
    if windowed and host[2] > 1:
        raise ValueError("jitattn attention: a padding mask with gaps inside a row cannot be expressed with a "
                         "sliding window (the window would count the unpadded tokens, not positions); pad on one "
                         "side only, or use attn_implementation='sdpa'")
    max_k, max_q = int(host[0]), (1 if rows_q is None else int(host[1]))
    q = q_all if rows_q is None else q_all[rows_q]
    out = _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **common)
    if rows_q is None:
        return out
    return out.new_zeros(batch * len_q, heads_q, head_dim).index_put((rows_q,), out)


def _packed_lengths(batch, len_q, len_k, device, kwargs):
    """((cu_q, cu_k), (max_q, max_k)) when the one batch row holds several packed sequences:
    FlashAttention's kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or
    position_ids that restart (its default); else None."""
    given = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in given):
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q/cu_seq_lens_k describe packed sequences in one batch row, got a batch of {batch}")
        cu_q, cu_k, max_q, max_k = given
        return (cu_q.to(device=device, dtype=torch.int32), cu_k.to(device=device, dtype=torch.int32)), \
            (int(max_q), int(max_k))
    position_ids = kwargs.get("position_ids")
    if batch != 1 or position_ids is None or len_q != len_k or len_q < 2:
        return None  # decode steps (L_q < L_k) and batches of rows are never packed
    flat = position_ids.reshape(-1).to(device)
    starts = (flat == flat.min()).nonzero().flatten().to(torch.int32)  # (a sync, as in transformers' own)
    if starts.numel() <= 1:
        return None  # one sequence: the dense path
    cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=device)])
    longest = int(cu.diff().max())
    return (cu, cu), (longest, longest)
