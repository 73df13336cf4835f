"""The varlen decode tile by TMA (VarlenSpec tma on decode shapes) against cp.async: float64 checks.

Decode-shaped batches (max_q x GQA group <= 16 rows) at D128, bf16 and f16, paged (pages 1..256)
and packed, with ragged lengths (partial last tiles, empty and 1-key sequences), windows, splits
and seqused_k slack; every K/V row the call must not read is NaN (tests/varlen_utils.make_batch).
Each case runs the default 32 x 3 decode tile with tma=0 and tma=1 (and deeper TMA tiles), and
the two must also agree bit for bit (the same tile contents, the same MMA order).
  PYTHONPATH=<checkout> python tools/decode_tma.py
"""
from __future__ import annotations

import random
import sys

import torch


def main() -> int:
    from jitattn.jit.loader import get_module
    from jitattn.kernel import OpKernel
    from jitattn.varlen import forward
    from jitattn.varlen.spec import VarlenSpec
    from tests.varlen_utils import check, make_batch, reference, run

    tiles = [(1, 1, 32, 3), (1, 1, 32, 6), (1, 1, 64, 3)]
    failures, cases = 0, 0
    for dtype in (torch.bfloat16, torch.float16):
        for page in (1, 2, 4, 8, 16, 32, 64, 128, 256, 0):
            rng = random.Random(page * 7 + (dtype == torch.float16))
            len_k = [rng.choice([1, 31, 32, 33, rng.randint(2, 700), rng.randint(700, 5000)]) for _ in range(10)]
            len_k += [0, 4096]
            h_q, h_kv = rng.choice([(32, 8), (8, 8), (16, 2)])
            b = make_batch([1] * len(len_k), len_k, h_q, h_kv, 128, dtype, seed=page, paged=page > 0,
                           page_size=page or 16, slack=rng.randint(0, 40), use_seqused=page > 0 or rng.random() < 0.5)
            for window, splits in [((-1, -1), None), ((-1, 0), 3), ((255, 0), None)]:
                ref = reference(b, window)
                outs = {}
                for tile in tiles:
                    for tma in (False, True):
                        if tile != tiles[0] and not tma:
                            continue
                        spec = VarlenSpec(128, forward.check.DTYPE_NAMES[dtype], page > 0, True, *tile, tma=tma)
                        key = forward.kernel_key(128, dtype, page > 0, True, False, False)
                        saved = forward._kernels.get(key)
                        forward._kernels[key] = (OpKernel(get_module(spec)), spec.block_m, spec.block_n)
                        what = f"{dtype} page {page} window {window} splits {splits} tile {tile} tma {tma}"
                        cases += 1
                        try:
                            out, lse = run(b, window=window, num_splits=splits, want_lse=True)
                            check(b, out, lse, ref, what)
                            outs[(tile, tma)] = out
                        except AssertionError as exc:
                            failures += 1
                            print(f"FAILED {what}: {str(exc)[:300]}", flush=True)
                        finally:
                            forward._kernels.pop(key)
                            if saved is not None:
                                forward._kernels[key] = saved
                a, c = outs.get((tiles[0], False)), outs.get((tiles[0], True))
                if a is not None and c is not None and not torch.equal(a, c):
                    failures += 1
                    print(f"FAILED {dtype} page {page} window {window}: tma=1 differs from tma=0 in bits", flush=True)
    print(f"decode_tma: {cases} runs, {failures} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
