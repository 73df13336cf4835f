"""The decode split-KV rule (jitattn/decode/plan.py): chunks of whole tiles, at most one wave (CPU only)."""
import re
from pathlib import Path

import pytest

from jitattn.decode import plan
from jitattn.decode.spec import DecodeSpec

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"

# split(rows, ctas_per_chunk, tile, capacity): capacity is the CTAs one wave holds
# (SMs x resident CTAs per SM); an H200 has 132 SMs.

SMS = 132
CTAS_PER_SM = 4
WAVE = SMS * CTAS_PER_SM


def fp16_tile(head_dim: int) -> int:
    """A realistic split tile for these tests: the CUDA-core kernel's stage for 16-bit K/V
    (16 to 128 rows). The kernel reports its own (DecodeKernel.tile_rows, checked in
    tests/test_compile.py); split only needs whole tiles of some size."""
    lanes = 1 << (head_dim // 8 - 1).bit_length()
    return 128 // lanes * 4


def test_max_chunks_matches_the_kernel_template():
    text = (TEMPLATES / "decode" / "kernels.cu.j2").read_text()
    assert re.search(r"{%\s*set max_chunks = (\d+)\s*%}", text).group(1) == str(plan.MAX_CHUNKS)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("ctas_per_chunk", [1, 8, 32])
def test_split_gives_one_chunk_when_the_rows_fit_one_tile(head_dim, ctas_per_chunk):
    tile = fp16_tile(head_dim)
    for rows in (1, tile // 2, tile):
        chunk_len, chunks = plan.split(rows, ctas_per_chunk, fp16_tile(head_dim), WAVE)
        assert chunks == 1 and chunk_len >= rows and chunk_len % tile == 0


ROWS = [1, 2, 31, 32, 33, 63, 64, 65, 100, 1000, 4095, 4096, 4097, 32768, 100_003, 1 << 20, 2**31 - 1]


@pytest.mark.parametrize("head_dim", [32, 48, 64, 128, 192, 256])
@pytest.mark.parametrize("ctas_per_chunk", [1, 2, 5, 32, 64, 131, 528, 4096])
@pytest.mark.parametrize("capacity", [SMS, WAVE, 8 * SMS])
def test_split_chunks_are_whole_tiles_cover_the_rows_and_fit_one_wave(head_dim, ctas_per_chunk, capacity):
    tile = fp16_tile(head_dim)
    for rows in ROWS:
        chunk_len, chunks = plan.split(rows, ctas_per_chunk, fp16_tile(head_dim), capacity)
        what = f"rows={rows} ctas_per_chunk={ctas_per_chunk} head_dim={head_dim}: ({chunk_len}, {chunks})"
        assert 1 <= chunks <= plan.MAX_CHUNKS, what
        assert chunk_len > 0 and chunk_len % tile == 0, what
        assert chunks * chunk_len >= rows, what  # every row belongs to a chunk
        assert (chunks - 1) * chunk_len < rows, what  # no empty chunk
        if chunks > 1:
            assert chunks * ctas_per_chunk <= capacity, what  # never a second, partial wave
        if ctas_per_chunk * 2 > capacity:
            assert chunks == 1, what  # one chunk already fills the wave


def test_split_of_a_long_sequence_over_one_head_uses_max_chunks():
    chunk_len, chunks = plan.split(1 << 20, 1, fp16_tile(128), WAVE)
    assert chunks == plan.MAX_CHUNKS
    assert chunk_len == (1 << 20) // plan.MAX_CHUNKS


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_split_of_32_kv_heads_at_4096_rows_fills_at_most_one_wave(head_dim):
    chunk_len, chunks = plan.split(4096, 32, fp16_tile(head_dim), WAVE)
    assert chunks > 1  # 32 CTAs alone would leave most of the 132 SMs idle
    assert chunks * 32 <= WAVE
    assert chunks * 32 >= SMS  # ...and at least one CTA per SM
    assert chunk_len * (chunks - 1) < 4096 <= chunk_len * chunks


def test_split_budget_is_half_a_wave_except_fp8_compute_and_rope():
    wave = 2 * SMS
    for spec in (DecodeSpec(128, dtype_kv="float8_e4m3fn", pos_encoding="ROPE_LLAMA"),
                 DecodeSpec(128, dtype_kv="float8_e5m2", tensor_cores=True, group_tile=4),
                 DecodeSpec(64, pos_encoding="ROPE_LLAMA", tensor_cores=True),
                 DecodeSpec(256, pos_encoding="ROPE_LLAMA", tensor_cores=True, group_tile=4)):
        assert plan.full_wave_min_tiles(spec) == 0, spec  # compute-bound: always a full wave
        assert plan.split_budget(wave, 0, 1) == wave
    for spec in (DecodeSpec(128), DecodeSpec(128, pos_encoding="ALIBI"), DecodeSpec(128, tensor_cores=True),
                 DecodeSpec(128, dtype_kv="float8_e4m3fn")):
        assert plan.full_wave_min_tiles(spec) is None, spec
        assert plan.split_budget(wave, None, 1 << 40) == wave // 2
    for spec in (DecodeSpec(128, pos_encoding="ROPE_LLAMA"), DecodeSpec(128, pos_encoding="ROPE_LLAMA", tensor_cores=True)):
        tiles = plan.full_wave_min_tiles(spec)
        assert tiles == plan.ROPE_FULL_WAVE_TILES, spec
        assert plan.split_budget(wave, tiles, tiles * wave - 1) == wave // 2
        assert plan.split_budget(wave, tiles, tiles * wave) == wave


def test_rope_splits_over_a_full_wave_only_for_long_work():
    """The H200 sweeps behind ROPE_FULL_WAVE_TILES (64-row tiles, 2 CTAs per SM): RoPE 32/32 and
    32/8 at 128k took a full wave, 32/8 at 32k and 4k half of one."""
    wave, tiles = 2 * SMS, plan.ROPE_FULL_WAVE_TILES
    for kv_heads, kv_len, full in [(32, 32768, True), (8, 131072, True), (8, 32768, False), (32, 4096, False)]:
        budget = plan.split_budget(wave, tiles, -(-kv_len // 64) * kv_heads)
        assert budget == (wave if full else wave // 2), (kv_heads, kv_len)
