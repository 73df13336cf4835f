"""How varlen_attn plans a launch (jitattn/varlen/forward.py and plan.py), on CPU: which specialization (tile shape),
GQA packing, row blocks, KV splits and arguments reach the kernel. The module and the device
are stand-ins that record the launch; the kernels themselves are tested on the GPU."""
import math
import types

import pytest
import torch

import jitattn.varlen.forward as varlen
from jitattn.kernel import fresh_memos
from jitattn.varlen import plan
from jitattn.varlen import spec as spec_module
from jitattn.varlen.checks import AuxRequest, varlen_call
from jitattn import checks as _checks
from jitattn.varlen.spec import VarlenBackwardSpec, VarlenSpec
from tests.varlen_stand_in import RUN_ARGS, stand_in_forward_kernels

SMS, CTAS_PER_SM = 132, 2
HALF_WAVE = SMS * CTAS_PER_SM // 2


@pytest.fixture
def launches(monkeypatch):
    """Every launch as (spec, run args); CPU tensors pass the CUDA-device check."""
    recorded = []

    def run(spec, *args):  # like the kernel: writes into `out` when given, else allocates
        recorded.append((spec, args))
        q, out, want_lse = args[0], args[7], args[17]
        return (torch.empty_like(q) if out is None else out), (torch.empty(q.shape[1], q.shape[0]) if want_lse else None)

    stand_in_forward_kernels(monkeypatch, run, CTAS_PER_SM)
    monkeypatch.setattr(_checks, "cuda_device", lambda named: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(multi_processor_count=SMS))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))  # an A100
    monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    monkeypatch.delenv("JITATTN_WGMMA", raising=False)
    monkeypatch.delenv("JITATTN_SPEC_OVERRIDES", raising=False)
    with fresh_memos():  # the kernel memo and the device's arch are looked up again
        yield recorded


def on_hopper(monkeypatch):
    monkeypatch.setattr(varlen, "is_hopper", lambda device: True)


def forward(**kwargs):
    """jitattn.varlen.forward.forward on a call checked from varlen_attn's arguments."""
    return varlen.forward(varlen_call(**kwargs))


def hopper_prefill(head_dim, paged, soft_cap) -> VarlenSpec:
    return VarlenSpec.for_call(head_dim, "bfloat16", paged, soft_cap, False, False, True, True)


def batch(len_q, len_k, h_q=32, h_kv=8, d=128, dtype=torch.bfloat16):
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.zeros(sum(len_q), h_q, d, dtype=dtype)
    k = torch.zeros(sum(len_k), h_kv, d, dtype=dtype)
    return dict(query=q, key=k, value=k.clone(), cu_seq_q=cu(len_q), cu_seq_k=cu(len_k), max_q=max(len_q),
                max_k=max(len_k), enable_gqa=h_q != h_kv)


def launch(launches, **kwargs):
    defaults = dict(scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None, return_aux=None)
    forward(**{**defaults, **kwargs})
    spec, args = launches[-1]
    return spec, dict(zip(RUN_ARGS, args))


def test_decode_batches_take_the_16_row_shape_with_the_group_packed(launches):
    spec, run = launch(launches, **batch([1] * 64, [4096] * 64))  # 32/8 heads: 4 query rows per KV head
    assert spec == VarlenSpec(128, "bfloat16", paged=False, decode=True)
    assert run["pack"] == 4 and run["m_blocks"] == 1
    assert run["splits"] == 1  # 64 sequences x 8 KV heads = 512 CTAs: more than half a wave


def test_a_small_decode_batch_splits_the_keys_to_fill_half_a_wave(launches):
    _, run = launch(launches, **batch([1, 1], [32768, 100]))  # 2 x 8 = 16 CTAs
    assert run["splits"] == HALF_WAVE // 16


def test_splits_never_make_chunks_shorter_than_two_tiles(launches):
    spec, run = launch(launches, **batch([1], [300]))  # 8 CTAs; 300 keys are 10 tiles of 32 (D128)
    assert spec.block_n == 32
    assert run["splits"] == math.ceil(300 / (spec.block_n * plan.MIN_SPLIT_TILES)) == 5


