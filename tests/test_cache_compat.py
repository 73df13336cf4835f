"""Cache entries built by an earlier jitattn still load where nothing they were built from
changed: keys hash template bytes and spec parameters, never module paths (CPU; no compiler needed).

`data/cache-865b607.tar.gz` was packed by commit 865b607, before the kernel families moved to
jitattn/decode and jitattn/varlen (`jitattn prewarm --head-dim 64 --dtype float16 --group-size 1
--arch 9.0`, a varlen bf16 head_dim 64 prefill spec, then `jitattn cache pack`).
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jitattn.jit import artifact, cache, keys, render
from jitattn.jit.registry import spec_from_dict

REPO = Path(__file__).resolve().parent.parent
PACK = Path(__file__).resolve().parent / "data" / "cache-865b607.tar.gz"
PACKED_NAMES = {"decode_f16_kvf16_d64_posnone_cap0_g1", "varlen_bf16_d64_prefill_m4x2n64s2"}


@pytest.fixture
def seed(tmp_path):
    report = artifact.unpack(PACK, tmp_path / "seed", archs=["9.0"])
    assert report.ok, report.rejected
    assert len(report.accepted) == 2
    return tmp_path / "seed"


def packed_entries(seed: Path) -> list[cache.CacheEntry]:
    entries = [cache.read_entry(p) for p in cache.entries(seed)]
    assert all(entries) and {e.manifest["name"] for e in entries} == PACKED_NAMES
    return entries


def templates_unchanged(entry: cache.CacheEntry, spec) -> bool:
    return render.spec_template_digest(spec) == entry.components["templates"]


def added_fields(entry: cache.CacheEntry, spec) -> dict:
    """Spec fields the family gained since 865b607 (each at its default: the old kernel)."""
    return {k: v for k, v in spec.to_dict().items() if k not in entry.components["spec"]}


def test_an_old_entry_has_the_key_this_jitattn_computes_for_its_spec(seed):
    for entry in packed_entries(seed):
        parts = entry.components
        spec = spec_from_dict(parts["spec"])
        added = added_fields(entry, spec)
        assert {k: v for k, v in spec.to_dict().items() if k not in added} == parts["spec"]
        assert spec.name == entry.manifest["name"]
        defaults = {f.name: f.default for f in dataclasses.fields(spec)}
        assert added == {k: defaults[k] for k in added}, "a field added since must default to the old kernel"
        target = keys.BuildTarget(parts["archs"], parts["nvcc"], parts["host_cxx"])
        assert tuple(parts["archs"]) == spec.archs_for(("9.0",))
        ours = keys.components(spec, target)
        if not templates_unchanged(entry, spec):
            # The family's templates changed since 865b607 (a new kernel): its key must change
            # with them, and every other component must still be computed the same way.
            ours["templates"] = parts["templates"]
        if added:  # so must it with new spec fields (varlen's soft_cap)
            ours["spec"] = parts["spec"]
        if "params" not in parts:
            # Keys hash the template parameters' digest since after 865b607: an entry without one
            # never loads (the Python that wrote its parameters is unknown); the rest is as it was.
            assert keys.key_of(ours) != entry.key
            del ours["params"]
        assert ours == parts
        assert keys.key_of(ours) == entry.key


LOAD_IN_STRICT_MODE = """
import json, sys
from jitattn.jit import loader
from jitattn.jit.registry import spec_from_dict

results = []
for data in json.loads(sys.argv[1]):
    module = loader.get_module(spec_from_dict(data))
    results.append({"entry": str(module.entry.path), "has_ops": hasattr(module.ops, "ctas_per_sm")})
    if data["family"] == "decode":
        from jitattn.decode.launch import DecodeKernel
        results[-1]["tile_rows"] = DecodeKernel(module).tile_rows  # its C entry point answers
print(json.dumps({"compiles": loader.COMPILE_COUNT, "results": results}))
"""


def test_a_strict_process_serves_old_entries_from_a_seed_dir_without_compiling(seed, tmp_path):
    entries = [e for e in packed_entries(seed) if templates_unchanged(e, spec_from_dict(e.components["spec"]))
               and not added_fields(e, spec_from_dict(e.components["spec"]))]
    if not entries:
        pytest.skip("every packed family's templates changed since 865b607 (the key test above covers the move)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    env.update(PYTHONPATH=str(REPO), JITATTN_CACHE_DIR=str(tmp_path / "empty-root"), JITATTN_CACHE_SEED_DIRS=str(seed),
               JITATTN_DISABLE_JIT="1", JITATTN_CUDA_ARCH_LIST="9.0")
    specs = [e.components["spec"] for e in entries]
    result = subprocess.run([sys.executable, "-c", LOAD_IN_STRICT_MODE, json.dumps(specs)], env=env,
                            capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiles"] == 0
    assert [r["entry"] for r in report["results"]] == [str(e.path) for e in entries]
    assert all(r["has_ops"] for r in report["results"])  # the library registered its ops
    for r, e in zip(report["results"], entries):
        if e.components["spec"]["family"] == "decode":
            assert r["tile_rows"] == 64
