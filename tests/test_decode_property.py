"""Seeded-random property test of jitattn.single_decode_with_kv_cache against the float64 reference (GPU).

Each seed draws one call: a specialization (head_dim, q dtype, KV dtype incl. fp8, positional
encoding, soft cap on/off, GQA group, CUDA cores or tensor cores) taken ONLY from those
cache/gpu-tests.toml lists (the GPU run is strict: JITATTN_DISABLE_JIT=1, no compiles), and
runtime arguments drawn freely: layout, heads, kv_len 1..128k, window_left, soft-cap value,
sm_scale, q/k/v scales, RoPE scale/theta, return_lse. The test id names the seed and the
specialization; a failure prints the whole configuration.
"""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest
import torch

from jitattn.jit.manifest import expand
from jitattn.decode.spec import DecodeSpec
from jitattn.jit.registry import spec_from_dict
from jitattn.reference import single_decode_reference
from tests.gpu_utils import assert_close, poison_allocator
from tests.varlen_utils import DEVICE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NUM_CONFIGS = 320
MANIFEST = Path(__file__).resolve().parent.parent / "cache" / "gpu-tests.toml"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
TOL = {torch.float16: (4e-3, 2e-2), torch.bfloat16: (2e-2, 8e-2)}  # (relative, max abs) on out, by q dtype
GROUPS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 32]
REF_ELEMENTS = 1 << 28  # kv_len * num_qo_heads * head_dim: the reference's float64 K/V stay ~2 GiB each
# ALiBi biases reach slope * kv_len: past 32k the float32 logits lose the bits the tolerance needs,
# a limit of the format rather than a bug, so ALiBi draws stop at 32k (as tests/test_decode_gpu.py does).
ALIBI_MAX_LEN = 32768


def cached_decode_specs() -> set[DecodeSpec]:
    """Every decode specialization cache/gpu-tests.toml lists (other families ignored)."""
    entries = tomllib.loads(MANIFEST.read_text()).get("spec", [])
    return {spec_from_dict(fields) for entry in entries if entry.get("family") == "decode" for fields in expand(entry)}


def spec_for(head_dim, dtype_q, dtype_kv, pos, cap, group, use_tc) -> DecodeSpec:
    """The specialization single_decode_with_kv_cache asks for (the rule it uses)."""
    return DecodeSpec.for_call(head_dim, dtype_q, dtype_kv, pos, cap, group, use_tc)


def candidates() -> list[tuple]:
    """(head_dim, dtype_q, dtype_kv, pos, cap, group, use_tc) whose specialization is cached."""
    cached = cached_decode_specs()
    head_dims = sorted({s.head_dim for s in cached})
    out = []
    for d, q, kv, pos, cap, g, tc in itertools.product(
            head_dims, ["float16", "bfloat16"], ["same", "float8_e4m3fn", "float8_e5m2"],
            ["NONE", "ROPE_LLAMA", "ALIBI"], [False, True], GROUPS, [False, True]):
        kv = q if kv == "same" else kv
        if kv.startswith("float8") and d % 32:
            continue
        if spec_for(d, q, kv, pos, cap, g, tc) in cached:
            out.append((d, q, kv, pos, cap, g, tc))
    return out