def test_automatic_splits_are_counted_per_sequence_and_explicit_ones_kept(launches):
    """num_splits=None hands the kernel the grid's room and MIN_SPLIT_TILES: each row block takes
    as many splits as its own key tiles fill (kernels.cu.j2, block_extent). An explicit count is
    every block's (split_min_tiles 0)."""
    _, run = launch(launches, **batch([1, 1], [32768, 100]))
    assert run["splits"] == HALF_WAVE // 16 and run["split_min_tiles"] == plan.MIN_SPLIT_TILES
    _, run = launch(launches, **batch([1], [9000]), num_splits=3)
    assert run["splits"] == 3 and run["split_min_tiles"] == 0


def test_max_k_slack_never_changes_a_sequences_split(launches):
    """Paged (page 256, max_k the slot size 256) and packed (max_k 127) calls of the same
    sequences: the grids differ, and each sequence's own count, min(grid, ceil(tiles / 2)), is
    the same, because its own bound never exceeds the max_k bound of the grid (its keys are at
    most max_k). The kernel's bits are compared in tests/test_varlen_dropin_gpu.py."""
    spec, packed = launch(launches, **batch([1, 1], [127, 100]))
    tile = spec.block_n  # 32 at D128
    args = batch([1, 1], [127, 100])
    pool = torch.zeros(4, 256, 8, 128, dtype=torch.bfloat16)
    args.update(key=pool, value=pool.clone(), cu_seq_k=None, max_k=256,
                seqused_k=torch.tensor([127, 100], dtype=torch.int32),
                block_table=torch.tensor([[0], [2]], dtype=torch.int32))
    paged = launch(launches, **args)[1]
    assert (packed["splits"], paged["splits"]) == (2, 4)  # the grids' room follows max_k
    own = lambda k_len, grid: max(1, min(grid, math.ceil(math.ceil(k_len / tile) / plan.MIN_SPLIT_TILES)))
    assert [own(n, packed["splits"]) for n in (127, 100)] == [own(n, paged["splits"]) for n in (127, 100)] == [2, 2]
    for max_k in range(0, 3000, 13):
        for k_len in range(0, max_k + 1, 11):
            tiles = math.ceil(k_len / tile)
            assert math.ceil(tiles / plan.MIN_SPLIT_TILES) <= max(1, math.ceil(max_k / (tile * plan.MIN_SPLIT_TILES)))


def test_for_max_k_keeps_the_launch_while_one_more_key_changes_nothing(launches):
    """A decode step's first layer re-plans the last step's launch for one key more
    (transformers' _next_length): the same launch object where the split count and the mask map
    flag stay, else a launch that differs in the split fields alone and plans as the call would."""
    planned = varlen.plan(varlen_call(**batch([1], [300])))  # 5 splits of 64 keys (ceil(300 / 64))
    assert planned.splits == 5
    assert varlen.for_max_k(planned, 301) is planned  # still 5
    longer = varlen.for_max_k(planned, 321)  # 11 tiles of 32: 6 splits
    direct = varlen.plan(varlen_call(**batch([1], [321])))
    assert longer is not planned and longer.splits == direct.splits == 6
    assert longer._replace(splits=0) == direct._replace(splits=0)


def test_prefill_batches_take_the_prefill_shape_and_never_split(launches):
    spec, run = launch(launches, **batch([4096] * 8, [4096] * 8, h_q=16, h_kv=16), window_size=(-1, 0))
    assert spec == VarlenSpec(128, "bfloat16", paged=False, decode=False)
    assert run["pack"] == 1 and run["m_blocks"] == 4096 // spec.block_m
    assert run["splits"] == 1 and (run["left"], run["right"]) == (-1, 0)


def test_gqa_prefill_packs_the_group_into_the_rows(launches):
    spec, run = launch(launches, **batch([100, 7], [100, 300], h_q=32, h_kv=4))  # group of 8
    assert not spec.decode and run["pack"] == 8
    assert run["m_blocks"] == math.ceil(100 * 8 / spec.block_m)


def test_one_split_always_takes_the_prefill_shape_so_results_do_not_depend_on_the_batch(launches):
    for len_q in ([1, 1], [1, 300]):  # a decode batch, and the same first sequence in a prefill batch
        spec, run = launch(launches, **batch(len_q, [5000, 300]), num_splits=1)
        assert spec.decode is False and run["splits"] == 1 and run["pack"] == 4


def test_explicit_splits_are_kept_up_to_the_kernel_limit(launches):
    assert launch(launches, **batch([1], [9000]), num_splits=3)[1]["splits"] == 3
    assert launch(launches, **batch([1], [9000]), num_splits=1000)[1]["splits"] == plan.MAX_SPLITS


