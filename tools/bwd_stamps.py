"""Where a backward CTA's time goes: clock stamps inside the wgmma main kernel (varlen_bwd).

Two steps, because the stamps are a throwaway edit of the kernel and the GPU machine should not
compile:

  python3 tools/bwd_stamps.py build /tmp/stamps      # here (CPU): copy jitattn/ and templates/,
                                                     # insert the stamps, prewarm the bf16 D64 / D128
                                                     # backward for sm_90a, pack stamps-pack.tar.gz
  python3 tools/bwd_stamps.py run --tree /tmp/stamps # on the H200 (seed: stamps-pack.tar.gz and the
                                                     # forward's kernels, e.g. the GPU tests' pack):
                                                     # a CTA per key tile
  python3 tools/bwd_stamps.py run --tree /tmp/stamps --persistent  # the persistent variant: a
                                                     # record is each CTA's last item's

What the copy's kernel records (thread 0 of each CTA unless said; `clock()` of its SM, two
`%globaltimer` reads for the clock rate and the per-SM timeline) into a 160-word record a CTA,
which the launcher copies to the file named by JITATTN_STAMPS after the launch:
  0-1 globaltimer at entry, 2 clock at entry, 3 K / V landed (compute warps' barrier), 4 loop end,
  5 epilogue end, 6-7 globaltimer at exit, 8 SM id, 9 query tiles walked, 10 loader warp done,
  11 dQ writer done, 13 loop end of thread 128 (the second warpgroup),
  16 + i / 80 + i: clock after / before the wait for query tile i's stage (i < 64),
  144 + i / 208 + i: before / after named barrier 1 (both warpgroups' dS^T written),
  272 + i / 336 + i: before / after the wait for a free dQ hand-off buffer.
Each insertion asserts the text it anchors on, so a template change fails here, not silently.

`run` times one warm training step (bf16, 8 x 4096 tokens, 32 heads, full and causal) and prints
medians over the CTAs: prologue (entry -> K / V, -> first tile), per-tile time (the first two
tiles, which a causal walk masks, apart), the wait for the producer, epilogue, the gap between
CTAs on an SM, how busy the SMs were over the kernel's span and (a CTA per key tile) where an
SM's span goes, summed over its CTAs: their starts, tiles, epilogues and the gaps between them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = """[[spec]]
family = "varlen_backward"
head_dim = [64, 128]
dtype = "bfloat16"
wgmma = true
producer = true
persistent = [false, true]
"""
RECORD = 400  # 32-bit words a CTA
MAX_CTAS = 16384

# (anchor text in templates/varlen/backward_wgmma.cuh or backward_wgmma_producer.cuh, replacement);
# each anchor must occur once.
KERNEL_EDITS = [
    ("__global__ void __launch_bounds__(THREADS, 1) varlen_bwd(",
     f"__device__ unsigned g_stamps[{MAX_CTAS} * {RECORD}];\n"
     "__device__ __forceinline__ unsigned long long stamp_gtime() {\n"
     "  unsigned long long t; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t)); return t; }\n"
     "__device__ __forceinline__ unsigned stamp_smid() { unsigned r; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(r)); return r; }\n"
     "__global__ void __launch_bounds__(THREADS, 1) varlen_bwd("),
    ("  const BwdParams& p = args.p;\n",
     "  const BwdParams& p = args.p;\n"
     f"  unsigned* ST = g_stamps + (blockIdx.x % {MAX_CTAS}) * {RECORD};\n"
     "  if (threadIdx.x == 0) { const unsigned long long t = stamp_gtime(); ST[0] = unsigned(t); ST[1] = unsigned(t >> 32);\n"
     "    ST[2] = clock(); ST[8] = stamp_smid(); }\n"),
    ("  Work w;  // the CTA's one work item (PERSISTENT: the loader decodes each into item_work)\n"
     "  if (!decode_work(p, w)) return;",
     "  Work w;\n  if (!decode_work(p, w)) return;\n"
     "  if (threadIdx.x == 0) ST[9] = w.m_end - w.m_begin;"),
    # persistent: the record is the CTA's last item's (its tile count here, its tiles' stamps below)
    ("  if constexpr (PERSISTENT) mbarrier_wait(&kv_full, done & 1);  // this item's K / V copied",
     "  if constexpr (PERSISTENT) mbarrier_wait(&kv_full, done & 1);  // this item's K / V copied\n"
     "  if (PERSISTENT && tid == 0) ST[9] = tiles;"),
    ("        ITEM_END(release_item)\n        bulk_wait<0, false>();\n      } else if",
     "        ITEM_END(release_item)\n        bulk_wait<0, false>();\n        ST[11] = clock();\n      } else if"),
    ("      allow_dependent_launch();\n      return;",
     "      if (warp == LOADER_WARP && lane == 0) ST[10] = clock();\n      allow_dependent_launch();\n      return;"),
    ("    named_barrier(INIT_BAR, THREADS);  // every compute thread's K and V copies landed; the barriers initialized\n  }",
     "    named_barrier(INIT_BAR, THREADS);  // every compute thread's K and V copies landed; the barriers initialized\n"
     "    if (tid == 0) ST[3] = clock();\n  }"),
    ("      mbarrier_wait(&full[stage], (q / STAGES) & 1);",
     "      if (tid == 0 && i < 64) ST[80 + i] = clock();\n"
     "      mbarrier_wait(&full[stage], (q / STAGES) & 1);\n"
     "      if (tid == 0 && i < 64) ST[16 + i] = clock();"),
    ("    named_barrier(1, CONSUMERS);  // both warpgroups' dS^T written",
     "    if (tid == 0 && i < 64) ST[144 + i] = clock();\n"
     "    named_barrier(1, CONSUMERS);  // both warpgroups' dS^T written\n"
     "    if (tid == 0 && i < 64) ST[208 + i] = clock();"),
    ("        if (q >= DQ_STAGES) mbarrier_wait(&dq_empty[b], (q / DQ_STAGES + 1) & 1);",
     "        if (tid == 0 && i < 64) ST[272 + i] = clock();\n"
     "        if (q >= DQ_STAGES) mbarrier_wait(&dq_empty[b], (q / DQ_STAGES + 1) & 1);\n"
     "        if (tid == 0 && i < 64) ST[336 + i] = clock();"),
    ("  allow_dependent_launch();\n\n  // Epilogue",
     "  if (tid == 0) ST[4] = clock();\n  if (tid == 128) ST[13] = clock();\n"
     "  allow_dependent_launch();\n\n  // Epilogue"),
    ("                                    [] { named_barrier(2, CONSUMERS); });\n  }",
     "                                    [] { named_barrier(2, CONSUMERS); });\n  }\n"
     "  if (tid == 0) { ST[5] = clock(); const unsigned long long t = stamp_gtime(); ST[6] = unsigned(t);\n"
     "    ST[7] = unsigned(t >> 32); }"),
]
LAUNCH_ANCHOR = ("    launch_dependent(varlen_bwd_post, dim3(static_cast<unsigned>(post_ctas(p))), POST_THREADS, stream, p);\n"
                 "{% endif %}")
LAUNCH_DUMP = f"""
{{% if wgmma %}}
    if (const char* path = getenv("JITATTN_STAMPS")) {{  // bwd_stamps: the records of this launch
      static std::vector<unsigned> host({MAX_CTAS} * {RECORD});
      cudaStreamSynchronize(stream);
      cudaMemcpyFromSymbol(host.data(), g_stamps, host.size() * 4);
      if (FILE* fh = fopen(path, "wb")) {{ fwrite(host.data(), 4, host.size(), fh); fclose(fh); }}
    }}
{{% endif %}}"""


def edit_once(text: str, anchor: str, replacement: str, where: str) -> str:
    if text.count(anchor) != 1:
        sys.exit(f"bwd_stamps: the anchor below occurs {text.count(anchor)} times in {where} "
                 f"(the template changed: update KERNEL_EDITS):\n{anchor}")
    return text.replace(anchor, replacement)


def build(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    for part in ("jitattn", "templates"):
        shutil.copytree(ROOT / part, out / part, ignore=shutil.ignore_patterns("__pycache__"))
    # The kernel's body spans backward_wgmma.cuh and its producer part: each anchor is edited where it is.
    parts = [out / "templates/varlen/backward_wgmma.cuh", out / "templates/varlen/backward_wgmma_producer.cuh"]
    texts = {part: part.read_text() for part in parts}
    for anchor, replacement in KERNEL_EDITS:
        holder = next((part for part in parts if anchor in texts[part]), parts[0])
        texts[holder] = edit_once(texts[holder], anchor, replacement, holder.name)
    for part, text in texts.items():
        part.write_text(text)
    launcher = out / "templates/varlen/backward.cu.j2"
    text = edit_once(launcher.read_text(), LAUNCH_ANCHOR, LAUNCH_ANCHOR + LAUNCH_DUMP, launcher.name)
    text = edit_once(text, "#include <climits>\n", "#include <climits>\n#include <cstdio>\n#include <cstdlib>\n#include <vector>\n",
                     launcher.name)
    launcher.write_text(text)
    (out / "stamps.toml").write_text(MANIFEST)
    env = dict(os.environ, PYTHONPATH=str(out), JITATTN_CACHE_DIR=str(out / "cache"))
    for args in (["prewarm", "stamps.toml", "--arch", "9.0"],
                 ["cache", "pack", "stamps-pack.tar.gz", "--manifest", "stamps.toml"]):
        subprocess.run([sys.executable, "-m", "jitattn", *args], cwd=out, env=env, check=True)
    print(f"instrumented tree in {out}; seed pack {out / 'stamps-pack.tar.gz'}")


def run(tree: Path, dims: list[int], persistent: bool = False) -> None:
    sys.path.insert(0, str(tree))
    import numpy as np
    import torch
    import jitattn
    if not Path(jitattn.__file__).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"bwd_stamps: jitattn imported from {jitattn.__file__}, not from {tree}")
    # The variant asked for (persistent is the default at D64 / D128): a CTA per SM, each record
    # its last item's (prologue lines: the CTA's start), or a CTA per key tile.
    from jitattn.varlen import backward_launch
    backward_launch.PERSISTENT_HEAD_DIMS = frozenset({64, 128}) if persistent else frozenset()
    backward_launch._kernels.clear()
    path = str(tree / "stamps.bin")
    wrap = 1 << 32
    for head_dim in dims:
        for causal in (False, True):
            batch, seq, heads = 8, 4096, 32
            tokens = batch * seq
            q, k, v = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            grad = torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seq
            window = (-1, 0) if causal else (-1, -1)

            def step():
                jitattn.varlen_attn(q, k, v, cu, cu, seq, seq, window_size=window).backward(grad)

            for _ in range(4):
                step()
            torch.cuda.synchronize()
            os.environ["JITATTN_STAMPS"] = path
            step()
            torch.cuda.synchronize()
            del os.environ["JITATTN_STAMPS"]
            ctas = batch * heads * (seq // 128)
            if persistent:
                ctas = min(ctas, torch.cuda.get_device_properties(0).multi_processor_count)
            S = np.fromfile(path, dtype=np.uint32).reshape(-1, RECORD)[:ctas].astype(np.int64)
            cycles = lambda a, b: (S[:, b] - S[:, a]) % wrap
            t0, t1 = S[:, 0] + (S[:, 1] << 32), S[:, 6] + (S[:, 7] << 32)
            ghz = float(np.median(cycles(2, 5) / np.maximum(t1 - t0, 1)))
            us = lambda c: float(c) / ghz / 1000
            tiles = S[:, 9]
            print(f"\nD{head_dim} {batch}x{seq} {'causal' if causal else 'full'}: {ctas} CTAs, SM clock {ghz:.3f} GHz, "
                  f"median {np.median(tiles):.0f} query tiles a CTA")
            for name, a, b in (("entry -> K/V landed", 2, 3), ("K/V landed -> first tile ready", 3, 16),
                               ("loop end -> epilogue stored", 4, 5), ("entry -> exit", 2, 5)):
                x = cycles(a, b)
                print(f"  {name:32s} {us(np.median(x)):8.2f} us  (p10 {us(np.percentile(x, 10)):.2f}, "
                      f"p90 {us(np.percentile(x, 90)):.2f})")
            first, rest, waits, bar1, dq_free = [], [], [], [], []
            for r in range(ctas):
                n = int(tiles[r])
                if not 2 <= n <= 64:
                    continue
                after, before = S[r, 16:16 + n], S[r, 80:80 + n]
                durations = (np.append(after[1:], S[r, 4]) - after) % wrap
                first += durations[:2].tolist()
                rest += durations[2:].tolist()
                waits += ((after - before) % wrap).tolist()
                bar1 += ((S[r, 208:208 + n] - S[r, 144:144 + n]) % wrap).tolist()
                dq_free += ((S[r, 336:336 + n] - S[r, 272:272 + n]) % wrap).tolist()
            print(f"  tile: first two {us(np.median(first)):.3f} us, the rest {us(np.median(rest)):.3f} us; "
                  f"waiting (mean a tile) for the producer {us(np.mean(waits)):.3f} us, at barrier 1 "
                  f"{us(np.mean(bar1)):.3f} us, for a dQ buffer {us(np.mean(dq_free)):.3f} us")
            sm = S[:, 8]
            busy, gaps = 0, []
            for s in np.unique(sm):
                order = np.where(sm == s)[0]
                order = order[np.argsort(t0[order])]
                busy += int((t1[order] - t0[order]).sum())
                gaps += (t0[order][1:] - t1[order][:-1]).tolist()
            span = int(t1.max() - t0.min())
            print(f"  span {span / 1000:.0f} us, SMs busy {busy / (span * len(np.unique(sm))):.3f}, "
                  f"exit -> next entry on an SM {np.median(gaps) / 1000:.2f} us")
            if persistent:  # one record a CTA (its last item): no per-SM sum
                continue
            # Where an SM's span goes, summed over its CTAs and averaged over the SMs (us): the
            # CTAs' starts (entry -> first tile's stage ready), their tiles (the first two apart),
            # their epilogues, the gaps between CTAs, and the idle head / tail of the span.
            sms = len(np.unique(sm))
            walked = (tiles >= 1) & (tiles <= 64)
            start = cycles(2, 16)[walked].sum() / ghz / 1000 / sms
            loop = cycles(16, 4)[walked].sum() / ghz / 1000 / sms
            first_two = np.sum(first) / ghz / 1000 / sms
            epilogue = cycles(4, 5)[walked].sum() / ghz / 1000 / sms
            edges = sum(int(t0[sm == s].min() - t0.min()) + int(t1.max() - t1[sm == s].max()) for s in np.unique(sm))
            print(f"  an SM's span: CTA starts {start:.0f}, tiles {loop:.0f} (the first two of each CTA "
                  f"{first_two:.0f}), epilogues {epilogue:.0f}, gaps {np.sum(gaps) / 1000 / sms:.0f}, "
                  f"idle head + tail {edges / 1000 / sms:.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="instrumented copy of the tree, prewarmed and packed (CPU)")
    b.add_argument("out", type=Path)
    r = sub.add_parser("run", help="one stamped training step per shape (GPU)")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--dims", nargs="*", type=int, default=[128, 64])
    r.add_argument("--persistent", action="store_true", help="the persistent variant (records: each CTA's last item)")
    args = ap.parse_args()
    if args.command == "build":
        build(args.out)
    else:
        run(args.tree, args.dims, args.persistent)


if __name__ == "__main__":
    main()
