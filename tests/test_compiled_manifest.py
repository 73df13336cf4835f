"""tools/compiled_manifest.py: a GPU run's compiled specs (JSON lines, or a cache root's entries)
become a manifest that jitattn reads back to the same specs; a bad line is an error naming the
file, never a spec; and cache/gpu-tests-compiled.toml is such a manifest."""
import hashlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import compiled_manifest  # noqa: E402

from jitattn.jit.manifest import read_manifest  # noqa: E402
from jitattn.variants import trace_mask_mod, trace_score_mod  # noqa: E402
from jitattn.varlen.spec import VarlenBackwardSpec, VarlenSpec  # noqa: E402


def specs_with_variants():
    score = trace_score_mod(lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx) * 0.5)
    mask = trace_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) < 300)
    return [VarlenSpec.for_call(64, "bfloat16", False, False, False, False, True, short=True),
            VarlenSpec.for_call(128, "float16", False, False, False, False, True, score_mod=score.key_text),
            VarlenBackwardSpec.for_call(128, "bfloat16", False, False, True, mask_mod=mask.key_text)]


def test_jsonl_round_trips_through_the_manifest(tmp_path):
    specs = specs_with_variants()
    lines = tmp_path / "compiled_specs.jsonl"
    # twice over, as two runs' lists joined: one entry a spec
    lines.write_text("\n".join(json.dumps(s.to_dict()) for s in specs + specs) + "\n\n")
    out = tmp_path / "m.toml"
    assert compiled_manifest.main([str(lines), "--out", str(out), "--note", "a test"]) == 0
    text = out.read_text()
    assert "(a test)" in text and text.count("[[spec]]") == 3
    assert sorted(s.name for s in read_manifest(out)) == sorted(s.name for s in specs)
    assert {s.to_dict()["mask_mod"] for s in read_manifest(out)} >= {specs[2].mask_mod}


def test_a_cache_root_gives_its_verified_entries_specs(tmp_path):
    """Entries as the cache lays them out (jitattn/jit/cache.py); one whose library does not match
    its manifest is not read."""
    specs = specs_with_variants()
    for i, spec in enumerate(specs):
        key = f"{i:064x}"
        entry = tmp_path / "v1" / "sm90a" / f"{spec.name}-{key[:16]}"
        entry.mkdir(parents=True)
        library = f"library {i}".encode()
        (entry / "module.so").write_bytes(library)
        (entry / "manifest.json").write_text(json.dumps({
            "key": key, "library": {"size": len(library), "sha256": hashlib.sha256(library).hexdigest()},
            "components": {"spec": spec.to_dict()}}))
    assert sorted(d["head_dim"] for d in compiled_manifest.specs_in(tmp_path)) == [64, 128, 128]
    (entry / "module.so").write_bytes(b"library X")  # the last entry's library changed
    assert sorted(d["head_dim"] for d in compiled_manifest.specs_in(tmp_path)) == [64, 128]


@pytest.mark.parametrize("bad, words", [
    ({"family": "varlen", "head_dim": 7, "dtype": "bfloat16"}, "head_dim"),
    ({"family": "nope", "head_dim": 64}, "nope"),
    ({"family": "varlen", "head_dim": 64, "dtype": "bfloat16", "score_mod": "{\"kind\":\"score_mod\"}"}, "score_mod"),
])
def test_a_bad_spec_is_an_error_naming_the_file(tmp_path, bad, words):
    lines = tmp_path / "compiled_specs.jsonl"
    lines.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=rf"compiled_specs\.jsonl.*{words}"):
        compiled_manifest.manifest_text([lines], "a test")


def test_a_new_runs_list_joins_the_checked_in_one(tmp_path):
    """What device_check lists (a manifest) added to an earlier list: their union, once each."""
    specs = specs_with_variants()
    earlier, run = tmp_path / "earlier.toml", tmp_path / "run.toml"
    earlier.write_text(compiled_manifest.manifest_text([_lines(tmp_path, specs[:2])], "earlier"))
    run.write_text(compiled_manifest.manifest_text([_lines(tmp_path, specs[1:])], "a run"))
    joined = tmp_path / "joined.toml"
    compiled_manifest.main([str(earlier), str(run), "--out", str(joined)])
    assert sorted(s.name for s in read_manifest(joined)) == sorted(s.name for s in specs)


def _lines(tmp_path, specs):
    path = tmp_path / f"specs{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in specs))
    return path


def test_the_checked_in_list_reads_as_a_manifest():
    specs = read_manifest(REPO / "cache" / "gpu-tests-compiled.toml")
    assert len(specs) > 100 and {s.family for s in specs} == {"varlen", "varlen_backward"}