def test_paged_batches_take_the_paged_specialization(launches):
    args = batch([1, 1], [100, 100])
    pool = torch.zeros(20, 16, 8, 128, dtype=torch.bfloat16)
    args.update(key=pool, value=pool.clone(), cu_seq_k=None,
                seqused_k=torch.tensor([100, 37], dtype=torch.int32),
                block_table=torch.arange(14, dtype=torch.int32).view(2, 7))
    spec, run = launch(launches, **args)
    assert spec == VarlenSpec(128, "bfloat16", paged=True, decode=True)
    assert run["table"] is args["block_table"] and run["used"] is args["seqused_k"]


def test_scale_window_and_lse_reach_the_kernel(launches):
    _, run = launch(launches, **batch([20], [50]), scale=0.25, window_size=(7, 3),
                    return_aux=AuxRequest(lse=True))
    assert run["scale_log2"] == pytest.approx(0.25 * varlen.LOG2E)
    assert (run["left"], run["right"], run["want_lse"]) == (7, 3, True)
    _, run = launch(launches, **batch([20], [50], d=64))
    assert run["scale_log2"] == pytest.approx(varlen.LOG2E / 8) and run["want_lse"] is False
    assert run["softcap"] == 0.0


def test_a_soft_cap_takes_the_capped_specialization_and_reaches_the_kernel(launches):
    spec, run = launch(launches, **batch([20], [50]), softcap=30)
    assert spec == VarlenSpec(128, "bfloat16", paged=False, decode=False, soft_cap=True)
    assert run["softcap"] == 30.0 and isinstance(run["softcap"], float)
    for off in (None, 0, 0.0):
        spec, run = launch(launches, **batch([20], [50]), softcap=off)
        assert spec.soft_cap is False and run["softcap"] == 0.0


def test_an_out_the_kernel_cannot_write_in_place_gets_the_result_copied_in(launches):
    args = batch([3, 5], [10, 10], h_q=8, h_kv=8)
    aligned = torch.full((8, 8, 128), float("nan"), dtype=torch.bfloat16)
    result, _ = forward(**args, scale=None, window_size=(-1, -1), seqused_k=None, block_table=None,
                               num_splits=None, return_aux=None, out=aligned)
    assert result is aligned and launches[-1][1][7] is aligned  # written in place
    backing = torch.full((8, 8, 129), float("nan"), dtype=torch.bfloat16)
    strided = backing[:, :, 1:]  # rows start 2 bytes into 16-byte vectors
    result, _ = forward(**args, scale=None, window_size=(-1, -1), seqused_k=None, block_table=None,
                               num_splits=None, return_aux=None, out=strided)
    assert result is strided and launches[-1][1][7] is None  # the kernel allocated; copied into out


def test_loaded_kernels_are_memoized_per_shape(launches):
    calls = []
    original = varlen.get_module
    varlen.get_module = lambda spec: calls.append(spec) or original(spec)
    try:
        for _ in range(3):
            launch(launches, **batch([1], [100]))
        launch(launches, **batch([500], [500]))
    finally:
        varlen.get_module = original
    assert [s.decode for s in calls] == [True, False]


