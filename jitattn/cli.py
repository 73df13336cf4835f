"""The `jitattn` command line: prewarm, cache, doctor (show-config), explain."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from jitattn.jit import bounded_json, cache, env, keys, toolchain
from jitattn.jit.manifest import expand, read_manifest, unique
from jitattn.jit.registry import spec_from_dict
from jitattn.jit.spec import DTYPE_TAGS, KernelSpec


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"jitattn: error: {exc}", file=sys.stderr)
        return 2
    except RecursionError:
        print("jitattn: error: input nested too deeply", file=sys.stderr)
        return 2
    except Exception as exc:
        from jitattn.errors import JitattnError

        if isinstance(exc, JitattnError):
            print(f"jitattn: error: {exc}", file=sys.stderr)
            return 1
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jitattn", description="JIT-compiled attention kernels: cache tools.")
    sub = p.add_subparsers(title="commands")

    pw = sub.add_parser("prewarm", help="compile specializations into the cache ahead of time")
    pw.add_argument("manifests", nargs="*", type=Path, help="TOML manifests (see cache/default.toml)")
    pw.add_argument("--arch", help="target arch list, e.g. '9.0' or '8.0;9.0' (works without a GPU)")
    pw.add_argument("-j", "--jobs", type=int, help="parallel builds (default: by cores and free memory)")
    pw.add_argument("--force", action="store_true", help="rebuild even if cached")
    pw.add_argument("--spec", action="append", default=[], help="one spec as JSON, e.g. "
                    "'{\"family\": \"decode\", \"head_dim\": 128}' (repeatable)")
    _add_spec_flags(pw)
    pw.set_defaults(handler=cmd_prewarm)

    c = sub.add_parser("cache", help="inspect and manage the cache")
    csub = c.add_subparsers(title="cache commands")
    for name, handler, text in [
        ("list", cmd_cache_list, "list entries in every layer"),
        ("verify", cmd_cache_verify, "re-hash every entry; exit 1 if any is corrupt"),
    ]:
        sp = csub.add_parser(name, help=text)
        sp.set_defaults(handler=handler)
    clear = csub.add_parser("clear", help="delete what jitattn wrote in the writable cache root")
    clear.add_argument("--force", action="store_true",
                       help="also delete files jitattn did not write (refused without it)")
    clear.set_defaults(handler=cmd_cache_clear)
    show = csub.add_parser("show", help="print one entry's manifest")
    show.add_argument("entry", help="entry directory name (or a unique prefix of it)")
    show.set_defaults(handler=cmd_cache_show)
    prune = csub.add_parser("prune", help="remove staging litter (and entries by age/size)")
    prune.add_argument("--staging-age", type=float, default=3600, help="seconds (default 3600)")
    prune.add_argument("--older-than-days", type=float, help="also remove entries not used for this long")
    prune.add_argument("--max-size-mb", type=float, help="then remove least recently used entries above this")
    prune.set_defaults(handler=cmd_cache_prune)
    pack = csub.add_parser("pack", help="write verified entries of the writable root into one archive")
    pack.add_argument("out", type=Path, help="archive to write (.tar.gz/.tgz: gzip, else plain tar)")
    pack.add_argument("--manifest", action="append", type=Path, default=[],
                      help="only the specs of this prewarm manifest (repeatable); each must be cached")
    pack.set_defaults(handler=cmd_cache_pack)
    unpack = csub.add_parser("unpack", help="verify and extract an archive made by `cache pack`")
    unpack.add_argument("archive", type=Path)
    unpack.add_argument("--into", type=Path, help="target cache root, e.g. a seed dir (default: the writable root)")
    unpack.add_argument("--arch", help="only accept entries with code for these archs, e.g. '9.0'")
    unpack.add_argument("--max-member-mb", type=float, default=512, help="largest file accepted (default 512)")
    unpack.add_argument("--max-total-mb", type=float, default=4096, help="most bytes unpacked in all (default 4096)")
    unpack.set_defaults(handler=cmd_cache_unpack)
    push = csub.add_parser("push", help="publish verified entries of the writable root to the fleet tier "
                                         "(JITATTN_REMOTE_CACHE)")
    push.add_argument("--manifest", action="append", type=Path, default=[],
                      help="only the specs of this prewarm manifest (repeatable); each must be cached")
    push.set_defaults(handler=cmd_cache_push)
    pull = csub.add_parser("pull", help="fill the writable root from the fleet tier before a node serves")
    pull.add_argument("--manifest", action="append", type=Path, default=[], required=True,
                      help="the specs to pull (repeatable)")
    pull.add_argument("--arch", help="target arch list (default: as a call would resolve it)")
    pull.set_defaults(handler=cmd_cache_pull)

    for name in ("doctor", "show-config"):
        d = sub.add_parser(name, help="versions, toolchain, arch list, cache layers")
        d.set_defaults(handler=cmd_doctor)

    ex = sub.add_parser("explain", help="print the key components of a specialization")
    ex.add_argument("--arch", help="target arch list (default: as a call would resolve it)")
    ex.add_argument("--spec", action="append", default=[], help="spec as JSON")
    _add_spec_flags(ex)
    ex.set_defaults(handler=cmd_explain)
    return p


# Spec flags -> the field each sets: the first of these names that the family's spec takes.
# Families are found through the registry (`registry.families()`), never named here; a flag
# applies to every chosen family that has its field.
SPEC_FLAGS = {
    "head_dim": ("head_dim",),
    "dtype": ("dtype", "dtype_q"),
    "kv_dtype": ("dtype_kv",),
    "group_size": ("group_size",),
    "pos_encoding": ("pos_encoding",),
    "soft_cap": ("soft_cap",),
    "tensor_cores": ("tensor_cores",),
    "paged": ("paged",),
    "decode": ("decode",),
    "wgmma": ("wgmma",),
}
BOOLEAN_FLAGS = ("soft_cap", "tensor_cores", "paged", "decode", "wgmma")
_SWITCH = {"on": [True], "off": [False], "both": [False, True]}


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    from jitattn.jit.registry import families

    dtypes = list(DTYPE_TAGS)
    g = p.add_argument_group(
        "specializations from flags (each list as '64,128' or '64 128'; lists expand to a cross product; "
        "what a flag leaves out, the family defaults or, where a call picks at run time, covers)")
    g.add_argument("--family", nargs="+", metavar="NAME",
                   help=f"kernel families: {', '.join(sorted(families()))} (default: decode)")
    g.add_argument("--head-dim", nargs="+", metavar="D")
    g.add_argument("--dtype", nargs="+", metavar="DTYPE", help="q dtype (decode), dtype (varlen): float16, bfloat16")
    g.add_argument("--kv-dtype", nargs="+", metavar="DTYPE",
                   help=f"decode k/v dtype (default: = q): {', '.join(dtypes)}")
    g.add_argument("--group-size", nargs="+", metavar="G", help="decode: num_qo_heads // num_kv_heads")
    g.add_argument("--pos-encoding", nargs="+", metavar="MODE", help="decode: NONE, ROPE_LLAMA, ALIBI")
    for flag, what in (("soft-cap", "decode, varlen, varlen_backward: logit soft cap"), ("tensor-cores", "decode: ask for tensor cores"),
                       ("paged", "varlen: paged KV (default both)"),
                       ("decode", "varlen: the decode tile shape (default both)"),
                       ("wgmma", "varlen: the sm_90 wgmma prefill rung (default: where the archs run it)")):
        g.add_argument(f"--{flag}", choices=list(_SWITCH), help=what)
    g.add_argument("--dry-run", action="store_true",
                   help="print the specializations and stop (exit 1 if one cannot build for the target archs)")


def _items(flag: str, raw: list[str], kind: str):
    """'64,128' '256' -> [64, 128, 256] (ints for head_dim/group_size, names otherwise)."""
    values = [item.strip() for token in raw for item in token.split(",") if item.strip()]
    if not values:
        raise ValueError(f"--{flag.replace('_', '-')} needs at least one value")
    if kind == "int":
        try:
            return [int(v) for v in values]
        except ValueError:
            raise ValueError(f"--{flag.replace('_', '-')} takes integers, got {raw}") from None
    return values


def _check_choices(flag: str, values, choices) -> None:
    bad = [v for v in values if v not in choices]
    if bad:
        raise ValueError(f"--{flag.replace('_', '-')}: {bad} not among {list(choices)}")


def _flag_values(args) -> dict[str, list]:
    """The spec flags given, as lists of field values."""
    given = {}
    for flag in SPEC_FLAGS:
        raw = getattr(args, flag, None)
        if raw is None:
            continue
        if flag in BOOLEAN_FLAGS:
            given[flag] = _SWITCH[raw]
            continue
        values = _items(flag, raw, "int" if flag in ("head_dim", "group_size") else "name")
        if flag in ("dtype", "kv_dtype"):
            _check_choices(flag, values, ["float16", "bfloat16"] if flag == "dtype" else list(DTYPE_TAGS))
        elif flag == "pos_encoding":
            values = [v.upper() for v in values]
            _check_choices(flag, values, ["NONE", "ROPE_LLAMA", "ALIBI"])
        given[flag] = values
    return given


def _number(flag: str, value, minimum: float = 0.0, above: bool = False):
    """`value` of a numeric flag if finite and >= `minimum` (> with `above`), else a ValueError."""
    if value is not None and (not math.isfinite(value) or value < minimum or above and value == minimum):
        raise ValueError(f"{flag} must be a finite number {'>' if above else '>='} {minimum:g}, got {value}")
    return value


def _specs_of_json(raw: str) -> list[KernelSpec]:
    """The specs of one `--spec` JSON object (lists expand as in manifests)."""
    try:
        data = bounded_json.loads(raw, max_bytes=1 << 20, what="--spec")
    except bounded_json.JSONBoundError as exc:  # nested or sized past what a spec needs
        raise ValueError(f"--spec JSON is nested too deeply or too large ({exc}): {raw:.80}") from None
    except ValueError as exc:
        raise ValueError(f"--spec is not valid JSON ({exc}): {raw:.200}") from None
    try:
        return [spec_from_dict(d) for d in expand(data)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--spec {raw:.200}: {exc}") from None


def _specs_from_args(args) -> list[KernelSpec]:
    from jitattn.jit.registry import family

    specs: list[KernelSpec] = []
    for path in getattr(args, "manifests", []):
        specs += read_manifest(path)
    for raw in args.spec:
        specs += _specs_of_json(raw)
    given = _flag_values(args)
    names = _items("family", args.family, "name") if args.family else []
    if not given and not names:
        return unique(specs)
    if "head_dim" not in given:
        raise ValueError("spec flags (--family, --dtype, --kv-dtype, ...) need --head-dim")
    archs = _archs_or_none()
    used = set()
    for name in names or ["decode"]:
        cls = family(name)
        accepted = cls.accepted_fields()
        fields = {}
        for flag, values in given.items():
            field = next((f for f in SPEC_FLAGS[flag] if f in accepted), None)
            if field is not None:
                fields[field] = values
                used.add(flag)
        for combo in itertools.product(*fields.values()):
            for variant in cls.prewarm_variants(dict(zip(fields, combo)), archs):
                specs.append(spec_from_dict({"family": name, **variant}))
    unused = [f"--{flag.replace('_', '-')}" for flag in given if flag not in used]
    if unused:
        known = {n: sorted(family(n).accepted_fields()) for n in names or ["decode"]}
        raise ValueError(f"{', '.join(unused)} applies to none of the families {list(known)} (their fields: {known})")
    return unique(specs)


def _archs_or_none() -> tuple[str, ...]:
    """The target archs, or () when nothing names any (a dry run on a machine without a GPU)."""
    from jitattn.errors import ToolchainError

    try:
        return toolchain.target_archs()[0]
    except ToolchainError:
        return ()


def _print_specs(command: str, specs: list[KernelSpec]) -> int:
    """Print the specs and the targets each builds for; returns how many cannot build there."""
    archs = _archs_or_none()
    refused = 0
    print(f"{command} --dry-run: {len(specs)} specializations for {','.join(archs) or '(no target arch set)'}")
    for spec in specs:
        targets = ""
        if archs:
            try:
                targets = f"  [{','.join(spec.archs_for(archs))}]"
            except ValueError as exc:
                targets = f"  [cannot build: {exc}]"
                refused += 1
        print(f"  {spec.name}{targets}\n    {json.dumps(spec.to_dict())}")
    return refused


def _apply_arch(arch: str | None) -> None:
    if arch:
        toolchain.parse_arch_list(arch)  # validate early, with a clear message
        os.environ["JITATTN_CUDA_ARCH_LIST"] = arch


def cmd_prewarm(args) -> int:
    from jitattn.jit.prewarm import default_jobs, prewarm

    from jitattn.jit.prewarm import ConsoleProgress

    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"-j/--jobs takes a positive number of parallel builds, got {args.jobs}")
    _apply_arch(args.arch)
    specs = _specs_from_args(args)
    if not specs:
        raise ValueError("nothing to prewarm: give manifests, --spec or --head-dim")
    if args.dry_run:
        return 1 if _print_specs("prewarm", specs) else 0
    archs, source = toolchain.target_archs()
    jobs = args.jobs or default_jobs()
    root = env.cache_dir()
    print(f"prewarm: {len(specs)} specializations for {','.join(archs)} ({source}) into {root}, {jobs} jobs")
    start = time.perf_counter()
    with ConsoleProgress(len(specs), jobs) as progress:
        outcomes = prewarm(specs, jobs, force=args.force, on_done=progress.finished, on_start=progress.started)
    print(f"\n{'spec':56s} {'status':8s} {'seconds':>8s}")
    for o in outcomes:
        print(f"{o.spec.name:56s} {o.status:8s} {o.seconds:8.1f}")
        if o.detail:
            print(f"    {o.detail}")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("built", "cached", "pulled", "failed")}
    pulled = f", pulled from the fleet {counts['pulled']}" if counts["pulled"] else ""
    print(f"\nbuilt {counts['built']}, already cached {counts['cached']}{pulled}, failed {counts['failed']} "
          f"in {time.perf_counter() - start:.1f} s")
    return 1 if counts["failed"] else 0


def cmd_cache_list(args) -> int:
    for layer, writable in _layers():
        print(f"{layer} ({'writable' if writable else 'read-only seed'})")
        for path in cache.entries(layer):
            entry = cache.read_entry(path)
            size = (path / cache.LIBRARY).stat().st_size if (path / cache.LIBRARY).exists() else 0
            state = "ok" if entry else "INVALID"
            print(f"  {path.relative_to(layer)}  {size / 1024:.0f} KiB  {state}")
    return 0


def cmd_cache_show(args) -> int:
    """The entry named `args.entry`, or the one entry whose name starts with it (the same entry
    in several layers: the first layer's); several names match: refused, listing them."""
    found = [path for layer, _ in _layers() for path in cache.entries(layer) if path.name.startswith(args.entry)]
    exact = [path for path in found if path.name == args.entry]
    names = sorted({path.name for path in found})
    if not exact and len(names) > 1:
        listed = "\n  ".join(names[:20]) + (f"\n  ... and {len(names) - 20} more" if len(names) > 20 else "")
        raise ValueError(f"{args.entry!r} is the prefix of {len(names)} entries; name one:\n  {listed}")
    if not found:
        print(f"no entry named {args.entry}", file=sys.stderr)
        return 1
    path = (exact or found)[0]
    print(path)
    print((path / cache.MANIFEST).read_text() if (path / cache.MANIFEST).exists() else "(no manifest)")
    return 0


def cmd_cache_verify(args) -> int:
    bad = 0
    total = 0
    for layer, _ in _layers():
        for path in cache.entries(layer):
            total += 1
            reason = cache.why_invalid(path)
            if reason:
                bad += 1
                print(f"INVALID {path}: {reason}")
    print(f"verified {total} entries: {total - bad} ok, {bad} invalid")
    return 1 if bad else 0


def cmd_cache_clear(args) -> int:
    root = env.cache_dir()
    removed = cache.clear(root, force=args.force)
    print(f"removed {root}" if not root.exists() else f"removed {len(removed)} item(s) from {root}")
    return 0


def cmd_cache_prune(args) -> int:
    _number("--staging-age", args.staging_age)
    _number("--older-than-days", args.older_than_days)
    _number("--max-size-mb", args.max_size_mb)
    root = env.cache_dir()
    removed = cache.prune_staging(root, args.staging_age)
    entries = [(p, p.stat().st_atime, _dir_size(p)) for p in cache.entries(root)]
    now = time.time()
    for path, atime, _ in list(entries):
        if args.older_than_days is not None and now - atime > args.older_than_days * 86400:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            entries.remove((path, atime, _))
    if args.max_size_mb is not None:
        total = sum(size for *_, size in entries)
        for path, atime, size in sorted(entries, key=lambda e: e[1]):
            if total <= args.max_size_mb * 2**20:
                break
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            total -= size
    for path in removed:
        print(f"removed {path}")
    print(f"pruned {len(removed)} item(s) from {root}")
    return 0


def cmd_cache_pack(args) -> int:
    from jitattn.jit import artifact

    specs = unique(s for path in args.manifest for s in read_manifest(path)) if args.manifest else None
    root = env.cache_dir()
    report = artifact.pack([root], args.out, specs=specs)
    for entry in report.packed:
        print(f"packed   {entry.path}  {entry.size / 1024:.0f} KiB")
    for path, reason in report.skipped:
        print(f"skipped  {path}: {reason}")
    for path, reason in report.refused:
        print(f"REFUSED  {path}: {reason}")
    for spec in report.missing:
        print(f"MISSING  {spec.name}: no verified entry in {root} (prewarm it first)")
    size = args.out.stat().st_size if args.out.exists() else 0
    print(f"packed {len(report.packed)} entries into {args.out} ({size / 2**20:.1f} MiB); "
          f"{len(report.refused)} refused, {len(report.missing)} missing, {len(report.skipped)} skipped")
    if not report.packed and not report.refused and not report.missing:
        print(f"jitattn: nothing to pack in {root}", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_cache_unpack(args) -> int:
    from jitattn.jit import artifact

    archs = toolchain.parse_arch_list(args.arch) if args.arch else None
    _number("--max-member-mb", args.max_member_mb, above=True)
    _number("--max-total-mb", args.max_total_mb, above=True)
    target = args.into or env.cache_dir()
    report = artifact.unpack(args.archive, target, archs=archs, max_member_bytes=int(args.max_member_mb * 2**20),
                             max_total_bytes=int(args.max_total_mb * 2**20))
    for entry in report.accepted:
        note = "already present" if entry.status == "present" else "added"
        print(f"accepted {entry.path} ({note})")
    for rejection in report.rejected:
        print(f"REJECTED {rejection.item}: {rejection.reason}")
    print(f"unpacked {args.archive} into {target}: {len(report.accepted)} accepted, "
          f"{len(report.rejected)} rejected")
    return 0 if report.ok else 1


def _fleet():
    from jitattn.jit import remote

    fleet = remote.tier()
    if fleet is None:
        raise ValueError("no fleet tier: set JITATTN_REMOTE_CACHE=redis://[:password@]host:port/db")
    return fleet


def cmd_cache_push(args) -> int:
    from jitattn.jit.remote import verbs

    fleet = _fleet()
    specs = unique(s for path in args.manifest for s in read_manifest(path)) if args.manifest else None
    root = env.cache_dir()
    report = verbs.push(fleet, root, specs)
    for m in report.moved:
        print(f"{m.status if m.status not in ('failed', 'missing') else m.status.upper():9s} {m.item}"
              f"{': ' + m.detail if m.detail else ''}")
    counts = {s: sum(m.status == s for m in report.moved) for s in ("published", "present", "replaced", "failed", "missing")}
    print(f"pushed {counts['published'] + counts['replaced']} entries from {root} to {fleet.url}; "
          f"{counts['present']} already there, {counts['failed']} failed, {counts['missing']} missing")
    if not report.moved:
        print(f"jitattn: nothing to push in {root}", file=sys.stderr)
    return 0 if report.ok else 1


def cmd_cache_pull(args) -> int:
    from jitattn.jit.remote import verbs

    _apply_arch(args.arch)
    fleet = _fleet()
    specs = unique(s for path in args.manifest for s in read_manifest(path))
    report = verbs.pull(fleet, specs)
    for m in report.moved:
        print(f"{m.status if m.status != 'missing' else 'MISSING':8s} {m.item}: {m.detail}")
    counts = {s: sum(m.status == s for m in report.moved) for s in ("pulled", "present", "missing")}
    print(f"pulled {counts['pulled']} of {len(specs)} specs from {fleet.url} into {env.cache_dir()}; "
          f"{counts['present']} already local, {counts['missing']} missing")
    return 0 if report.ok else 1


def _print_remote_tier() -> None:
    if env.remote_cache_url() is None:
        print("remote cache not configured (JITATTN_REMOTE_CACHE)")
        return
    from jitattn.errors import RemoteCacheError
    from jitattn.jit import remote
    from jitattn.jit.remote import verbs

    try:
        fleet = remote.tier()
    except RemoteCacheError as exc:
        print(f"remote cache {env.redact_url(env.remote_cache_url())}: UNUSABLE: {exc}")
        return
    trust = (f"signs and checks with key id {fleet.key_id} ({fleet.secret_source})" if fleet.secret else
             "no fleet secret: entries are published unsigned")
    if fleet.insecure:
        trust += "; JITATTN_REMOTE_CACHE_INSECURE=1: unsigned or foreign-signed entries are LOADED"
    else:
        trust += "; unsigned or foreign-signed entries are refused"
    found = verbs.survey(fleet)
    if not found["reachable"]:
        print(f"remote cache {fleet.url}: UNREACHABLE ({found['error']})")
    elif "error" in found:
        print(f"remote cache {fleet.url}: reachable (redis {found['version']}), but {found['error']}")
    else:
        sig = found["signing"]
        print(f"remote cache {fleet.url}: reachable (redis {found['version']}, {found['ms']:.1f} ms), "
              f"{found['entries']}{'+' if found['more'] else ''} entries: {sig['this key']} signed with this key, "
              f"{sig['other key']} with another key, {sig['unsigned']} unsigned, {sig['not jitattn']} foreign")
    print(f"remote trust {trust}")


def cmd_doctor(args) -> int:
    import platform

    import torch

    import jitattn

    print(f"jitattn      {jitattn.__version__}")
    print(f"python       {platform.python_version()}")
    print(f"torch        {torch.__version__} (CUDA {torch.version.cuda}); stable ABI target "
          f"{'.'.join(map(str, keys.TORCH_ABI_TARGET))}")
    home, why = toolchain.resolve_cuda_home()
    print(f"CUDA home    {home} ({why})")
    try:
        tc = toolchain.fingerprint(memo_dir=env.cache_dir())
        print(f"nvcc         {tc.nvcc_release} ({tc.nvcc})")
        print(f"host c++     {tc.host_cxx_version} ({tc.host_cxx})")
    except Exception as exc:
        print(f"toolchain    unavailable: {exc}")
    try:
        archs, source = toolchain.target_archs()
        print(f"archs        {','.join(archs)} (from {source})")
    except Exception as exc:
        print(f"archs        {exc}")
    print(f"GPUs         {torch.cuda.device_count()} visible")
    print(f"strict mode  {'on (JITATTN_DISABLE_JIT=1)' if env.jit_disabled() else 'off'}")
    for layer, writable in _layers():
        count = sum(1 for _ in cache.entries(layer)) if layer.exists() else 0
        size = _dir_size(layer) if layer.exists() else 0
        access = "writable" if writable and _writable(layer) else "read-only"
        kind = "cache root" if writable else "seed dir"
        if not writable and not layer.is_dir():
            what = "is not a directory" if layer.exists() else "does not exist"
            print(f"{kind:12s} {layer} (JITATTN_CACHE_SEED_DIRS): MISSING: {what}; nothing is read from it")
            continue
        print(f"{kind:12s} {layer} ({env.cache_dir_source() if writable else 'JITATTN_CACHE_SEED_DIRS'}): "
              f"{count} entries, {size / 2**20:.1f} MiB, {access}{'' if layer.exists() else ', absent'}")
    try:
        _print_remote_tier()
    except ValueError as exc:  # a fleet knob it cannot use: say so, and show the rest
        print(f"remote cache UNUSABLE: {exc}")
    print("\nenvironment knobs:")
    for name, (default, meaning) in env.KNOBS.items():
        value = env.shown(name)  # secrets and URL passwords masked
        print(f"  {name:36s} {value if value is not None else '(unset: ' + default + ')'}  # {meaning}")
    return 0


def cmd_explain(args) -> int:
    from jitattn.jit import loader

    _apply_arch(args.arch)
    specs = _specs_from_args(args)
    if not specs:
        raise ValueError("explain needs --spec or --head-dim")
    if args.dry_run:
        return 1 if _print_specs("explain", specs) else 0
    for spec in specs:
        target = loader.current_target(spec)
        parts = keys.components(spec, target)
        key = keys.key_of(parts)
        print(f"{spec.name}\n  key {key}")
        for name, value in parts.items():
            print(f"  {name:10s} {json.dumps(value)}")
        arch_tag = toolchain.arch_tag(target.archs)
        for layer in loader.layers():
            path = cache.entry_path(layer, keys.CACHE_SCHEMA, arch_tag, spec.name, key)
            state = "present" if cache.read_entry(path, key) else "absent"
            print(f"  entry      {path} ({state})")
            for sibling in cache.siblings(layer, keys.CACHE_SCHEMA, arch_tag, spec.name):
                entry = cache.read_entry(sibling)
                if sibling != path and entry:
                    print(f"  other key  {sibling.name}: differs in {keys.differing(parts, entry.components)}")
        print(f"  remote     {_remote_status(key)}")
    return 0


def _remote_status(key: str) -> str:
    if env.remote_cache_url() is None:
        return "not configured (JITATTN_REMOTE_CACHE)"
    from jitattn.errors import RemoteCacheError
    from jitattn.jit import remote
    from jitattn.jit.remote import verbs

    try:
        fleet = remote.tier()
    except RemoteCacheError as exc:
        return f"{env.redact_url(env.remote_cache_url())} UNUSABLE: {exc}"
    return f"{fleet.url} {remote.entry_name(key)} ({verbs.status_of(fleet, key)})"


def _layers() -> list[tuple[Path, bool]]:
    return [(p, False) for p in env.seed_dirs()] + [(env.cache_dir(), True)]


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _writable(path: Path) -> bool:
    return os.access(path if path.exists() else path.parent, os.W_OK)


if __name__ == "__main__":
    sys.exit(main())
