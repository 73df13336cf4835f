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
  FlashAttention's mask function or, as this one does, its like: `padding_mask`): keys and values are read in place
  (inference) with `seqused_k` and per-row starts, each row's keys the span from its first token
  to its last; queries stay in their padded rows (the mask's last L_q columns, left padding as
  transformers assumes), each row split into three sequences (padding before, the span of valid
  queries, padding after; the padding ones have no keys, so their rows come out zero). A
  bidirectional call (an encoder: not causal, no window) needs no positions, so each of its rows
  is one sequence and padding query rows attend as sdpa's do. Padding
  inside a span (gaps) is masked by a mask_mod that reads the mask on the device, on every padded
  call: exact for every mask, and a row without gaps pays no load per element (its tiles classify
  FULL from one per-sequence flag, `_key_is_token`). Positions are the padded row's, as in
  transformers' own masks, so causal and sliding windows stay exact with gaps; a query row inside
  a gap attends as sdpa's does (to the tokens its window lets it see).
- no host sync on the padded path, in any layer: max_q / max_k are the shapes' bounds (L_q, L_k),
  which the kernels accept (they size the grid; each sequence stops at its own length). What the
  mask says is derived on the device by the first layer of a forward pass and reused by the others
  (`_PER_FORWARD`, keyed by the tensor's identity and version). The dense path's sequence starts
  are made once per shape. (transformers' own FlashAttention mask function reads the mask once
  per forward pass, `attention_mask.all()`, before the model's layers; `padding_mask` leaves that
  read out of inference calls with several queries.)
- warm layer calls: a layer whose call has the signature of one before it (shapes, strides,
  dtypes, the mask's metadata, the scalars: every layer of a forward pass but the first) skips the
  mapping and the checks and launches the plan kept for it (`_WarmCall`), its views rebuilt on the
  new tensors and a padded call's plan looked up per mask as above (inference only). A decode
  step's first layer (a cache one key longer, a mask one column longer) re-plans the last step's
  call for its length (`_next_length`) rather than mapping and checking it anew.
- `Backend` / `use_backend` is the seam between the argument mapping and the kernel (tests put
  the float64 reference there, as `torch_flash.Kernels` / `use_kernels` do for that provider).
- packed sequences (batch 1): `cu_seq_lens_q/k` + `max_length_q/k` (DataCollatorWithFlattening
  with return_flash_attn_kwargs=True) or position_ids that restart (its default).
- `is_causal` -> window (-1, 0); `sliding_window` W -> left W - 1 (a key is seen iff
  q - k < W, as transformers' mask); `scaling` -> scale; GQA -> enable_gqa; `softcap`
  (Gemma-2's `attn_logit_softcapping`) -> varlen_attn's softcap.

Refused with an error naming the argument, never computed some other way: attention dropout
> 0, attention sinks (`s_aux`), 4D or other custom masks.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from jitattn.kernel import evict_oldest

NAME = "jitattn"


def register(name: str = NAME) -> str:
    """Add jitattn to transformers' AttentionInterface (and `padding_mask` to AttentionMaskInterface
    under the same name, so the model hands over a 2D mask or None).
    Returns the name for attn_implementation=. Safe to call more than once."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(f"jitattn.integrations.transformers needs transformers >= 5 ({exc}); "
                          "install it with `pip install 'jitattn[transformers]'`") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    for per_row in PER_ROW:  # traced here, not inside a model's first forward pass (which torch.compile may trace)
        _padding_variant(per_row)
    return name


def padding_mask(*args, **kwargs):
    """The mask function registered beside `attention_forward`: FlashAttention's (the 2D
    (B, L_k) mask, or None where no key is padding), except that an inference call with several
    queries (an encoder's, a prompt's) gets the 2D mask without FlashAttention's check
    `attention_mask.all()`. That check is a host read before the model's first layer in every
    forward pass, which waits for the device: a pipeline of encoder batches would drain every
    batch. The padded path is exact for a mask without padding too. Decode steps (one query)
    keep the check, which sends them to the dense path (generation waits for the device every
    step anyway), and so do calls with grad (training's all-ones masks keep the dense kernels)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    flash_attention_mask = ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    mask, q_length, kv_length = (kwargs.get(name) for name in ("attention_mask", "q_length", "kv_length"))
    if (args or not isinstance(mask, torch.Tensor) or mask.ndim != 2 or not isinstance(q_length, int) or q_length < 2
            or not isinstance(kv_length, int) or torch.is_grad_enabled()):
        return flash_attention_mask(*args, **kwargs)
    return mask[:, -kv_length:]


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (B, H, L, D) in, (B, L_q, H_q, D) and no
    attention weights out."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    signature = _signature(query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, causal,
                           s_aux, kwargs)
    warm = None if signature is None else (_WARM.get(signature)
                                           or _next_length(signature, query, key, value, attention_mask))
    out = None if warm is None else warm.run(query, key, value, attention_mask)
    if out is not None:
        return out, None
    _refuse(module, query, key, value, attention_mask, dropout, s_aux)
    query, key, value = _half(query, key, value)
    batch, heads_q, len_q, head_dim = query.shape
    heads_kv, len_k = key.shape[1], key.shape[2]
    common = {"scale": scaling, "window_size": _window(causal, sliding_window), "enable_gqa": heads_q != heads_kv,
              "softcap": softcap}
    if attention_mask is not None:
        mapped = _padded(query, key, value, attention_mask, common)
    else:
        packed = _packed_lengths(batch, len_q, len_k, query.device, kwargs)
        if packed is not None:
            cu, max_len = packed
            q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], head_dim) for t in (query, key, value))
            mapped = _Mapped(q, k, v, cu[0], cu[1], max_len[0], max_len[1], None, None, None)
        else:
            mapped = _dense(query, key, value)
    variant = {} if mapped.mask_mod is None else {"mask_mod": mapped.mask_mod}
    out = _varlen_attn(mapped.q, mapped.k, mapped.v, mapped.cu_q, mapped.cu_k, mapped.max_q, mapped.max_k,
                       seqused_k=mapped.used, **common, **variant)
    if signature is not None:
        _remember_warm(signature, query, key, value, mapped, common)
    return out.view(batch, len_q, heads_q, head_dim), None