def test_hopper_prefill_takes_the_wgmma_rung(launches, monkeypatch):
    on_hopper(monkeypatch)
    for d in (64, 128, 256):
        spec, run = launch(launches, **batch([4096] * 2, [4096] * 2, h_q=16, h_kv=16, d=d), window_size=(-1, 0))
        assert spec == VarlenSpec(d, "bfloat16", paged=False, decode=False, wgmma=True, tma=True,
                                  split_kv=d == 256, persistent=d != 256)
        assert spec.tma  # packed keys by TMA where it measured faster: D64 / D128, D256 with split_kv
        assert spec.persistent is (d in (64, 128))  # a CTA per SM walks the row blocks there
        assert (spec.block_m, spec.block_n, spec.stages) == {64: (192, 128, 4), 128: (128, 128, 3), 256: (128, 80, 2)}[d]
        assert run["m_blocks"] == -(-4096 // spec.block_m) and spec.archs_for(("9.0",)) == ("9.0a",)


def test_hopper_prefill_calls_take_the_persistent_kernel_at_d64_and_d128_packed_and_paged():
    for head_dim in (64, 128, 256):
        for paged in (False, True):
            for cap in (False, True):
                spec = hopper_prefill(head_dim, paged, cap)
                assert spec.persistent is (head_dim != 256), spec.name
    # never on the decode tile or the mma.sync rung
    assert not VarlenSpec.for_call(128, "bfloat16", True, False, True, False, True, True).persistent
    assert not VarlenSpec.for_call(128, "bfloat16", False, False, False, False, False, True).persistent


def test_wgmma_rung_only_where_it_applies(launches, monkeypatch):
    on_hopper(monkeypatch)
    assert not launch(launches, **batch([300], [300], d=96))[0].wgmma  # head_dim not a multiple of 64
    assert not launch(launches, **batch([1] * 64, [4096] * 64))[0].wgmma  # decode shape
    monkeypatch.setenv("JITATTN_WGMMA", "0")
    assert launch(launches, **batch([300], [300]))[0] == VarlenSpec(128, "bfloat16", paged=False, decode=False)


def _listed_call_specs(manifest: str) -> set:
    from pathlib import Path

    from jitattn.jit.manifest import read_manifest
    cache_dir = Path(__file__).resolve().parent.parent / "cache"
    return {s for s in read_manifest(cache_dir / manifest) if isinstance(s, VarlenSpec)}


@pytest.mark.parametrize("manifest, head_dims, capped", [
    ("default.toml", (128,), (False,)),
    ("gpu-tests.toml", (64, 128, 256), (False, True)),
    ("gpu-dropin.toml", (64, 128, 256), (False,)),
])
def test_manifests_list_the_prefill_kernels_hopper_calls_run(manifest, head_dims, capped):
    """A manifest that lists a spec no call runs (a stale tile, copy or barrier choice) leaves
    production's JIT-disabled calls without a kernel: each lists for_call's for its shapes."""
    listed = _listed_call_specs(manifest)
    paged_modes = (False,) if manifest == "default.toml" else (False, True)
    for d in head_dims:
        for dtype in ("float16", "bfloat16"):
            for paged in paged_modes:
                for cap in capped:
                    spec = VarlenSpec.for_call(d, dtype, paged, cap, False, False, True, True)
                    assert spec in listed, (manifest, spec.name)
                    assert spec.split_kv == (d == 256) and spec.tma


# ---------------------------------------------------------------- one rule: calls and prewarm agree
HEAD_DIMS = range(32, 257, 16)
ARCHS = {("9.0",): (True,), ("8.0",): (False,), ("8.0", "9.0"): (True, False)}  # targets -> the GPUs calls run on
# max_q (x group 4), num_splits, the longest key sequence
SHAPES = {"decode": (4, None, 300), "one split": (4, 1, 300), "prefill": (300, None, 300), "short": (20, None, 60)}


def call_of(d, dtype, paged, shape, softcap):
    """A varlen_attn call (32 / 8 heads) of that head_dim, dtype, paging and shape."""
    len_q, num_splits, len_k = SHAPES[shape]
    args = batch([len_q, 1], [len_k, 40], d=d, dtype=dtype)
    if paged:
        pool = torch.zeros(8, 64, 8, d, dtype=dtype)
        args.update(key=pool, value=pool.clone(), cu_seq_k=None, max_k=320,
                    seqused_k=torch.tensor([300, 40], dtype=torch.int32),
                    block_table=torch.arange(10, dtype=torch.int32).view(2, 5))
    return dict(args, num_splits=num_splits, softcap=softcap)


@pytest.mark.parametrize("archs", list(ARCHS), ids=lambda a: ";".join(a))
def test_prewarm_lists_exactly_the_forward_specs_calls_run(launches, monkeypatch, archs):
    """Every spec `prewarm_variants` lists is one a call on those targets runs, and every call's
    spec is listed: both come from VarlenSpec.for_call (head dims 32..256, both dtypes, packed
    and paged, decode / one-split / prefill shapes, soft cap or not)."""
    from jitattn.jit.registry import spec_from_dict

    for d in HEAD_DIMS:
        for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
            for cap in (False, True):
                listed = [spec_from_dict({"family": "varlen", **v})
                          for v in VarlenSpec.prewarm_variants({"head_dim": d, "dtype": name, "soft_cap": cap}, archs)]
                ran = set()
                for hopper in ARCHS[archs]:
                    monkeypatch.setattr(varlen, "is_hopper", lambda device, hopper=hopper: hopper)
                    for paged in (False, True):
                        for shape in SHAPES:
                            ran.add(launch(launches, **call_of(d, dtype, paged, shape, 30.0 if cap else None))[0])
                assert len(listed) == len(set(listed)) and set(listed) == ran, (archs, d, name, cap)
    assert any(s.wgmma for s in ran) == ("9.0" in archs)  # the grid reached both rungs where it should


@pytest.mark.parametrize("tile80", ["default", "all"])
@pytest.mark.parametrize("archs", list(ARCHS), ids=lambda a: ";".join(a))
def test_prewarm_lists_exactly_the_backward_specs_calls_run(monkeypatch, archs, tile80):
    """The same for the backward (VarlenBackwardSpec.for_call), over deterministic mode and full
    and causal calls too; with the 80-row tile as it is and on for every call feature."""
    from jitattn.jit.registry import spec_from_dict
    from jitattn.varlen import backward_launch

    if tile80 == "all":
        monkeypatch.setattr(spec_module, "TILE80_FEATURES", frozenset(spec_module.CALL_FEATURES))

    planned = []

    def fake_get_module(spec):
        planned.append(spec)
        return types.SimpleNamespace(ops=types.SimpleNamespace(run=types.SimpleNamespace(default=lambda *a: None)))

    monkeypatch.setattr(backward_launch, "get_module", fake_get_module)
    monkeypatch.delenv("JITATTN_WGMMA", raising=False)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    for d in HEAD_DIMS:
        for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
            for cap in (False, True):
                listed = [spec_from_dict({"family": "varlen_backward", **v}) for v in
                          VarlenBackwardSpec.prewarm_variants({"head_dim": d, "dtype": name, "soft_cap": cap}, archs)]
                planned.clear()
                with fresh_memos():
                    for hopper in ARCHS[archs]:
                        monkeypatch.setattr(backward_launch, "is_hopper", lambda device, hopper=hopper: hopper)
                        for deterministic in (False, True):
                            for window in ((-1, -1), (-1, 0)):  # a full call and a causal one
                                q = torch.zeros(3, 2, d, dtype=dtype)
                                backward_launch.backward(q, None, q, q, q, q, torch.zeros(2, 3), cu, cu, max_q=3,
                                                         max_k=3, deterministic=deterministic, window_size=window,
                                                         softcap=30.0 if cap else None)
                assert len(listed) == len(set(listed)) and set(listed) == set(planned), (archs, d, name, cap)


# ---------------------------------------------------------------- the public override
def test_an_override_forces_fields_and_the_rule_derives_the_rest(launches, monkeypatch):
    on_hopper(monkeypatch)
    prefill = batch([4096], [4096], h_q=16, h_kv=16, d=256)
    assert launch(launches, **prefill)[0].split_kv  # D256 by TMA: split_kv, 80 keys x 2 stages
    with plan.override_spec("varlen", tma=False):
        spec = launch(launches, **prefill)[0]
    assert spec == VarlenSpec(256, "bfloat16", wgmma=True) and (spec.block_n, spec.stages) == (48, 3)
    assert launch(launches, **prefill)[0].split_kv  # the block ended: the rule's choice again


def test_an_override_applies_only_where_its_when_matches(launches, monkeypatch):
    on_hopper(monkeypatch)
    with plan.override_spec("varlen", when={"decode": True}, block_n=64, stages=4):
        decode = launch(launches, **batch([1] * 4, [4096] * 4))[0]
        prefill = launch(launches, **batch([500], [500], d=64))[0]
    assert (decode.block_n, decode.stages) == (64, 4) and decode.decode
    assert prefill == VarlenSpec.for_call(64, "bfloat16", False, False, False, False, True, True)


def test_the_knob_overrides_like_the_function_and_names_itself_in_errors(launches, monkeypatch):
    on_hopper(monkeypatch)
    monkeypatch.setenv("JITATTN_SPEC_OVERRIDES", "varlen:persistent=0@head_dim=128; varlen_backward:persistent=off")
    assert not launch(launches, **batch([500], [500]))[0].persistent
    assert launch(launches, **batch([500], [500], d=64))[0].persistent  # `when` left D64 alone
    assert not VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True).persistent
    monkeypatch.setenv("JITATTN_SPEC_OVERRIDES", "varlen:block_n=7")
    with pytest.raises(ValueError, match="JITATTN_SPEC_OVERRIDES.*block_n"):
        launch(launches, **batch([1] * 4, [4096] * 4))
    for bad, words in (("varlen:warp=1", "no field 'warp'"), ("varlen:tma=maybe", "takes a bool"),
                       ("decode:tma=1", "family must be one of"), ("varlen tma=1", "is not family:field=value")):
        monkeypatch.setenv("JITATTN_SPEC_OVERRIDES", bad)
        with pytest.raises(ValueError, match=f"JITATTN_SPEC_OVERRIDES.*{words}"):
            launch(launches, **batch([500], [500]))


