"""Where a warm batch-1 decode layer call's host time goes (transformers integration), beside sdpa's.

Batch-1 generation is host-bound: both backends run the same model code, so its tokens/s ratio is
the attention call's host time against sdpa's (notes/transformers-host.md). This times, on the GPU
host, the integration's warm call (jitattn/integrations/transformers.py `attention_forward` after
the first call of its shape), a decode step's first layer (a cache one key longer: re-planned from
the last step's call, `_next_length`), and the warm call's parts: the signature, the warm lookup, the kept launch
(jitattn/varlen/launch.py KeptLaunch.run: one allocation, the output's rows and past them the split
partials' (_Scratch), packing the params, the C entry point's launches), beside transformers'
`sdpa_attention_forward` and `F.scaled_dot_product_attention` alone. Each: wall time per call of a
loop of 4000 calls (one sync at its end: tools/bench_util.py host_us_per_call), median of
interleaved rounds. "C launch" is kept.run less its allocation and packing; "(out alone)" and
"(scratch alone)" are the two allocations a kept launch made before they were one.

Then the same decode call through torch's flash-attention registry (issue 47 item 1: SDPA's flash
path with jitattn active measured 0.82x of torch's own flash kernels in batch-1 generation):
`F.scaled_dot_product_attention` under sdpa_kernel(FLASH_ATTENTION) with torch's kernel, then with
jitattn.activate(), and the provider's parts for that call (jitattn/integrations/torch_flash.py):
the fallback decision, its body (`flash_attention_forward`), within it jitattn's public
`varlen_attn_out`, the dense call's cu_seq lookup and the auxiliary outputs aten's op returns;
and a step's first layer both ways (256 cache lengths in turn: jitattn re-plans the last
length's launch, jitattn/varlen/forward.py `_next_length`).
K / V are repeated to 16 heads there (the flash op's GQA is not every torch's).

    PYTHONPATH=. python3 tools/decode_host.py [--rounds 5] [--keys 288] [--no-provider]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import jitattn.integrations.transformers as jt  # noqa: E402
from bench_util import host_us_per_call  # noqa: E402
from jitattn.varlen import launch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=288, help="the KV cache's length (prompt + new tokens)")
    parser.add_argument("--no-provider", action="store_true", help="leave out the flash-registry rows")
    args = parser.parse_args()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 4

    module, scale = Attention(), 128 ** -0.5
    q = torch.randn(1, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, args.keys, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with torch.no_grad():
        for _ in range(3):
            jt.attention_forward(module, q, k, v, None, scaling=scale)
        signature = jt._signature(q, k, v, None, 0.0, scale, None, None, True, None, {})
        warm = jt._WARM[signature]
        kept = warm.kept[0]
        cu_q, cu_k, used = warm.starts
        # A decode step's first layer: a cache one key longer than the last step's, in a new tensor
        # (DynamicCache), so the call is not warm and re-plans the family's last call for its length
        # (`_next_length`). 128 lengths in turn: more than the warm memo holds, so none is a hit.
        steps = [(torch.randn(1, 4, args.keys + i, 128, device="cuda", dtype=torch.bfloat16),) * 2
                 for i in range(2 * jt.WARM_CALLS)]
        step = iter(range(1 << 62))

        def first_layer():
            key, value = steps[next(step) % len(steps)]
            jt.attention_forward(module, q, key, value, None, scaling=scale)

        parts = {
            "attention_forward (warm)": lambda: jt.attention_forward(module, q, k, v, None, scaling=scale),
            "attention_forward (a step's first layer)": first_layer,
            "sdpa_attention_forward": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scale),
            "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                     enable_gqa=True),
            "  signature": lambda: jt._signature(q, k, v, None, 0.0, scale, None, None, True, None, {}),
            "  warm lookup": lambda: jt._WARM.get(signature),
            "  warm.run": lambda: warm.run(q, k, v, None),
            "    kept.run": lambda: kept.run(q, k, v, cu_q, cu_k, used, ()),
            "      allocation (out + scratch rows)": lambda: torch.empty(
                kept.alloc_shape or kept.out_shape, dtype=kept.dtype, device=kept.device)[:kept.out_shape[0]],
            "      params packing": lambda: launch._POINTERS.pack_into(bytearray(kept.params), 0, *([0] * 14)),
            "      (out alone)": lambda: torch.empty(kept.out_shape, dtype=kept.dtype, device=kept.device),
            "      (scratch alone, as a cold call allocates it)": lambda: launch._Scratch(kept.sizes, kept.device),
            "  knobs": lambda: jt.varlen_forward().knobs(),
        }
        got = {name: [] for name in parts}
        for _ in range(args.rounds):
            for name, fn in parts.items():
                got[name].append(host_us_per_call(fn, calls=4000))
    med = {name: statistics.median(t) for name, t in got.items()}
    med["      C launch (kept.run less allocation and packing)"] = med["    kept.run"] - sum(
        med[n] for n in ("      allocation (out + scratch rows)", "      params packing"))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; batch-1 decode layer call, 16/4 heads of 128, "
          f"{args.keys} keys; us per call, median of {args.rounds} rounds (split partials: {kept.sizes[0]} rows)")
    for name, t in med.items():
        spread = got.get(name)
        print(f"{name:48s} {t:7.2f}" + (f"  ({min(spread):.2f}-{max(spread):.2f})" if spread else ""))
    if not args.no_provider:
        provider_rows(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), scale, args.rounds)


def provider_rows(q, k, v, scale, rounds) -> None:
    """The decode call through torch's flash-attention registry, torch's kernel and jitattn's, and
    the provider's parts (module docstring)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import jitattn
    from jitattn.integrations import torch_flash as tf
    from jitattn.varlen import AuxRequest, varlen_attn_out

    if not hasattr(torch.nn.attention, "activate_flash_attention_impl"):
        print("this torch has no flash-attention registry: no provider rows")
        return
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    # A decode step's first layer: a cache one key longer, in a new tensor (as main's first_layer).
    steps = [(torch.randn(1, k.shape[1], k.shape[2] + i, k.shape[3], device=k.device, dtype=k.dtype),) * 2
             for i in range(256)]
    step = iter(range(1 << 62))

    def sdpa_first_layer():
        key, value = steps[next(step) % len(steps)]
        F.scaled_dot_product_attention(q, key, value, scale=scale)

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D), as the provider gets them
    out = torch.empty_like(qt)
    cu_q, cu_k = tf.dense_cu_seq(1, 1, q.device), tf.dense_cu_seq(1, k.shape[2], q.device)
    packed = [tf._packed(t) for t in (qt, kt, vt)]
    parts = {
        "SDPA flash, torch's kernel": ("torch", sdpa),
        "SDPA flash, torch's kernel, a step's first layer": ("torch", sdpa_first_layer),
        "SDPA flash through jitattn (provider)": ("jitattn", sdpa),
        "  the same, a step's first layer": ("jitattn", sdpa_first_layer),
        "  fallback decision": ("jitattn", lambda: tf._sdpa_forward_reason(q, k, v, 0.0, False, False, scale=scale)),
        "  flash_attention_forward (its body)": ("jitattn", lambda: tf.flash_attention_forward(
            qt, kt, vt, None, None, 1, k.shape[2], 0.0, False, False, scale=scale)),
        "    varlen_attn_out (jitattn's public call)": ("jitattn", lambda: varlen_attn_out(
            out.view(-1, *out.shape[2:]), *packed, cu_q, cu_k, 1, k.shape[2], return_aux=AuxRequest(lse=True),
            scale=scale)),
        "    dense cu_seq lookup": ("jitattn", lambda: tf.dense_cu_seq(1, k.shape[2], q.device)),
        "    auxiliary outputs (rng state, offset, mask)": ("jitattn", lambda: tf._aux(q)),
    }
    got = {name: [] for name in parts}
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(rounds):
            for setting in ("torch", "jitattn"):
                if setting == "jitattn":
                    jitattn.activate()
                try:
                    for name, (where, fn) in parts.items():
                        if where == setting:
                            fn()  # warm: the first call of a shape plans and loads
                            got[name].append(host_us_per_call(fn, calls=4000))
                finally:
                    if setting == "jitattn":
                        jitattn.restore()
    print(f"decode call through torch's flash-attention registry, 16 heads of 128 (K / V repeated), "
          f"{k.shape[2]} keys; us per call, median of {rounds} rounds")
    for name, t in got.items():
        print(f"{name:48s} {statistics.median(t):7.2f}  ({min(t):.2f}-{max(t):.2f})")


if __name__ == "__main__":
    main()