# ----------------------------------------------------------------------------- the kernel seam
def _jitattn_varlen_attn(*args, **kwargs):
    import jitattn

    return jitattn.varlen_attn(*args, **kwargs)


class Backend(NamedTuple):
    """What the attention calls run on: `varlen_attn`, with jitattn.varlen_attn's signature, the
    dtypes it computes in (others are cast under autocast, or refused), and how a padding mask is
    read (PADDINGS): "on_device" never reads it back; "host_read" reads the longest run and
    whether a row has gaps once per forward pass, and passes no mask_mod for masks without gaps
    (the path before issue 47 item 2, kept to measure against: tools/bench_transformers.py
    --padding); "async_read" is "on_device" whose first layer also starts a non-blocking copy of
    whether any row has gaps, and layers that find it arrived (an event's query, no wait) leave
    the mask_mod out when none has (`_GapRead`). All are exact."""

    varlen_attn: Callable
    dtypes: tuple = (torch.float16, torch.bfloat16)
    padding: str = "on_device"


PADDINGS = ("on_device", "host_read", "async_read")


JITATTN_BACKEND = Backend(_jitattn_varlen_attn)
_OWN_BACKENDS = {padding: JITATTN_BACKEND if padding == JITATTN_BACKEND.padding
                 else JITATTN_BACKEND._replace(padding=padding) for padding in PADDINGS}
_backend = JITATTN_BACKEND


def jitattn_backend(padding: str = JITATTN_BACKEND.padding) -> Backend:
    """jitattn's own kernels with another padding mode (PADDINGS), for `use_backend`: its layer
    calls are warm as the default's are (a Backend made elsewhere, with the same fields, never is)."""
    if padding not in _OWN_BACKENDS:
        raise ValueError(f"padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
    return _OWN_BACKENDS[padding]


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Run the attention calls on `backend` instead of jitattn's (a test's stand-in), restoring after.
    What forward passes derived is forgotten on entry and on exit, so each first layer's work shows."""
    global _backend
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a jitattn.integrations.transformers.Backend, "
                        f"got {type(backend).__name__}")
    if backend.padding not in PADDINGS:
        raise ValueError(f"backend.padding must be one of {', '.join(PADDINGS)}, got {backend.padding!r}")
    previous, _backend = _backend, backend
    _PER_FORWARD.clear()
    _WARM.clear()
    _FAMILIES.clear()
    try:
        yield backend
    finally:
        _backend = previous
        _PER_FORWARD.clear()
        _WARM.clear()
        _FAMILIES.clear()


def _varlen_attn(*args, **kwargs):
    return _backend.varlen_attn(*args, **kwargs)


# ----------------------------------------------------------------------------- warm layer calls
# The layers of a forward pass call with the same shapes. The first maps its call (`_dense`,
# `_padded`) and launches through jitattn.varlen_attn, which plans it (jitattn/varlen/forward.py,
# warm calls); both are kept under the call's signature, so a later layer rebuilds the views of
# its tensors and launches the remembered plan: no argument mapping, no checks, no planning.
# Inference calls only (no grad, no torch.compile or dispatch mode, no CUDA graph capture), on
# jitattn's own backend (notes/transformers-host.md, eighth session).
_WARM: dict = {}
WARM_CALLS = 64
# A call's family (its signature but the keys' and the mask's length and strides) -> the last such
# call: a decode step's first layer, its cache one key longer, re-plans from it (`_next_length`).
_FAMILIES: dict = {}