def test_override_spec_names_a_bad_field_when_entered():
    with pytest.raises(ValueError, match=r"override_spec: varlen has no field 'tiles'"):
        with plan.override_spec("varlen", tiles=3):
            pass
    with pytest.raises(ValueError, match="override_spec.*forces.*wgmma"):
        with plan.override_spec("varlen", wgmma=True):
            VarlenSpec.for_call(96, "bfloat16", False, False, False, False, True, True)


def test_prewarm_follows_the_active_overrides():
    with plan.override_spec("varlen_backward", persistent=False):
        variants = VarlenBackwardSpec.prewarm_variants({"head_dim": 128, "dtype": "bfloat16"}, ("9.0",))
    rows80 = [80] if 128 in spec_module.TILE80_HEAD_DIMS else []  # full calls' tile, never persistent
    assert [(v["persistent"], v["block_m"]) for v in variants] == [(False, 64)] + [(False, m) for m in rows80]


# ---------------------------------------------------------------- warm calls (forward.py's warm_key)
def public(**kwargs):
    import jitattn

    return jitattn.varlen_attn(**kwargs)


def counting_plans(monkeypatch):
    plans = []
    real = varlen.plan

    def counted(call):
        plans.append(call)
        return real(call)

    monkeypatch.setattr(varlen, "plan", counted)
    return plans


