"""single_decode_with_kv_cache on a GPU against the float64 reference (skipped without a GPU)."""
import itertools

import pytest
import torch

import jitattn
from jitattn.checks import DTYPE_NAMES
from jitattn.decode.spec import DecodeSpec
from jitattn.reference import single_decode_reference
from tests.gpu_utils import assert_close, poison_allocator

pytestmark = pytest.mark.gpu

TOL = {torch.float16: (4e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative, max abs) on out
HEADS = [(4, 4), (8, 2), (16, 2), (12, 4), (16, 1)]  # group sizes 1, 4, 8, 3, 16
KV_LENS = [1, 7, 255, 4096, 32768]


def make_inputs(num_qo, num_kv, kv_len, head_dim, dtype, layout, seed, q_gain=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(num_qo, head_dim, device="cuda", dtype=dtype, generator=g) * q_gain
    shape = (kv_len, num_kv, head_dim) if layout == "NHD" else (num_kv, kv_len, head_dim)
    k = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def check_decode(q, k, v, layout, window, cap, want_lse, what):
    poison_allocator(q.numel() * q.element_size())
    result = jitattn.single_decode_with_kv_cache(
        q, k, v, kv_layout=layout, window_left=window, logits_soft_cap=cap, return_lse=want_lse
    )
    ref_out, ref_lse = single_decode_reference(q, k, v, kv_layout=layout, window_left=window, logits_soft_cap=cap)
    out, lse = result if want_lse else (result, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    rel, abs_ = TOL[q.dtype]
    assert_close(out, ref_out, rel, abs_, what)
    if want_lse:
        assert lse.shape == (q.shape[0],) and lse.dtype == torch.float32
        assert_close(lse, ref_lse, 1e-4, 2e-3, what + " lse")


# Every head_dim x dtype x layout x GQA x kv_len; cap/window/lse rotate through their 8
# combinations so each value of each meets every shape dimension.
GRID = list(itertools.product([64, 128, 256], [torch.float16, torch.bfloat16], ["NHD", "HND"], HEADS, KV_LENS))


@pytest.mark.parametrize("case", range(len(GRID)))
def test_decode_matches_reference_on_grid(case):
    head_dim, dtype, layout, (num_qo, num_kv), kv_len = GRID[case]
    cap_on, window_on, want_lse = ((case >> b) & 1 for b in range(3))
    window = [-1, max(0, kv_len // 3)][window_on]
    cap = 30.0 if cap_on else None
    q, k, v = make_inputs(num_qo, num_kv, kv_len, head_dim, dtype, layout, seed=case, q_gain=2.0)
    what = f"d{head_dim} {dtype} {layout} {num_qo}/{num_kv} L={kv_len} cap={cap} win={window} lse={want_lse}"
    check_decode(q, k, v, layout, window, cap, bool(want_lse), what)


@pytest.mark.parametrize("cap,window,want_lse", list(itertools.product([None, 50.0], [-1, 0, 1, 100, 5000], [False, True])))
def test_decode_cap_window_lse_combinations(cap, window, want_lse):
    q, k, v = make_inputs(32, 8, 3000, 128, torch.float16, "NHD", seed=7)
    check_decode(q, k, v, "NHD", window, cap, want_lse, f"cap={cap} win={window}")


@pytest.mark.parametrize("head_dim", [32, 48, 96, 160, 256])
def test_decode_unusual_head_dims(head_dim):
    q, k, v = make_inputs(8, 2, 777, head_dim, torch.bfloat16, "HND", seed=head_dim)
    check_decode(q, k, v, "HND", -1, None, True, f"d{head_dim}")


def test_decode_non_contiguous_and_misaligned_inputs():
    q_full, k_full, v_full = make_inputs(16, 8, 1000, 128, torch.float16, "NHD", seed=3)
    # Strided views the kernel reads in place (every other kv head) ...
    k, v = k_full[:, ::2], v_full[:, ::2]
    q = q_full[::2]
    check_decode(q, k, v, "NHD", -1, None, True, "strided views")
    # ... and views it must copy (unit last stride missing; base not 16-byte aligned).
    kt = k_full.transpose(0, 2).contiguous().transpose(0, 2)[:, :4]
    check_decode(q, kt, v[:, :4].contiguous(), "NHD", -1, None, False, "last-dim strided")
    flat = torch.randn(1 + 1000 * 4 * 128, device="cuda", dtype=torch.float16)
    k_odd = flat[1:].view(1000, 4, 128)
    check_decode(q, k_odd, v[:, :4], "NHD", -1, None, False, "misaligned base")


def test_decode_default_scale_and_explicit_scales():
    q, k, v = make_inputs(8, 8, 513, 128, torch.float16, "NHD", seed=11)
    out = jitattn.single_decode_with_kv_cache(q, k, v, sm_scale=0.05, q_scale=2.0, k_scale=0.5)
    ref, _ = single_decode_reference(q, k, v, sm_scale=0.05, q_scale=2.0, k_scale=0.5)
    assert_close(out, ref, 4e-3, 2e-2, "explicit scales")


def test_decode_large_logits_are_stable():
    # Logits of magnitude ~1e3: the online softmax must not overflow.
    q, k, v = make_inputs(4, 4, 4096, 64, torch.float16, "NHD", seed=5, q_gain=30.0)
    check_decode(q, k, v, "NHD", -1, None, True, "large logits")


# K profiles along the sequence that move each head's running max late and often: the online
# softmax must rescale what it accumulated (a steady climb, one late spike, a late rise).
def _shape_keys(k, q, profile):
    n, num_kv = k.shape[0], k.shape[1]
    if profile == "climb":  # rows scaled 0.1 -> 4: the max keeps moving
        return k * torch.linspace(0.1, 4.0, n, device=k.device, dtype=torch.float64)[:, None, None].to(k.dtype)
    if profile == "late_spike":  # one late row along its group's mean query: a jump of hundreds
        k = k.clone()
        k[n - 700] = 2 * q.view(num_kv, -1, q.shape[1]).float().mean(1).to(k.dtype)
        return k
    # "late_rise": the last 1000 rows x1.5, rises of a few log2 units
    return torch.cat([k[:-1000], k[-1000:] * 1.5])


@pytest.mark.parametrize("profile", ["climb", "late_spike", "late_rise"])
@pytest.mark.parametrize("heads,use_tensor_cores", [((4, 4), False), ((4, 4), True), ((12, 4), False),
                                                    ((16, 2), False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_running_max_moving_late_and_often(profile, heads, use_tensor_cores, dtype):
    q, k, v = make_inputs(*heads, 5000, 128, dtype, "NHD", seed=len(profile) + heads[0], q_gain=3.0)
    check_modes(q, _shape_keys(k, q, profile), v, f"max profile {profile} {heads} tc={use_tensor_cores} {dtype}",
                use_tensor_cores=use_tensor_cores)


def test_decode_is_deterministic():
    q, k, v = make_inputs(32, 8, 20000, 128, torch.bfloat16, "NHD", seed=9)
    first = jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True)
    for _ in range(3):
        again = jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("use_tensor_cores", [False, True])
def test_decode_split_paths_agree_bitwise_across_calls_streams_and_graphs(use_tensor_cores):
    """A split call's partials are combined in a fixed order (merge_chunks), so repeated calls,
    calls alternating between streams and CUDA graph replays all give the same bits."""
    q, k, v = make_inputs(32, 8, 20000, 128, torch.float16, "NHD", seed=23)
    call = lambda: jitattn.single_decode_with_kv_cache(q, k, v, use_tensor_cores=use_tensor_cores, return_lse=True)
    first = call()
    ref, ref_lse = single_decode_reference(q, k, v)
    assert_close(first[0], ref, 4e-3, 2e-2, "split")
    assert_close(first[1], ref_lse, 1e-4, 2e-3, "split lse")
    results = [call() for _ in range(3)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for i in range(6):
        stream = streams[i % 2]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            results.append(call())
        torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            captured = call()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        results.append(tuple(t.clone() for t in captured))
    results.append(call())  # eager again after the graph ran
    for i, (out, lse) in enumerate(results):
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), f"result {i} differs"


def test_decode_runs_on_the_current_stream():
    q, k, v = make_inputs(32, 32, 8192, 128, torch.float16, "NHD", seed=13)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were made on the default stream
    with torch.cuda.stream(stream):
        out = jitattn.single_decode_with_kv_cache(q, k, v)
    stream.synchronize()
    ref, _ = single_decode_reference(q, k, v)
    assert_close(out, ref, 4e-3, 2e-2, "side stream")


@pytest.mark.parametrize("use_tensor_cores", [False, True])
@pytest.mark.parametrize("heads,kv_len", [((32, 32), 4096), ((32, 8), 300), ((8, 8), 16)])
def test_decode_sees_inputs_written_by_the_kernel_just_before_it(use_tensor_cores, heads, kv_len):
    """decode_chunk is launched as a programmatic dependent of whatever kernel precedes it on the
    stream: it must still read q and the KV row that kernel writes (a token appended right
    before the step), never the values from before. The new last row carries q's direction at
    a large gain, so a stale read of either changes the output far beyond the tolerance."""
    num_qo, num_kv = heads
    q, k, v = make_inputs(num_qo, num_kv, kv_len, 128, torch.float16, "NHD", seed=19)
    g = torch.Generator(device="cuda").manual_seed(23)
    for step in range(6):
        new_q = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
        new_k = new_q.view(num_kv, num_qo // num_kv, 128).mean(1) * 4
        new_v = torch.randn(num_kv, 128, device="cuda", dtype=v.dtype, generator=g) * 3
        torch.cuda._sleep(200_000)  # a long kernel ahead, so the writes below finish late
        q.copy_(new_q)
        k[-1].copy_(new_k)
        v[-1].copy_(new_v)  # the kernel right before the decode
        out = jitattn.single_decode_with_kv_cache(q, k, v, use_tensor_cores=use_tensor_cores)
        torch.cuda.synchronize()
        ref, _ = single_decode_reference(q, k, v)
        assert_close(out, ref, 4e-3, 2e-2, f"step {step}")


def test_decode_cuda_graph_replay_matches_eager():
    q, k, v = make_inputs(32, 8, 4096, 128, torch.float16, "NHD", seed=17)
    eager = jitattn.single_decode_with_kv_cache(q, k, v)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        jitattn.single_decode_with_kv_cache(q, k, v)  # warm up (loads the module) off-graph
        with torch.cuda.graph(graph):
            captured = jitattn.single_decode_with_kv_cache(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = single_decode_reference(q, k, v)
    assert_close(captured, ref, 4e-3, 2e-2, "graph replay with new q")
    assert not torch.equal(captured, eager)


# ---------------------------------------------------------------- positional encodings and fp8
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
POS_GRID = list(itertools.product(["ROPE_LLAMA", "ALIBI"], [64, 128, 256], [torch.float16, torch.bfloat16],
                                  ["NHD", "HND"], [(8, 8), (16, 4)], [1, 255, 4096, 32768]))


def check_modes(q, k, v, what, layout="NHD", **kwargs):
    want_lse = kwargs.pop("return_lse", True)
    tensor_cores = kwargs.pop("use_tensor_cores", False)
    poison_allocator(q.numel() * q.element_size())
    out, lse = jitattn.single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True,
                                                   use_tensor_cores=tensor_cores, **kwargs)
    ref_out, ref_lse = single_decode_reference(q, k, v, kv_layout=layout, **kwargs)
    rel, abs_ = TOL[q.dtype]
    assert_close(out, ref_out, rel, abs_, what)
    if want_lse:
        # ALiBi biases reach slope * kv_len: compare the LSE relative to its size. The tensor-core
        # path feeds RoPE-rotated q and k to the MMA re-rounded to q's dtype, which costs bf16
        # about 2^-9 of each logit: its LSE gets a bf16-sized tolerance (the output does not).
        mode = kwargs.get("pos_encoding_mode", "NONE")
        runs_on_tensor_cores = DecodeSpec.for_call(  # the kernel this call ran (RoPE picks tensor cores)
            q.shape[1], DTYPE_NAMES[q.dtype], DTYPE_NAMES[k.dtype], mode, bool(kwargs.get("logits_soft_cap")),
            q.shape[0] // k.shape[1 if layout == "NHD" else 0], tensor_cores).tensor_cores
        rounded = runs_on_tensor_cores and mode == "ROPE_LLAMA"
        rel, abs_ = (5e-4, 1e-2) if rounded and q.dtype == torch.bfloat16 else (1e-4, 2e-3)
        abs_ *= max(1.0, ref_lse.abs().max().item() / 100)
        if rounded:  # up to ~2^-8 (bf16) / 2^-11 (fp16) of a logit: large logits exceed the fixed bound
            abs_ = max(abs_, (2**-7 if q.dtype == torch.bfloat16 else 2**-10) * ref_lse.abs().max().item())
        assert_close(lse, ref_lse, rel, abs_, what + " lse")


@pytest.mark.parametrize("dtype,kv_dtype,window", [(torch.float16, torch.float16, -1), (torch.bfloat16, torch.bfloat16, 9000),
                                                   (torch.float16, torch.float8_e4m3fn, -1)])
def test_decode_rope_chunks_long_enough_to_pipeline(dtype, kv_dtype, window):
    """RoPE on tensor cores switches to computing the next tile's logits beside the current
    tile's softmax once a chunk holds 48 tiles (PIPELINE_MIN_TILES): 32/32 at 32k + 37 has 8
    chunks of 65 and 58 tiles, with a ragged end (fp8 K/V asks for tensor cores, which MHA would
    not pick). The window leaves 141 tiles, split over half a wave (full_wave_min_tiles) in chunks of
    36 and 33 tiles: the other loop of the same kernel."""
    q, k, v = make_inputs(32, 32, 32768 + 37, 128, dtype, "NHD", seed=31)
    check_modes(q, k.to(kv_dtype), v.to(kv_dtype), f"rope long chunks {dtype} {kv_dtype} win={window}",
                pos_encoding_mode="ROPE_LLAMA", window_left=window, use_tensor_cores=True)


@pytest.mark.parametrize("kv_dtype,kv_lens", [(torch.float16, (6144 - 5, 6656, 20000)),
                                               (torch.float8_e4m3fn, (25344 - 3, 27456))])
def test_decode_prefetch_depth_on_both_sides_of_the_short_chunk_switch(kv_dtype, kv_lens):
    """The tensor-core kernel's 6-stage rings prefetch 3 tiles on chunks of up to 12 tiles
    (SHORT_CHUNK_TILES) and 5 on longer ones. On an H200's 132 SMs, 32/8 splits fp16 (32-row
    tiles) into 16 chunks: 6139 rows give 12 tiles (ragged), 6656 give 13; fp8 (64-row tiles,
    33 chunks) 12 at 25341 and 13 at 27456. Other GPUs split differently and still run both."""
    for kv_len in kv_lens:
        q, k, v = make_inputs(32, 8, kv_len, 128, torch.float16, "NHD", seed=kv_len)
        check_modes(q, k.to(kv_dtype), v.to(kv_dtype), f"prefetch depth {kv_dtype} L={kv_len}")


@pytest.mark.parametrize("case", range(len(POS_GRID)))
def test_decode_positional_encodings_match_reference(case):
    mode, head_dim, dtype, layout, (num_qo, num_kv), kv_len = POS_GRID[case]
    q, k, v = make_inputs(num_qo, num_kv, kv_len, head_dim, dtype, layout, seed=1000 + case)
    extra = {"rope_scale": 2.0, "rope_theta": 5e5} if case % 3 == 0 and mode == "ROPE_LLAMA" else {}
    window = kv_len // 2 if case % 4 == 1 else -1
    check_modes(q, k, v, f"{mode} d{head_dim} {dtype} {layout} {num_qo}/{num_kv} L={kv_len} {extra} win={window}",
                layout=layout, pos_encoding_mode=mode, window_left=window, **extra)


@pytest.mark.parametrize("head_dim,dtype,heads", [(48, torch.float16, (8, 8)), (80, torch.bfloat16, (16, 4)),
                                                   (112, torch.float16, (16, 4))])
def test_decode_rope_on_cuda_cores(head_dim, dtype, heads):
    """RoPE runs on tensor cores wherever they apply; a head_dim that is not a multiple of 32
    keeps the CUDA-core kernel's rotation (fp8 K/V too: see the fp8 grid)."""
    assert not DecodeSpec.for_call(head_dim, DTYPE_NAMES[dtype], DTYPE_NAMES[dtype], "ROPE_LLAMA", False,
                                   heads[0] // heads[1]).tensor_cores
    for kv_len, layout in ((1, "NHD"), (3001, "HND"), (20000, "NHD")):
        q, k, v = make_inputs(*heads, kv_len, head_dim, dtype, layout, seed=head_dim + kv_len)
        check_modes(q, k, v, f"rope cuda cores d{head_dim} L={kv_len}", layout=layout, pos_encoding_mode="ROPE_LLAMA",
                    rope_theta=5e5)


@pytest.mark.parametrize("mode", ["ROPE_LLAMA", "ALIBI"])
def test_decode_positional_encodings_with_soft_cap(mode):
    q, k, v = make_inputs(16, 4, 3000, 128, torch.bfloat16, "NHD", seed=77)
    check_modes(q, k, v, f"{mode} + cap", pos_encoding_mode=mode, logits_soft_cap=30.0)


FP8_GRID = list(itertools.product(FP8, [torch.float16, torch.bfloat16], ["NONE", "ROPE_LLAMA", "ALIBI"],
                                  [(8, 8), (16, 4)], [1, 300, 4096, 32768]))


@pytest.mark.parametrize("case", range(len(FP8_GRID)))
def test_decode_fp8_kv_matches_reference(case):
    kv_dtype, dtype, mode, (num_qo, num_kv), kv_len = FP8_GRID[case]
    layout = ["NHD", "HND"][case % 2]
    q, k, v = make_inputs(num_qo, num_kv, kv_len, 128, dtype, layout, seed=2000 + case)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    scales = {"q_scale": 0.5, "k_scale": 2.0, "v_scale": 0.25} if case % 2 else {}
    check_modes(q, k, v, f"{kv_dtype} q={dtype} {mode} {layout} {num_qo}/{num_kv} L={kv_len} {scales}",
                layout=layout, pos_encoding_mode=mode, **scales)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_decode_fp8_kv_other_head_dims(head_dim):
    q, k, v = make_inputs(16, 4, 5000, head_dim, torch.bfloat16, "NHD", seed=head_dim)
    check_modes(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), f"fp8 d{head_dim}")


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_fp8_kv_at_the_largest_values(kv_dtype, dtype):
    """V at the fp8 type's largest magnitude (e5m2: 57344) under uniform attention (q = 0):
    sums of thousands of such rows must stay finite and accurate, v_scale aside."""
    largest = torch.finfo(kv_dtype).max
    q = torch.zeros(8, 128, device="cuda", dtype=dtype)
    k = torch.randn(3001, 8, 128, device="cuda").to(kv_dtype)
    v = torch.full((3001, 8, 128), largest, device="cuda")
    v[::7] = -largest  # mean 5/7 of the largest value: finite in the fp16 output
    v = v.to(kv_dtype)
    poison_allocator(q.numel() * q.element_size())
    out = jitattn.single_decode_with_kv_cache(q, k, v)
    ref, _ = single_decode_reference(q, k, v)
    rel, _ = TOL[dtype]
    # The outputs are ~5/7 of the largest value: the absolute bound scales with them.
    assert_close(out, ref, rel, rel * largest, f"{kv_dtype} at {largest} q={dtype}")


def test_decode_v_scale_scales_the_output_only():
    q, k, v = make_inputs(8, 2, 5000, 128, torch.float16, "NHD", seed=31)
    base, base_lse = jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True)
    scaled, scaled_lse = jitattn.single_decode_with_kv_cache(q, k, v, v_scale=0.5, return_lse=True)
    assert torch.equal(base_lse, scaled_lse)
    assert_close(scaled, base.double() * 0.5, 2e-3, 1e-2, "v_scale")


# ---------------------------------------------------------------- tensor-core path
TC_HEADS = [(8, 8), (16, 4), (32, 4), (32, 2), (64, 2), (12, 4)]  # groups 1, 4, 8, 16, 32 (two tiles), 3
TC_GRID = list(itertools.product([torch.float16, torch.bfloat16], ["NONE", "ROPE_LLAMA", "ALIBI"], ["NHD", "HND"],
                                 TC_HEADS, [1, 255, 4096, 32768]))


@pytest.mark.parametrize("case", range(len(TC_GRID)))
def test_decode_tensor_cores_match_reference(case):
    dtype, mode, layout, (num_qo, num_kv), kv_len = TC_GRID[case]
    q, k, v = make_inputs(num_qo, num_kv, kv_len, 128, dtype, layout, seed=3000 + case)
    window = [-1, kv_len // 3][case % 2]
    check_modes(q, k, v, f"tc {dtype} {mode} {layout} {num_qo}/{num_kv} L={kv_len} win={window}",
                layout=layout, pos_encoding_mode=mode, use_tensor_cores=True, window_left=window)


@pytest.mark.parametrize("head_dim,dtype,heads", list(itertools.product([64, 256], [torch.float16, torch.bfloat16],
                                                                        [(16, 4), (32, 2)])))
def test_decode_tensor_cores_other_head_dims(head_dim, dtype, heads):
    q, k, v = make_inputs(*heads, 4096, head_dim, dtype, "NHD", seed=head_dim + heads[0])
    check_modes(q, k, v, f"tc d{head_dim}", use_tensor_cores=True)


def test_decode_tensor_cores_with_soft_cap_and_scales():
    q, k, v = make_inputs(32, 4, 3000, 128, torch.bfloat16, "NHD", seed=99)
    check_modes(q, k, v, "tc cap", use_tensor_cores=True, logits_soft_cap=30.0, sm_scale=0.07, v_scale=0.5)


FP8_TC_GRID = list(itertools.product(FP8, [torch.float16, torch.bfloat16], ["NONE", "ROPE_LLAMA", "ALIBI"],
                                     [(8, 8), (16, 4), (32, 2)], [1, 300, 4096, 32768]))


@pytest.mark.parametrize("case", range(len(FP8_TC_GRID)))
def test_decode_tensor_cores_fp8_kv_match_reference(case):
    """fp8 K/V on tensor cores: fragments widened to q's type in registers (K dims in ldmatrix's
    order, V regrouped by a byte permute), RoPE rotated in fp32."""
    kv_dtype, dtype, mode, (num_qo, num_kv), kv_len = FP8_TC_GRID[case]
    q, k, v = make_inputs(num_qo, num_kv, kv_len, 128, dtype, "NHD" if case % 2 else "HND", seed=5000 + case)
    layout = "NHD" if case % 2 else "HND"
    window = [-1, kv_len // 3][case % 3 == 0]
    check_modes(q, k.to(kv_dtype), v.to(kv_dtype), f"tc fp8 {kv_dtype} {dtype} {mode} {num_qo}/{num_kv} L={kv_len}",
                layout=layout, pos_encoding_mode=mode, use_tensor_cores=True, window_left=window,
                k_scale=0.9, v_scale=1.3)


@pytest.mark.parametrize("mode", ["NONE", "ROPE_LLAMA", "ALIBI"])
def test_decode_tensor_cores_fp8_kv_with_soft_cap_and_scales(mode):
    """fp8 GQA runs on tensor cores by default: soft cap, all three scales and a window too."""
    q, k, v = make_inputs(32, 4, 3000, 128, torch.bfloat16, "NHD", seed=97)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    assert DecodeSpec.for_call(128, "bfloat16", "float8_e4m3fn", mode, True, 8).tensor_cores
    check_modes(q, k8, v8, f"tc fp8 cap {mode}", pos_encoding_mode=mode, logits_soft_cap=30.0, sm_scale=0.07,
                q_scale=1.3, k_scale=1.7, v_scale=0.5, window_left=2000)


@pytest.mark.parametrize("head_dim,mode", list(itertools.product([32, 64, 96, 256], ["NONE", "ROPE_LLAMA"])))
def test_decode_tensor_cores_fp8_kv_other_head_dims(head_dim, mode):
    """Head dims whose rows are not a multiple of four 16-byte vectors (32, 96) or whose RoPE
    half is an odd number of vectors (96) take the loads that repeat a pair."""
    q, k, v = make_inputs(16, 4, 3000, head_dim, torch.bfloat16, "NHD", seed=head_dim)
    check_modes(q, k.to(torch.float8_e5m2), v.to(torch.float8_e5m2), f"tc fp8 d{head_dim} {mode}",
                pos_encoding_mode=mode, use_tensor_cores=True)