def _signature(query, key, value, mask, dropout, scaling, sliding_window, softcap, causal, s_aux, kwargs):
    """What the mapping and the plan of a call depend on, or None where a call is never warm: every
    field the slow path reads but the mask's contents (the plan per mask is looked up per call)."""
    if (_OWN_BACKENDS.get(_backend.padding) is not _backend or dropout or s_aux is not None
            or kwargs.get("cu_seq_lens_q") is not None
            or not isinstance(query, torch.Tensor) or query.dim() != 4 or not isinstance(key, torch.Tensor)
            or key.dim() != 4 or not isinstance(value, torch.Tensor)
            or (mask is not None and not isinstance(mask, torch.Tensor))):
        return None
    shape = query.shape
    if shape[0] == 1 and shape[2] == key.shape[2] and shape[2] >= 2:
        return None  # one row of as many queries as keys: position_ids may pack sequences (_packed_lengths)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._are_functorch_transforms_active()
            or (query.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    return (shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.dtype, key.dtype,
            value.dtype, query.device, query.data_ptr() & 15, key.data_ptr() & 15, value.data_ptr() & 15,
            None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device, mask.data_ptr() & 15),
            scaling, sliding_window, softcap, causal, varlen_forward().knobs())


class _WarmCall(NamedTuple):
    """A remembered call: the views of query / key / value it launches on (size, stride: their
    storage offsets are the tensors'), its metadata (a dense call's own starts, or None: the
    padding mask's plan), the plan (jitattn/varlen/forward.py's Launch) and, once it ran warm,
    the launch packed for the layout (jitattn/varlen/launch.py's KeptLaunch: a warm call then
    writes its pointers alone; [None] until then, [False] where it does not apply). A padded
    call's launch is with or without the mask_mod (`hooked`); an "async_read" plan drops it in
    mid-pass, so each keeps the other's call for the same shapes in `other` ([None] until the full
    path made it: `run` then returns None)."""

    launch: object
    views: tuple
    starts: tuple | None
    plan_key: tuple | None
    out_shape: tuple
    kept: list
    hooked: bool = False
    other: list | None = None

    def run(self, query, key, value, mask):
        """The layer's output, or None: the call must take the full path (`attention_forward`)."""
        if self.starts is not None:
            (cu_q, cu_k, used), mask_mod = self.starts, None
        else:
            plan = _plan_of(mask, query.device, self.plan_key)
            if (plan.mask_mod is not None) != self.hooked:
                other = self.other[0] if self.other else None
                return None if other is None else other.run(query, key, value, mask)
            cu_q, cu_k, used, mask_mod = plan.cu_q, plan.cu_k, plan.used, plan.mask_mod
        kept = self.kept[0]
        if kept is None:  # the first warm run packs the launch (False where a kept launch does not apply)
            kept = self.kept[0] = varlen_forward().keep_launch(self.launch, *self._views(query, key, value), cu_q,
                                                               cu_k, used, mask_mod, self.out_shape) or False
        if kept:  # its views start where the tensors do: the pointers are the tensors'
            return kept.run(query, key, value, cu_q, cu_k, used,
                            mask_mod.tensors if mask_mod is not None and self.launch.mask_captures else ())
        out, _ = varlen_forward().run_remembered(self.launch, *self._views(query, key, value), cu_q, cu_k, used, None,
                                                 None, None, mask_mod)
        return out.view(self.out_shape)

    def _views(self, query, key, value) -> tuple:
        return tuple(t.as_strided(size, stride) for t, (size, stride) in zip((query, key, value), self.views))


def _family(signature: tuple) -> tuple:
    """A call's signature without its keys' length and strides (`_signature`'s fields 2-5) and, for
    a padded call, without the mask's length, strides and address (field 13)."""
    key_shape, value_shape, mask = signature[2], signature[4], signature[13]
    mask = None if mask is None else (mask[0][0], mask[2], mask[3])  # rows, dtype, device
    return (signature[:2] + (key_shape[:2], key_shape[3], value_shape[:2], value_shape[3]) + signature[6:13]
            + (mask,) + signature[14:])