def scalars(args):
    return [a for a in args if not isinstance(a, torch.Tensor)]


def test_a_warm_call_launches_the_remembered_plan_without_checking_or_planning_again(launches, monkeypatch):
    plans = counting_plans(monkeypatch)
    public(**batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64))
    planned = len(plans)
    assert planned >= 1
    for _ in range(3):  # new tensors with the same metadata: another layer of the model
        public(**batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64))
    assert len(plans) == planned, "a warm call must not plan again"
    first, last = launches[0][1], launches[-1][1]
    assert scalars(first) == scalars(last) and launches[0][0] == launches[-1][0]
    public(**batch([5, 9], [7, 12], h_q=8, h_kv=4, d=64))  # other shapes: a new key
    assert len(plans) > planned


def counting_checks(monkeypatch):
    import jitattn.varlen.api as varlen_api

    checked = []
    real_check = varlen_api.varlen_call
    monkeypatch.setattr(varlen_api, "varlen_call", lambda *a, **kw: checked.append(1) or real_check(*a, **kw))
    return checked


def test_a_call_with_more_keys_re_plans_the_last_launch_without_the_checks(launches, monkeypatch):
    """A decode loop's next step (a cache one key longer, in a new tensor) is a new warm key: its
    family's launch is re-planned for the new max_k (forward.py `_next_length`), and the step's
    later layers find it under their own key. The splits follow max_k as a planned call's do."""
    plans, checked = counting_plans(monkeypatch), counting_checks(monkeypatch)
    public(**batch([1, 1], [200, 30], h_q=8, h_kv=2, d=64))  # 2 x 2 = 4 CTAs: the keys split
    assert (len(plans), len(checked)) == (1, 1)
    for length in (201, 5000, 5001, 5001):  # all past SHORT_KEYS: one kernel
        b = batch([1, 1], [length, 30], h_q=8, h_kv=2, d=64)
        public(**b)
        run = dict(zip(RUN_ARGS, launches[-1][1]))
        assert run["q"] is b["query"] and run["k"] is b["key"] and run["cu_k"] is b["cu_seq_k"]
        planned = launch(launches, **b)[1]  # the same call, checked and planned anew
        assert {n: run[n] for n in ("splits", "split_min_tiles", "m_blocks")} == \
            {n: planned[n] for n in ("splits", "split_min_tiles", "m_blocks")}
    assert len(checked) == 1, "the public calls after the first are never checked again"
    assert run["splits"] > launches[0][1][RUN_ARGS.index("splits")] > 1


