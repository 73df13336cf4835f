"""What the command line does with the fleet tier: push local entries, pull a manifest's specs
into the local root before a node serves, and survey the server (doctor, explain)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from jitattn.jit import cache, keys
from jitattn.jit.remote import FleetTier, entry_name, envelope
from jitattn.jit.remote.store import RemoteFault


@dataclass
class Moved:
    item: str  # an entry path (push) or a spec name (pull)
    status: str  # push: published | present | replaced | failed; pull: present | pulled | missing
    detail: str = ""


@dataclass
class Report:
    moved: list[Moved] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.moved) and all(m.status not in ("failed", "missing") for m in self.moved)


def push(fleet: FleetTier, root: Path, specs=None) -> Report:
    """Publish the verified current-schema entries of `root` (only those of `specs`, if given;
    a spec with no entry is reported missing)."""
    report = Report()
    wanted = None if specs is None else {id(s): s.to_dict() for s in specs}
    found: set[int] = set()
    for path in cache.entries(root, keys.CACHE_SCHEMA):
        entry = cache.read_entry(path)
        rel = path.relative_to(root).as_posix()
        if wanted is not None:
            spec_of = (entry.components.get("spec") if entry else None)
            matches = [i for i, data in wanted.items() if data == spec_of]
            if not matches:
                continue
            found.update(matches)
        if entry is None:
            report.moved.append(Moved(rel, "failed", f"does not verify: {cache.why_invalid(path)}"))
            continue
        status = fleet.share(entry, rel)
        ok = status in ("published", "present", "replaced")
        if ok:
            fleet.heal_alias(entry)  # the real key listed first-class again, junk members trimmed
        report.moved.append(Moved(rel, status if ok else "failed", "" if ok else status))
    for spec in specs or []:
        if id(spec) not in found:
            report.moved.append(Moved(spec.name, "missing", f"no entry in {root} (prewarm it first)"))
    return report


def pull(fleet: FleetTier, specs) -> Report:
    """Fill the writable root with the fleet's entries of `specs`: the exact build this node
    would make, else (as strict mode accepts) a build by another toolchain."""
    from jitattn.jit import loader

    report = Report()
    for spec in specs:
        wanted = loader.wanted(spec)
        present = loader.find_local(wanted)
        if present is not None:
            report.moved.append(Moved(spec.name, "present", str(present.path)))
            continue
        entry, note = fleet.pull(wanted)  # the exact key first
        if entry is None and wanted.key is not None:
            entry, other = fleet.pull(wanted.any_toolchain())
            note = note if entry is None else f"{other} (built with nvcc {entry.components.get('nvcc')}, " \
                                              f"{entry.components.get('host_cxx')}: strict mode serves it)"
        report.moved.append(Moved(spec.name, "pulled" if entry else "missing", str(entry.path) if entry else note))
    return report


def survey(fleet: FleetTier, limit: int = 10000) -> dict:
    """Reachability and what the server holds: entries, and how they are signed."""
    import time

    out = {"url": fleet.url, "reachable": False}
    try:
        start = time.perf_counter()
        out["version"] = fleet.store.server_version()
        out["ms"] = (time.perf_counter() - start) * 1e3
        out["reachable"] = True
        names, more = fleet.store.scan(entry_name("*"), limit)
        counts = {"this key": 0, "other key": 0, "unsigned": 0, "not jitattn": 0}
        for i in range(0, len(names), 500):
            for head in fleet.store.heads(names[i:i + 500], envelope.HEAD_BYTES):
                counts[_signed_by(fleet, head)] += 1
        out.update(entries=len(names), more=more, signing=counts)
    except RemoteFault as fault:
        out["error"] = str(fault)
    except Exception as exc:  # whatever a misbehaving server makes of the survey: a report, not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def status_of(fleet: FleetTier, key: str) -> str:
    """One key's value, for `jitattn explain`: present (and how signed), absent, or a fault."""
    try:
        head = fleet.store.head(entry_name(key), envelope.HEAD_BYTES)
    except RemoteFault as fault:
        return f"unreachable: {fault}"
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"[:300]
    if not head:
        return "absent"
    how = _signed_by(fleet, head)
    return {"this key": "present, signed with this fleet's key", "other key": "present, signed with ANOTHER key",
            "unsigned": "present, UNSIGNED", "not jitattn": "a FOREIGN value (not a jitattn entry)"}[how]


def _signed_by(fleet: FleetTier, head: bytes) -> str:
    try:
        signature = envelope.header_of(head).get("signature")
    except envelope.Refused:
        return "not jitattn"
    if not isinstance(signature, dict) or not signature.get("mac"):
        return "unsigned"
    return "this key" if signature.get("key_id") == fleet.key_id else "other key"
