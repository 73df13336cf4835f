"""Ready-made variants: the attention variants users bring most often, written as FlexAttention
functions (score_mod(score, b, h, q_idx, kv_idx), mask_mod(b, h, q_idx, kv_idx)), so each is
both an example of what a variant may use (docs/variants.md) and issue 46's acceptance set.

Functions that read a tensor take it as an argument and close over it: the tensor becomes a
captured kernel argument, so a new tensor of the same dtype and rank never recompiles. Positions
are jitattn's (bottom-right aligned, like the windows); with equal query and key lengths they are
FlexAttention's.
"""
from __future__ import annotations

import torch


def relative_position(score, b, h, q_idx, kv_idx):
    """score + (q_idx - kv_idx): a linear relative-position bias."""
    return score + (q_idx - kv_idx)


def alibi(slopes: torch.Tensor):
    """ALiBi: score + slopes[h] * (kv_idx - q_idx), slopes float32 (H_q,) (jitattn.reference.alibi_slopes)."""
    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi_score


def bias_table(bias: torch.Tensor, offset: int):
    """A learned relative bias: score + bias[h, q_idx - kv_idx + offset], bias (H_q, 2 * offset + 1)."""
    def table_score(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + offset]
    return table_score


def soft_cap(cap: float):
    """Gemma-2's logit soft cap, cap * tanh(score / cap), as a score_mod (a new cap recompiles:
    the varlen API's softcap= takes it as a runtime argument instead)."""
    def capped_score(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return capped_score


def causal(b, h, q_idx, kv_idx):
    """Causal as a mask: the built-in window (-1, 0)."""
    return q_idx >= kv_idx


def sliding_window(width: int):
    """Causal sliding window as a mask: keys at most `width` positions back (window (width, 0))."""
    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= width)
    return window_mask


def document(doc_id: torch.Tensor):
    """Document masking: a query sees the keys of its own document, doc_id int32 (N, L) per
    sequence b and position (several documents packed into one sequence)."""
    def same_document(b, h, q_idx, kv_idx):
        return doc_id[b, q_idx] == doc_id[b, kv_idx]
    return same_document


def prefix_lm(prefix_lengths: torch.Tensor):
    """Prefix-LM: bidirectional over each sequence's first prefix_lengths[b] keys, causal after
    (prefix_lengths int32 (N,))."""
    def prefix_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lengths[b]) | (q_idx >= kv_idx)
    return prefix_mask