def _next_length(signature: tuple, query, key, value, mask) -> _WarmCall | None:
    """The warm call of a call whose family was seen with another key length (the first layer of
    a decode step: a cache one key longer, in a new tensor, and a mask one column longer): the
    keys' slot views for this length, a dense call's starts (a padded call's plan is looked up per
    mask, as always), and the family's plan re-planned for the length without the checks
    (jitattn/varlen/forward.py's for_max_k); kept for the step's other layers. None: the full path."""
    family = _family(signature)
    known = _FAMILIES.get(family)
    if known is None:
        return None
    if mask is not None and key.shape[2] > mask.shape[1]:  # as _padded: only the mask's keys
        key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
    slots = _slot_layout(key), _slot_layout(value)
    if slots[0] is None or slots[1] is None or slots[0][1] != slots[1][1]:
        return None
    (k, rows), (v, _) = slots  # (size, stride) of the views
    batch, _, len_q, _ = query.shape
    len_k = key.shape[2]
    launch = varlen_forward().for_max_k(known.launch, len_k)  # max_k is L_k on both paths (no host read)
    if launch is None:
        return None
    views = (known.views[0], k, v)
    if mask is None:
        # The same plan (for_max_k kept it): the family's kept launch with these keys' strides,
        # not packed anew (a decode step's first layer runs this once a step).
        kept = known.kept[0].for_keys(k, v) if launch is known.launch and known.kept[0] else None
        warm = _WarmCall(launch, views, _dense_starts(batch, len_q, len_k, rows, query.device), None, known.out_shape,
                         [kept])
    else:
        plan_key = (len_q, len_k, rows) + known.plan_key[3:]
        warm = _WarmCall(launch, views, None, plan_key, known.out_shape, [None], known.hooked, [None])
        sibling = known.other[0] if known.other else None  # the family's call the other way (`_WarmCall`)
        launch = None if sibling is None else varlen_forward().for_max_k(sibling.launch, len_k)
        if launch is not None:
            _link(warm, _WarmCall(launch, views, None, plan_key, known.out_shape, [None], sibling.hooked, [None]))
    _keep(signature, family, warm)
    return warm


def _link(a: _WarmCall, b: _WarmCall) -> None:
    """a and b: one padded call's shapes, with and without the mask_mod; each runs the other's way."""
    a.other[0], b.other[0] = b, a


def _keep(signature: tuple, family: tuple | None, warm: _WarmCall) -> None:
    known = _WARM.get(signature)
    if known is not None and known.other is not None and warm.other is not None and known.hooked != warm.hooked:
        _link(warm, known)  # the same shapes the other way: the pass dropped (or a new one needs) the mask_mod
    for memo, key in ((_WARM, signature), (_FAMILIES, family)):
        if key is not None:
            if len(memo) >= WARM_CALLS:
                evict_oldest(memo)
            memo[key] = warm


def _view_of(view: torch.Tensor, base: torch.Tensor):
    """(size, stride) when `view` is base.as_strided(size, stride) (same storage and offset), else None."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or \
            view.storage_offset() != base.storage_offset():
        return None
    return tuple(view.shape), view.stride()


def _remember_warm(signature: tuple, query, key, value, mapped: _Mapped, common: dict) -> None:
    """Keep a mapped, launched call for the later layers (`_WarmCall`), when its launch was
    remembered (jitattn.varlen_attn's warm key) and its tensors are views of the layer's."""
    forward = varlen_forward()
    launch = forward.remembered(forward.warm_key(
        mapped.q, mapped.k, mapped.v, mapped.cu_q, mapped.cu_k, mapped.max_q, mapped.max_k, common["scale"],
        common["window_size"], common["enable_gqa"], mapped.used, None, None, None, None, common["softcap"], None,
        mapped.mask_mod))
    views = (_view_of(mapped.q, query), _view_of(mapped.k, key), _view_of(mapped.v, value))
    if launch is None or None in views or (mapped.plan_key is None and mapped.used is None):
        return
    starts = None if mapped.plan_key is not None else (mapped.cu_q, mapped.cu_k, mapped.used)
    shape = query.shape
    padded = mapped.plan_key is not None
    _keep(signature, _family(signature), _WarmCall(launch, views, starts, mapped.plan_key,
                                                   (shape[0], shape[2], shape[1], shape[3]), [None],
                                                   mapped.mask_mod is not None, [None] if padded else None))


def varlen_forward():
    """jitattn/varlen/forward.py (imported on first use, as jitattn.varlen_attn is)."""
    import jitattn.varlen.forward as forward

    return forward


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
    if query.dtype in _backend.dtypes and key.dtype == query.dtype and value.dtype == query.dtype:
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


class _Mapped(NamedTuple):
    """One attention call as varlen_attn's arguments (besides the scalars in `common`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    used: torch.Tensor | None
    mask_mod: object  # a traced Variant, or None
    plan_key: tuple | None  # a padded call's: what its _MaskPlan was derived from besides the mask


def _dense(query, key, value) -> _Mapped:
    """Each batch row one sequence of L_q queries over L_k keys."""
    batch, heads_q, len_q, head_dim = query.shape
    len_k = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * len_q, heads_q, head_dim)
    grad = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
    slots = None if grad else (_slots(key), _slots(value))
    if slots is not None and slots[0] is not None and slots[1] is not None and slots[0][1] == slots[1][1]:
        (k, rows), (v, _) = slots
        cu_q, cu_k, used = _dense_starts(batch, len_q, len_k, rows, query.device)
        return _Mapped(q, k, v, cu_q, cu_k, len_q, len_k, used, None, None)
    k, v = (t.transpose(1, 2).reshape(batch * len_k, t.shape[1], head_dim) for t in (key, value))
    cu_q, cu_k, _ = _dense_starts(batch, len_q, len_k, len_k, query.device)
    return _Mapped(q, k, v, cu_q, cu_k, len_q, len_k, None, None, None)


