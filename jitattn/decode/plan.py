"""How a decode call is split over CTAs: chunks of the KV sequence, at most one wave of them."""
from __future__ import annotations

from jitattn.decode.spec import DecodeSpec

MAX_CHUNKS = 256  # keep in sync with templates/decode/kernels.cu.j2 (max_chunks)
MIN_CHUNK_TILES = 2  # shortest split chunk, in pipeline tiles (see split)
ROPE_FULL_WAVE_TILES = 24  # RoPE, 16-bit K/V, D128: a full wave from this many tiles per CTA


def full_wave_min_tiles(spec: DecodeSpec) -> int | None:
    """When a kernel's split may use a full wave of CTAs rather than half of one: when every CTA
    of the full wave would still get at least this many tiles (0: always; None: never). Half a
    wave is best wherever the loads are the bottleneck: fewer partials to write and merge, and two
    CTAs per SM already keep 64 KB of loads in flight. Kernels with per-key work beyond the dot
    products want every resident CTA to hide its latency once the work per CTA is long (H200,
    D128, cold L2 split sweeps, µs, half / full wave):
    - RoPE on 16-bit K/V at head_dim 128: full from 24 tiles per CTA. 32/32 32k 149 / 127
      (62 tiles per CTA), 32/4 128k 80.3 / 72.8 (31), 32/8 128k 146 / 129; but 32/8 32k
      39.4 / 40.8 (15.5), 32/4 32k 25.5 / 27.2, 32/8 4k 13.5 / 15.5, 32/32 4k 24.3 / 24.8 (7.8).
    - RoPE at other head dims: always full. D256 has one key block per warp (less ILP) and took
      32/32 4k 58.0 / 44.7, 32k 392 / 267; D64 32/32 4k 18.8 / 16.8, 32/8 32k 28.4 / 26.4
      (32/8 4k 11.1 / 11.8 the one case the other way).
    - fp8 K/V with RoPE, or on tensor cores (widening in registers): always full. fp8 + RoPE
      32/8 32k 38.3 / 35.2, 32/32 4k 24.4 / 22.3; fp8 on tensor cores 32/8 32k 28.4 -> 26.4 and
      128k 86.6 -> 76.1 (4k: 11.6 -> 11.9).
    Half a wave stayed best for every other kernel (fp8 on CUDA cores: 68.8 vs 69.1 at 32/32)."""
    fp8 = spec.dtype_kv.startswith("float8")
    if fp8 and (spec.tensor_cores or spec.pos_encoding == "ROPE_LLAMA"):
        return 0
    if spec.pos_encoding == "ROPE_LLAMA":
        return ROPE_FULL_WAVE_TILES if spec.head_dim == 128 else 0
    return None


def split_budget(wave: int, full_wave_tiles: int | None, cta_tiles: int) -> int:
    """CTAs the split may use (split's capacity): a full `wave` when `cta_tiles` (the call's
    tiles over all of its KV heads and group tiles) give every CTA of it `full_wave_tiles` tiles
    (full_wave_min_tiles), half a wave otherwise."""
    return wave if full_wave_tiles is not None and cta_tiles >= full_wave_tiles * wave else wave // 2


def split(rows: int, ctas_per_chunk: int, tile: int, capacity: int) -> tuple[int, int]:
    """(chunk_len, num_chunks) for `rows` KV rows.

    Rule: the most chunks whose CTAs fit in `capacity`, which the caller sets to half a wave
    (SMs x resident CTAs per SM, from the kernel's occupancy, / 2) or, for kernels with per-key
    work and enough of it, a full wave (`split_budget`): never a second, partial wave. No chunk shorter than
    MIN_CHUNK_TILES tiles (short chunks cost more in partials and merging than they gain), and at
    most MAX_CHUNKS. One chunk means one launch and no merge. Chunks are whole tiles, so only the
    last one has a ragged end. This holds from kv_len 1 (one chunk) to 128k, MHA and GQA alike:
    GQA has fewer CTAs per chunk, so it gets more chunks.

    Measured and not taken (H200, same run, cold L2, us): chunks of interleaved tiles (chunk c
    reads tiles c, c + n, ...: every CTA of a head in one narrow address window) ran no faster
    (32/8 4k 11.1 / 11.1, 32k 37.8 / 37.7; 32/32 32k 122.1 / 124.0), and 33 chunks at 32/8,
    which fill 2 CTAs on every SM, ran slower than this rule's 16 (32k 38.5-38.8 vs 37.6,
    8k 15.7-15.8 vs 15.0): more partials cost more than the 4 idle SMs of a 128-CTA split.
    Nor did CTAs sharing all heads' tiles evenly (132 at 32/8, 264 at 32/32), where a share that
    ends one KV head merges its states and restarts the ring on the next (its first tiles issued
    during that merge): the restart costs about a loaded memory latency, more than the 3% it
    balances (32/8 32k 40.6-40.9 vs 38.8 with the same kernel and this rule's 128 CTAs; 32/32
    32k 129.2-129.5 vs 125.0; 4k 12.4 / 24.0 vs 11.7 / 23.2), and that kernel cost 0.5-1 us more
    than this one even on this rule's split (32/8 4k 11.7 vs 11.2, 32k 38.5 vs 37.4; 32/32 4k
    23.0 vs 22.1, 32k 122.8 vs 121.8), with its 64-bit share arithmetic or its merge batch of 5
    back as here alike, and 0.3-0.7 us of it stayed with one segment and no loop: the cost is
    spread over the restructure. An even split needs the ring to run on across the head change,
    with the finished head's states merged outside the ring's memory."""
    tiles = -(-rows // tile)
    chunks = max(1, min(capacity // ctas_per_chunk, -(-tiles // MIN_CHUNK_TILES), MAX_CHUNKS))
    chunk_len = -(-tiles // chunks) * tile
    return chunk_len, -(-rows // chunk_len)
