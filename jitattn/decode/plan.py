"""How a decode call is split over CTAs: chunks of the KV sequence, at most one wave of them."""
from __future__ import annotations

from jitattn.decode.spec import DecodeSpec

MAX_CHUNKS = 256  # keep in sync with templates/decode/kernels.cu.j2 (max_chunks)
MIN_CHUNK_TILES = 2  # shortest split chunk, in pipeline tiles (see split)
ROPE_FULL_WAVE_TILES = 24  # RoPE, 16-bit K/V, D128: a full wave from this many tiles per CTA


def full_wave_min_tiles(spec: DecodeSpec) -> int | None:
    """When a kernel's split may use a full wave of CTAs rather than half of one: when every CTA
    of the full wave would still get at least this many tiles (0: always; None: never). Half a
    wave is best wherever the loads are the bottleneck (fewer partials to write and merge; two
    CTAs per SM keep enough loads in flight); kernels with per-key work beyond the dot products
    (RoPE, fp8 widened on tensor cores) want every resident CTA once the work per CTA is long.
    Why: notes/decode-h200.md, "full_wave_min_tiles"."""
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
    work and enough of it, a full wave (`split_budget`): never a second, partial wave. No chunk
    shorter than MIN_CHUNK_TILES tiles (short chunks cost more in partials and merging than they
    gain), and at most MAX_CHUNKS. One chunk means one launch and no merge. Chunks are whole
    tiles, so only the last one has a ragged end. This holds from kv_len 1 (one chunk) to 128k,
    MHA and GQA alike: GQA has fewer CTAs per chunk, so it gets more chunks. Interleaved chunks,
    a split filling 2 CTAs on every SM, and an even share of all heads' tiles per CTA were
    measured and not taken (notes/decode-h200.md, "split")."""
    tiles = -(-rows // tile)
    chunks = max(1, min(capacity // ctas_per_chunk, -(-tiles // MIN_CHUNK_TILES), MAX_CHUNKS))
    chunk_len = -(-tiles // chunks) * tile
    return chunk_len, -(-rows // chunk_len)