_PER_SHAPE: dict = {}


def _per_shape(key: tuple, device: torch.device, make):
    """make(), kept per key (shapes and device): tensors that depend on the shapes alone, made once
    rather than per layer and step (never written after; not kept while tracing or capturing)."""
    value = _PER_SHAPE.get(key)
    if value is None:
        value = make()
        if _cacheable(device):
            if len(_PER_SHAPE) >= 64:
                evict_oldest(_PER_SHAPE)
            _PER_SHAPE[key] = value
    return value


def _dense_starts(batch: int, len_q: int, len_k: int, rows: int, device: torch.device):
    """(cu_q, cu_k, seqused_k) of B dense rows whose keys are slots of `rows` rows (the last slot
    ends with the tensor)."""
    if len_k > 0 and rows % len_k == 0:  # slots of c x L_k rows (a DynamicCache's (B, H, L, D): c = H)
        base = len_k - len_k % LENGTHS
        cu_q, cu_k, used = _per_shape(("dense lengths", batch, len_q, rows // len_k, base, device), device,
                                      lambda: _length_starts(batch, len_q, rows // len_k, base, device))
        return cu_q, cu_k[len_k - base], used[len_k - base]

    def make():
        cu_k = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device=device) if rows \
            else torch.zeros(batch + 1, dtype=torch.int32, device=device)
        cu_k[-1] = (batch - 1) * rows + len_k
        return _query_starts(batch, len_q, device), cu_k, torch.full((batch,), len_k, dtype=torch.int32, device=device)

    return _per_shape(("dense", batch, len_q, len_k, rows, device), device, make)


# Key lengths per table of `_length_starts`: a decode step's cache is one key longer, and each of
# its starts was a new small tensor (four launches a step); a table serves LENGTHS steps.
LENGTHS = 64


def _length_starts(batch: int, len_q: int, per_key: int, base: int, device: torch.device):
    """`_dense_starts` of the key lengths L = base .. base + LENGTHS - 1 with rows = per_key x L:
    cu_q, then per length cu_k (b x rows, the last L past the last slot's start) and seqused_k,
    each a contiguous row of one table."""
    i32 = dict(dtype=torch.int32, device=device)
    lengths = torch.arange(base, base + LENGTHS, **i32)[:, None]
    slots = torch.arange(batch + 1, **i32) * per_key
    slots[-1] = (batch - 1) * per_key + 1
    cu_k = lengths * slots
    used = lengths.expand(LENGTHS, batch).contiguous()
    return _query_starts(batch, len_q, device), cu_k.unbind(0), used.unbind(0)


def _query_starts(batch: int, len_q: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * len_q, len_q, dtype=torch.int32, device=device) if len_q \
        else torch.zeros(batch + 1, dtype=torch.int32, device=device)


class _Shapes(NamedTuple):
    """The padded path's tensors that depend on the shapes alone (`_mask_shapes`)."""

    slot: torch.Tensor        # (B,) row b's first key row: b * rows
    end: torch.Tensor         # (1,) the keys' end: (B - 1) * rows + L_k
    row_starts: torch.Tensor  # (B + 1,) b * L_q: each row's first query row, then the total
    ends: torch.Tensor        # (L_k,) 1 .. L_k: a column's index + 1 (`_runs`)


def _mask_shapes(batch: int, len_q: int, len_k: int, rows: int, device: torch.device) -> _Shapes:
    def make():
        i32 = dict(dtype=torch.int32, device=device)
        return _Shapes(torch.arange(batch, **i32) * rows, torch.full((1,), (batch - 1) * rows + len_k, **i32),
                       torch.arange(batch + 1, **i32) * len_q, torch.arange(1, len_k + 1, **i32))

    return _per_shape(("mask", batch, len_q, len_k, rows, device), device, make)


def _cacheable(device: torch.device) -> bool:
    """Whether a tensor made now may be kept for later calls: not while torch.compile traces (it
    would be a fake tensor) nor inside CUDA graph capture (its values exist only on replay)."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _slots(t: torch.Tensor):
    """(B, H, L, D) read in place as (rows, H, D) token rows: batch row i is the slot starting at
    row i * (stride B / stride L), its first L rows used (the rows between belong to other heads,
    never read). (view, rows per slot), or None when the strides do not allow it (or the
    kernel could not read it without a copy)."""
    layout = _slot_layout(t)
    if layout is None:
        return None
    (size, stride), rows = layout
    return t.as_strided(size, stride), rows


def _slot_layout(t: torch.Tensor):
    """`_slots`' view as ((size, stride), rows per slot), without making it (a decode step's first
    layer only needs its layout), or None."""
    batch, heads, length, head_dim = t.shape
    s_b, s_h, s_l, s_d = t.stride()
    per_vec = 16 // t.element_size()
    if (s_d != 1 or s_l <= 0 or s_b % s_l or t.data_ptr() % 16
            or any(s % per_vec for s in (s_b, s_h, s_l))):
        return None
    rows = s_b // s_l
    return (((batch - 1) * rows + length, heads, head_dim), (s_l, s_h, 1)), rows


def _padded(query, key, value, mask, common) -> _Mapped:
    """A 2D padding mask: keys and values read in place (inference), the plan derived once per
    forward pass (`_mask_plan`), no host sync in `on_device` padding (the module docstring)."""
    batch, heads_q, len_q, head_dim = query.shape
    if key.shape[2] > mask.shape[1]:  # a static cache longer than the mask: only the mask's keys
        key, value = key[:, :, :mask.shape[1]], value[:, :, :mask.shape[1]]
    len_k = key.shape[2]
    grad = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
    slots = None if grad else (_slots(key), _slots(value))
    if slots is not None and slots[0] is not None and slots[1] is not None and slots[0][1] == slots[1][1]:
        (k, rows), (v, _) = slots
    else:
        k, v = (t.transpose(1, 2).reshape(batch * len_k, t.shape[1], head_dim) for t in (key, value))
        rows = len_k
    plan_key = (len_q, len_k, rows, _backend.padding, common["window_size"] == (-1, -1))
    plan = _plan_of(mask, query.device, plan_key)
    if plan.key_offset:
        k, v = k[plan.key_offset:], v[plan.key_offset:]
    q = query.transpose(1, 2).reshape(batch * len_q, heads_q, head_dim)
    return _Mapped(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, plan.used, plan.mask_mod, plan_key)


def _plan_of(mask: torch.Tensor, device: torch.device, plan_key: tuple) -> "_MaskPlan":
    """The padding mask's plan (`_mask_plan`), derived by a forward pass's first layer and reused
    (without its mask_mod once an "async_read" found that no row has gaps: `_GapRead`)."""
    plan = _PER_FORWARD.get(mask, device, plan_key, lambda: _mask_plan(mask, *plan_key[:3], device, *plan_key[3:]))
    if plan.gaps is None or torch.compiler.is_compiling():
        return plan  # (nothing of the read is traced)
    return plan.gaps.plan(plan)


PER_ROW = (1, 3)  # sequences per padded row: one (decode, bidirectional) or three (padding, span, padding)


class _MaskPlan(NamedTuple):
    """A padding mask as varlen arguments over padded query rows and keys read in place."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used: torch.Tensor
    max_q: int
    max_k: int
    key_offset: int  # cu_k counts from this row of the keys (cu_seq_k starts at 0)
    mask_mod: object  # which of a sequence's keys are tokens (`_key_is_token`), or None: all are
    gaps: "_GapRead | None" = None  # "async_read": whether any row has gaps, on its way to the host


class _GapRead:
    """Whether any row of a padding mask has gaps, copied to the host without waiting: a
    non-blocking copy into pinned memory and an event behind it. Layers of the pass ask `plan`;
    until the event has passed (a query, never a wait) they get the plan as it is, afterwards
    the plan without its mask_mod when no row has gaps (exact: the mask_mod is then true for
    every key a sequence reads). The mask_mod costs a short call (an encoder's) a third of its
    kernel time though every tile classifies FULL (notes/transformers-host.md); a host read
    that waits costs more (Backend "host_read"). Never made under CUDA graph capture or
    torch.compile (the plan keeps its mask_mod). A mask on the CPU is read at once."""

    __slots__ = ("_flag", "_event", "_settled")

    def __init__(self, whole: torch.Tensor):
        everywhere = whole.all()
        if everywhere.is_cuda:
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(everywhere, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._flag, self._event = everywhere, None
        self._settled = None  # the plan to use once the flag is here

    @staticmethod
    def start(whole: torch.Tensor) -> "_GapRead | None":
        """The read of all(whole) (whole[b]: sequence b reads no gap), or None where none may start."""
        if torch.compiler.is_compiling() or (whole.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        return _GapRead(whole)

    def plan(self, plan: "_MaskPlan") -> "_MaskPlan":
        if self._settled is None:
            if self._event is not None and (torch.cuda.is_current_stream_capturing() or not self._event.query()):
                return plan  # not here yet (and never queried while a graph is captured)
            self._settled = plan._replace(gaps=None, mask_mod=None if bool(self._flag) else plan.mask_mod)
        return self._settled


def _mask_plan(mask: torch.Tensor, len_q: int, len_k: int, rows: int, device: torch.device,
               padding: str = "on_device", bidirectional: bool = False) -> _MaskPlan:
    """Row b's keys are the span of its tokens, first to last, in the slot starting at row b * rows
    of the keys, and the mask_mod masks the padding inside the span (gaps). One query per row
    (decode): sequence b is query row b, its keys from its first token to the mask's end (row 0's
    from its slot's start: cu_seq_k starts at 0 with no host read). More: row b's L_q query rows
    (the mask's last L_q columns) are three sequences: the padding before its first valid query,
    the rows from there to its last valid query, and the padding after; the padding ones have no
    keys, so they come out zero. Each sequence's keys end where its queries end in the padded row,
    so bottom-right alignment counts positions in the padded row, as transformers' own masks do
    (causal and sliding windows are exact with gaps). `bidirectional` (no causal mask, no window:
    an encoder) needs no positions: row b is one sequence, all L_q query rows over the span's
    keys, so padding query rows attend as sdpa's do and a batch of short sentences launches a
    third of the work units.

    max_q / max_k are the shapes' bounds (L_q, L_k), so nothing is read back: the kernels size their
    grid by them and stop at each sequence's own length. `padding` (Backend.padding): "host_read"
    reads the longest span and whether any row has gaps once instead, and leaves the mask_mod out
    without; "async_read" starts the read of the latter without waiting (`_GapRead`)."""
    host_read = padding == "host_read"
    mask = mask.to(device=device, dtype=torch.bool)
    batch = mask.shape[0]
    shapes = _mask_shapes(batch, len_q, len_k, rows, device)
    slot, end = shapes.slot, shapes.end
    first_k, span_k, count_k = _runs(mask, shapes.ends)
    if len_q == 1:
        start = torch.cat([shapes.row_starts[:1], first_k[1:]])  # row 0 from its slot's start (row_starts[0] = 0)
        used = len_k - start  # to the mask's end, where the query is
        whole = count_k == used
        plan = _MaskPlan(shapes.row_starts, torch.cat([slot + start, end]), used, 1, len_k, 0,
                         _key_is_token(whole, mask, start, 1))
        if not host_read:
            return _reading(plan, whole, padding)
        host = torch.stack([(count_k != len_k - first_k).any().int(), first_k.min(), first_k[0]]).tolist()
        if host[0]:
            return plan
        offset = int(host[2])  # the keys' view starts at row 0's first token
        return _MaskPlan(plan.cu_q, torch.cat([slot + first_k, end]) - offset, len_k - first_k, 1, len_k - int(host[1]),
                         offset, None)
    if bidirectional:
        whole = count_k == span_k
        plan = _MaskPlan(shapes.row_starts, torch.cat([slot + first_k, end]), span_k, len_q, len_k, 0,
                         _key_is_token(whole, mask, first_k, 1))
        return _read_back(plan, count_k, span_k) if host_read else _reading(plan, whole, padding)
    first_q, span_q, _ = (first_k, span_k, count_k) if len_q == len_k else _runs(mask[:, -len_q:], shapes.ends)
    first_q = torch.where(span_q > 0, first_q, len_q)  # no valid query: all of the row is padding before
    row_q = shapes.row_starts[:-1]
    start_k = slot + first_k
    zero = torch.zeros_like(span_k)
    cu_q = torch.cat([torch.stack([row_q, row_q + first_q, row_q + first_q + span_q], 1).flatten(),
                      shapes.row_starts[-1:]])
    cu_k = torch.cat([torch.stack([slot, start_k, start_k + span_k], 1).flatten(), end])
    used = torch.stack([zero, span_k, zero], 1).flatten()
    whole = torch.stack([zero == 0, count_k == span_k, zero == 0], 1).flatten()  # padding sequences read no key
    plan = _MaskPlan(cu_q, cu_k, used, len_q, len_k, 0, _key_is_token(whole, mask, first_k, 3))
    return _read_back(plan, count_k, span_k) if host_read else _reading(plan, whole, padding)


def _reading(plan: _MaskPlan, whole: torch.Tensor, padding: str) -> _MaskPlan:
    """An on-device plan; with "async_read" padding, the read of whether it needs its mask_mod started."""
    return plan._replace(gaps=_GapRead.start(whole)) if padding == "async_read" else plan


def _read_back(plan: _MaskPlan, count_k: torch.Tensor, span_k: torch.Tensor) -> _MaskPlan:
    """host_read padding: the longest span as max_k, and no mask_mod when no row has gaps (one read)."""
    host = torch.stack([(count_k != span_k).any().int(), span_k.max()]).tolist()
    return plan._replace(max_k=int(host[1]), mask_mod=plan.mask_mod if host[0] else None)


def _runs(mask: torch.Tensor, ends: torch.Tensor):
    """Per row of a bool mask: (index of the first True (0 if none), span from the first True to
    the last (0 if none), number of Trues), int32, no host sync. Span > count: gaps in the row.
    ends: 1 .. at least the mask's width (int32). Six small launches, kept few: a forward pass's
    plan enqueues them on the host's critical path of a host-bound model (a padded encoder's)."""
    count = mask.sum(-1, dtype=torch.int32)
    as_int = mask.view(torch.uint8)  # argmax takes no bool; a view, not a copy
    first = as_int.argmax(-1).to(torch.int32)  # the first maximum: 0 in a row without a True
    end = (as_int * ends[:mask.shape[-1]]).amax(-1)  # one past the last True: 0 in a row without one
    return first, end - first, count


def _key_is_token(whole: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, per_row: int):
    """The mask_mod of a padded call over N packed sequences, `per_row` of them per batch row of
    the (B, L_k) bool mask, the keys of row r's sequences starting at its column first[r]: key
    kv_idx of sequence b is visible iff whole[b] says every key the sequence reads is a token, or
    mask[r, first[r] + kv_idx] is (r = b // per_row; a read past the mask's end is False).

    whole[b] comes first so that the kernels' tile classification, which reads a capture at an
    exact index (b is fixed per tile), proves every tile of a sequence without gaps FULL: only
    sequences with gaps pay a load per element. The mask is read where it lies (no token table
    made per forward pass). Traced once per `per_row` (`_padding_variant`); each forward pass
    attaches its own tensors (Variant.bind), so no call traces."""
    return _padding_variant(per_row).bind((whole, first, mask))  # the order the trace captured them in


def _key_is_token_function(whole: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, per_row: int):
    def key_is_token(b, h, q_idx, kv_idx):
        whole_b = whole[b]  # captured in this order: whole, first, mask
        row = b if per_row == 1 else b // per_row
        column = first[row] + kv_idx
        return whole_b | mask[row, column]

    return key_is_token


@functools.cache
def _padding_variant(per_row: int):
    """`_key_is_token`'s traced Variant (placeholder tensors: (N,) bool, (B, L_k) bool, (B,) int32)."""
    from jitattn.variants import trace_mask_mod

    placeholders = (torch.zeros(1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.bool),
                    torch.zeros(1, dtype=torch.int32))
    return trace_mask_mod(_key_is_token_function(*placeholders, per_row))


class _PerForward:
    """Values derived from a tensor the model hands every layer of one forward pass (the padding
    mask, position_ids): the first layer computes, the others reuse. Keyed by the tensor's
    identity (a weak reference: a new step's mask is a new tensor) and version (an in-place
    change misses), plus what else the value depends on."""

    def __init__(self, size: int = 8):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._size = size

    def get(self, tensor: torch.Tensor, device: torch.device, extra: tuple, make):
        """make(), or what it returned for this tensor (unchanged), device (where the value's
        tensors live: the layers of one model may sit on several GPUs) and extra."""
        if not _cacheable(device):
            return make()
        version = _version(tensor)
        key = (id(tensor), device, extra)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is tensor and entry[1] == version:
            return entry[2]
        value = make()
        self._entries[key] = (weakref.ref(tensor), version, value)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


def _version(tensor: torch.Tensor):
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter (nor can it change outside inference mode)
        return None


_PER_FORWARD = _PerForward()


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
    return _PER_FORWARD.get(position_ids, device, ("restarts",), lambda: _restarts(position_ids, device))


def _restarts(position_ids: torch.Tensor, device: torch.device):
    """((cu, cu), (longest, longest)) of the sequences position_ids restart at; None for one sequence."""
    flat = position_ids.reshape(-1).to(device)
    starts = (flat == flat.min()).nonzero().flatten().to(torch.int32)  # (a sync, as in transformers' own)
    if starts.numel() <= 1:
        return None  # one sequence: the dense path
    cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=device)])
    longest = int(cu.diff().max())
    return (cu, cu), (longest, longest)