def test_the_next_length_takes_the_full_path_where_the_plan_or_the_checks_differ(launches, monkeypatch):
    """Keys the kernel cannot read in place, another kernel by the short-call rule, and values the
    checks refuse are never re-planned from the family: they are checked (and fixed or refused)."""
    checked = counting_checks(monkeypatch)
    public(**batch([1], [100], h_q=8, h_kv=2, d=64))
    public(**batch([1], [101], h_q=8, h_kv=2, d=64))
    assert len(checked) == 1
    public(**batch([1], [5000], h_q=8, h_kv=2, d=64))  # past SHORT_KEYS: the short-call rule's verdict changes
    assert len(checked) == 2
    b = batch([1], [5001], h_q=8, h_kv=2, d=64)
    odd = torch.empty(b["key"].numel() + 1, dtype=b["key"].dtype)[1:].view(b["key"].shape)  # not 16-byte aligned
    public(**{**b, "key": odd})
    assert len(checked) == 3
    launched = launches[-1][1][1]
    assert launched.data_ptr() % 16 == 0 and launched.data_ptr() != odd.data_ptr(), "a copy the kernel can read"
    with pytest.raises(ValueError, match="max_k"):
        public(**{**batch([1], [5002], h_q=8, h_kv=2, d=64), "max_k": -1})
    b = batch([1], [5003], h_q=8, h_kv=2, d=64)
    with pytest.raises(ValueError, match="same shape"):  # fewer value rows than keys: never read past them
        public(**{**b, "value": b["value"][:-1]})


def test_warm_calls_still_refuse_what_the_checks_refuse(launches):
    """Scalars that compare equal to a warm call's (True == 1) but that the checks refuse, and a
    bad AuxRequest, miss the memo and get the checks' errors."""
    good = batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64)
    public(**good, window_size=(1, 0), num_splits=1, scale=1.0)
    public(**good, window_size=(1, 0), num_splits=1, scale=1.0)
    with pytest.raises((TypeError, ValueError), match="window_size"):
        public(**good, window_size=(True, 0), num_splits=1, scale=1.0)
    with pytest.raises((TypeError, ValueError), match="num_splits"):
        public(**good, window_size=(1, 0), num_splits=True, scale=1.0)
    with pytest.raises(TypeError, match="return_aux.lse"):
        public(**good, window_size=(1, 0), num_splits=1, scale=1.0, return_aux=AuxRequest(lse=1))
    with pytest.raises((TypeError, ValueError), match="window_size"):  # unhashable: no key at all
        public(**good, window_size=([1], 0), num_splits=1, scale=1.0)


def test_inputs_the_kernel_cannot_read_as_given_are_fixed_on_every_call(launches):
    """A query at an odd address is copied for the kernel, warm or not: such calls are never
    remembered."""
    for _ in range(3):
        b = batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64)
        q = b["query"]
        odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
        public(**{**b, "query": odd})
        launched = launches[-1][1][0]
        assert launched.data_ptr() % 16 == 0 and launched.data_ptr() != odd.data_ptr()


def test_a_changed_knob_or_override_is_a_new_key(launches, monkeypatch):
    on_hopper(monkeypatch)
    b = batch([300], [300], h_q=8, h_kv=8, d=128)
    public(**b)
    public(**batch([300], [300], h_q=8, h_kv=8, d=128))
    assert launches[-1][0].wgmma
    monkeypatch.setenv("JITATTN_WGMMA", "0")
    public(**batch([300], [300], h_q=8, h_kv=8, d=128))
    assert not launches[-1][0].wgmma
    monkeypatch.delenv("JITATTN_WGMMA")
    public(**batch([300], [300], h_q=8, h_kv=8, d=128))
    assert launches[-1][0].wgmma


def test_varlen_attn_out_warm_calls_write_into_the_given_out(launches, monkeypatch):
    """varlen_attn_out (torch's flash provider calls it) takes the warm path too, writing into the
    `out` it is given; an `out` the kernel cannot write is filled by a copy on every call."""
    import jitattn

    plans = counting_plans(monkeypatch)
    for i in range(3):
        b = batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64)
        out = torch.empty_like(b["query"])
        assert jitattn.varlen_attn_out(out, **b) is out
        assert launches[-1][1][7] is out, "the kernel writes into the caller's out"
        if i == 0:
            planned = len(plans)
    assert len(plans) == planned
    for _ in range(2):
        b = batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64)
        q = b["query"]
        odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # not 16-byte aligned
        assert jitattn.varlen_attn_out(odd, **b) is odd
        assert launches[-1][1][7] is None, "an out the kernel cannot write gets the result copied in"


