"""Record mode: JITATTN_RECORD=path appends every specialization a process asks for."""
from __future__ import annotations

import json
import logging
import os

from jitattn.jit import env
from jitattn.jit.spec import KernelSpec

_recorded: set[KernelSpec] = set()


def record_spec(spec: KernelSpec) -> None:
    path = env.record_path()
    if path is None or spec in _recorded:
        return
    line = "[[spec]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in spec.to_dict().items()) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One short write with O_APPEND: concurrent recorders do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:  # recording must never break the kernel call it observes
        logging.getLogger("jitattn").warning("JITATTN_RECORD: cannot append to %s: %s", path, exc)
        return
    _recorded.add(spec)


def reset() -> None:
    """Forget which specs this process recorded, so the next use of each is appended again (tests,
    and tools that point JITATTN_RECORD at a new file)."""
    _recorded.clear()