def config(seed: int, pool: list[tuple]) -> dict:
    rng = random.Random(0xDEC0DE00 + seed)
    head_dim, dtype_q, dtype_kv, pos, cap, group, use_tc = rng.choice(pool)
    fp8 = dtype_kv.startswith("float8")
    num_kv = rng.choice([1, 2, 4, 8]) if group <= 8 else rng.choice([1, 2])
    r = rng.random()
    if r < 0.05:
        kv_len = 1
    elif r < 0.5:
        kv_len = rng.randint(2, 2048)
    elif r < 0.9:
        kv_len = rng.randint(2049, 16384)
    elif r < 0.97:
        kv_len = rng.randint(16385, 32768)
    else:
        kv_len = rng.randint(32769, 131072)
    if pos == "ALIBI":
        kv_len = min(kv_len, ALIBI_MAX_LEN)
    while kv_len * group * num_kv * head_dim > REF_ELEMENTS:
        if num_kv > 1:
            num_kv //= 2
        else:
            kv_len //= 2
    window = -1 if rng.random() < 0.5 else rng.choice([0, 1, rng.randint(0, kv_len), rng.randint(kv_len, 2 * kv_len + 5)])
    scales = {}
    if rng.random() < (0.5 if fp8 else 0.15):
        scales = {"q_scale": round(rng.uniform(0.25, 2.0), 3), "k_scale": round(rng.uniform(0.25, 4.0), 3),
                  "v_scale": round(rng.uniform(0.25, 2.0), 3)}
    rope = {}
    if pos == "ROPE_LLAMA" and rng.random() < 0.5:
        rope = {"rope_scale": round(rng.uniform(1.0, 4.0), 3), "rope_theta": rng.choice([1e4, 5e5, 1e6])}
    return {
        "seed": seed,
        "head_dim": head_dim,
        "dtype_q": dtype_q,
        "dtype_kv": dtype_kv,
        "pos_encoding_mode": pos,
        "use_tensor_cores": use_tc,
        "group": group,
        "num_kv": num_kv,
        "kv_len": kv_len,
        "layout": rng.choice(["NHD", "HND"]),
        "window_left": window,
        "logits_soft_cap": round(rng.uniform(5.0, 50.0), 2) if cap else (0.0 if rng.random() < 0.1 else None),
        "sm_scale": None if rng.random() < 0.7 else round(rng.uniform(0.02, 0.2), 4),
        "scales": scales,
        "rope": rope,
        "return_lse": rng.random() < 0.6,
        "q_gain": rng.choice([1.0, 1.0, 2.0]),
    }


SPEC_FIELDS = ("head_dim", "dtype_q", "dtype_kv", "pos_encoding", "soft_cap", "tensor_cores")


def spec_of(c: dict) -> DecodeSpec:
    return spec_for(c["head_dim"], c["dtype_q"], c["dtype_kv"], c["pos_encoding_mode"], bool(c["logits_soft_cap"]),
                    c["group"], c["use_tensor_cores"])


def coverage_configs(configs: list[dict], pool: list[tuple]) -> list[dict]:
    """One more config for each cached head_dim / dtype / mode / tensor-core choice that the
    seeded draw missed, so every choice the manifest lists runs (seeds after the drawn ones)."""
    cached, used, extra = cached_decode_specs(), {spec_of(c) for c in configs}, []
    for field in SPEC_FIELDS:
        for value in sorted({getattr(s, field) for s in cached} - {getattr(s, field) for s in used}, key=str):
            choice = next(t for t in pool if getattr(spec_for(*t), field) == value)
            extra.append(config(len(configs) + len(extra), [choice]))
            used.add(spec_of(extra[-1]))
    return extra


POOL = candidates()
CONFIGS = [config(seed, POOL) for seed in range(NUM_CONFIGS)]
CONFIGS += coverage_configs(CONFIGS, POOL)