def counting_backward(monkeypatch):
    """The backward launch replaced by one that records its keyword arguments (the ctx constants)
    and returns ones of the inputs' shapes."""
    import jitattn.varlen.backward_launch as backward_launch

    calls = []

    def backward(grad_out, grad_lse, query, key, value, *rest, **kwargs):
        calls.append(kwargs)
        return torch.ones_like(query), torch.ones_like(key), torch.ones_like(value)

    monkeypatch.setattr(backward_launch, "backward", backward)
    return calls


def grad_batch(**kwargs):
    b = batch([5, 9], [7, 12], h_q=8, h_kv=2, d=64, **kwargs)
    for name in ("query", "key", "value"):
        b[name] = torch.randn_like(b[name]).requires_grad_()
    return b


def test_eager_calls_with_grad_are_warm_after_the_first(launches, monkeypatch):
    """A training step's layers: an eager call with grad whose shapes, scalars and grad flags were
    seen launches the remembered plan (no checks, no planning) and records the same autograd
    constants as the checked call; a changed scalar is checked and planned again."""
    import jitattn
    import jitattn.varlen.api as varlen_api

    plans = counting_plans(monkeypatch)
    checked = []
    real_check = varlen_api.varlen_call
    monkeypatch.setattr(varlen_api, "varlen_call", lambda *a, **kw: checked.append(1) or real_check(*a, **kw))
    backward_calls = counting_backward(monkeypatch)
    results = []
    for _ in range(3):
        b = grad_batch()
        out = jitattn.varlen_attn(**b, window_size=(-1, 0))
        assert out.requires_grad
        spec, args = launches[-1]
        assert args[0] is b["query"] and args[1] is b["key"] and args[2] is b["value"], "this call's tensors"
        assert args[RUN_ARGS.index("want_lse")], "the backward needs the forward's lse"
        out.sum().backward()
        assert all(b[n].grad is not None for n in ("query", "key", "value"))
        results.append((spec, scalars(args), backward_calls[-1]))
    assert len(checked) == 1 and len(plans) == 1, "the second and third calls are warm"
    assert results[1] == results[0] and results[2] == results[0]
    assert results[0][2]["scale"] == 64 ** -0.5 and results[0][2]["window_size"] == [-1, 0]
    assert results[0][2]["max_q"] == 9 and results[0][2]["max_k"] == 12 and results[0][2]["softcap"] == 0.0

    b = grad_batch()
    jitattn.varlen_attn(**b, window_size=(-1, 0), scale=0.5).sum().backward()
    assert len(checked) == 2 and backward_calls[-1]["scale"] == 0.5, "another scale: checked and planned again"
    with pytest.raises(ValueError, match="scale"):  # a bad value is never warm
        jitattn.varlen_attn(**grad_batch(), window_size=(-1, 0), scale=-1.0)


def test_warm_calls_with_grad_read_this_calls_captured_tensors(launches, monkeypatch):
    """A traced variant's key is its tree and its captures' metadata: a warm call with grad passes
    the kernel and the backward this call's captured tensors, not the first call's."""
    import jitattn
    import jitattn.varlen.api as varlen_api
    from jitattn.variants import trace_mask_mod

    checked = []
    real_check = varlen_api.varlen_call
    monkeypatch.setattr(varlen_api, "varlen_call", lambda *a, **kw: checked.append(1) or real_check(*a, **kw))
    backward_calls = counting_backward(monkeypatch)
    for i in range(3):
        doc = torch.tensor([0] * 7 + [1] * 12, dtype=torch.int32) + i  # new values, same metadata
        mask_mod = trace_mask_mod(lambda b, h, q_idx, kv_idx, doc=doc: doc[kv_idx] >= doc[q_idx])
        b = grad_batch()
        jitattn.varlen_attn(**b, mask_mod=mask_mod).sum().backward()
        args = dict(zip(RUN_ARGS, launches[-1][1]))
        assert args["captures"][0] is doc
        assert backward_calls[-1]["mask_mod"] is mask_mod
    assert len(checked) == 1, "the second and third calls are warm"
