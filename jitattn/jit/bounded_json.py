"""JSON from an untrusted source (fleet values, archive indexes, cache manifests), parsed
within a size bound and a nesting-depth bound.

Python's json module recurses once per nesting level, so a document nested a few thousand
deep raises RecursionError, which no caller expects; and a huge document costs memory before
anything can be checked. `loads` refuses both with a ValueError (what callers already catch for
malformed JSON), checking the depth in one linear pass before the parser runs.
"""
from __future__ import annotations

import json
import re

MAX_DEPTH = 32  # deeper than anything jitattn writes (its manifests nest 4 levels)


class JSONBoundError(ValueError):
    """JSON over the size or depth bound."""


def loads(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH, what: str = "JSON"):
    """json.loads(data) if it has at most `max_bytes` bytes and nests at most `max_depth`
    arrays/objects deep; else JSONBoundError. Malformed JSON raises ValueError as json does."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise JSONBoundError(f"{what} is {len(raw)} bytes, over the bound of {max_bytes}")
    depth = _depth(raw, max_depth)
    if depth > max_depth:
        raise JSONBoundError(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except RecursionError:  # cannot happen under the depth bound; never let it escape
        raise JSONBoundError(f"{what} nests too deep to parse") from None


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")


def _depth(raw: bytes, limit: int) -> int:
    """The deepest nesting of [ / { outside strings, or limit + 1 as soon as it passes `limit`."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the usual small manifest: nothing to scan
        return 0
    depth = deepest = 0
    for bracket in _BRACKET.findall(_STRING.sub(b"", raw)):
        if bracket in (b"[", b"{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        else:
            depth -= 1
    return deepest


def read(path, *, max_bytes: int, max_depth: int = MAX_DEPTH, what: str | None = None):
    """`loads` of a file, reading at most max_bytes + 1 bytes of it. Raises OSError or ValueError."""
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    return loads(raw, max_bytes=max_bytes, max_depth=max_depth, what=what or str(path))