def _id(c: dict) -> str:
    kv = "" if c["dtype_kv"] == c["dtype_q"] else "-kv" + c["dtype_kv"][6:]
    return (f"seed{c['seed']}-{c['dtype_q'][:4]}{kv}-d{c['head_dim']}-g{c['group']}x{c['num_kv']}"
            f"-{c['pos_encoding_mode'].lower()}{'-cap' if c['logits_soft_cap'] else ''}"
            f"{'-tc' if c['use_tensor_cores'] else ''}-{c['layout']}-L{c['kv_len']}-w{c['window_left']}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_decode_random_config_matches_reference(cfg):
    import jitattn

    c = cfg
    g = torch.Generator(device=DEVICE).manual_seed(c["seed"])
    dtype, num_qo, d = DTYPES[c["dtype_q"]], c["group"] * c["num_kv"], c["head_dim"]
    q = (torch.randn(num_qo, d, device=DEVICE, generator=g) * c["q_gain"]).to(dtype)
    shape = (c["kv_len"], c["num_kv"], d) if c["layout"] == "NHD" else (c["num_kv"], c["kv_len"], d)
    k = torch.randn(shape, device=DEVICE, generator=g).to(DTYPES[c["dtype_kv"]])
    v = torch.randn(shape, device=DEVICE, generator=g).to(DTYPES[c["dtype_kv"]])
    kwargs = dict(pos_encoding_mode=c["pos_encoding_mode"], window_left=c["window_left"],
                  logits_soft_cap=c["logits_soft_cap"], sm_scale=c["sm_scale"], **c["scales"], **c["rope"])
    if DEVICE == "cuda":
        poison_allocator(q.numel() * q.element_size())
        poison_allocator(num_qo * 4)
    result = jitattn.single_decode_with_kv_cache(q, k, v, kv_layout=c["layout"], use_tensor_cores=c["use_tensor_cores"],
                                                 return_lse=c["return_lse"], **kwargs)
    ref_out, ref_lse = single_decode_reference(q, k, v, kv_layout=c["layout"], **kwargs)
    what = f"config {c}"
    out, lse = result if c["return_lse"] else (result, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, what
    rel, abs_ = TOL[dtype]
    assert_close(out, ref_out, rel, abs_, what)
    if lse is not None:
        assert lse.shape == (num_qo,) and lse.dtype == torch.float32, what
        # As tests/test_decode_gpu.py: lse relative to its size (ALiBi), and the tensor-core path
        # re-rounds RoPE-rotated q/k to their 16-bit type before the MMA: up to 2^-9 (bf16) or
        # 2^-12 (fp16) of each factor, so up to ~2^-8 / 2^-11 of each logit; with a short window
        # the lse is a logit or two (bf16: seed 158; fp16: seed 254, 3e-4).
        tc = spec_for(d, c["dtype_q"], c["dtype_kv"], c["pos_encoding_mode"], bool(c["logits_soft_cap"]),
                      c["group"], c["use_tensor_cores"]).tensor_cores
        rounded = tc and c["pos_encoding_mode"] == "ROPE_LLAMA"
        rel, abs_ = ((4e-3, 2e-2) if dtype == torch.bfloat16 else (1e-3, 4e-3)) if rounded else (1e-4, 2e-3)
        abs_ *= max(1.0, ref_lse.abs().max().item() / 100)
        if rounded:  # ...which for a large logit is more than the fixed bound (fp16: seed 63, 44 -> 1.6e-2)
            abs_ = max(abs_, (2**-7 if dtype == torch.bfloat16 else 2**-10) * ref_lse.abs().max().item())
        assert_close(lse, ref_lse, rel, abs_, what + " lse")


def test_configs_use_only_cached_specializations_and_cover_them():
    """The table (no GPU needed): >= 300 configs, each one's specialization listed in
    cache/gpu-tests.toml, and every listed head_dim / dtype / mode / tensor-core choice drawn."""
    cached = cached_decode_specs()
    assert len(CONFIGS) >= 300 and len({_id(c) for c in CONFIGS}) == len(CONFIGS)
    used = set()
    for c in CONFIGS:
        spec = spec_of(c)
        assert spec in cached, f"seed {c['seed']}: {spec.name} is not in {MANIFEST.name}"
        used.add(spec)
    for field in SPEC_FIELDS:
        assert {getattr(s, field) for s in used} == {getattr(s, field) for s in cached}, field
    assert len(used) >= len(cached) // 2, f"only {len(used)} of {len(cached)} cached specializations drawn"
    assert max(c["kv_len"] for c in CONFIGS) > 65536 and min(c["kv_len"] for c in CONFIGS) == 1
    assert any(c["window_left"] >= 0 for c in CONFIGS) and any(c["return_lse"] for c in CONFIGS)
