"""Cache archives: pack verified cache entries into one tar file, unpack one safely.

Knows nothing about kernels, only about cache entries (`jitattn.jit.cache`) and the parts of
their manifests that decide whether this jitattn can use them (schema, ABI, archs, key).

An archive is a plain tar (or tar.gz by suffix) whose first member is `index.json`:

    {"format": "jitattn-cache-archive", "version": 1, "created": <unix time>,
     "schema": "v1",                      # the jitattn cache schema of the packer
     "entries": [{"path": "v1/sm90/<name>-<key16>", "key": ..., "name": ..., "archs": [...],
                  "abi": ..., "schema": ..., "files": {"module.so": {"sha256": ..., "size": ...},
                                                       ...every file of the entry...},
                  "signature": {"alg", "key_id", "mac"}}]}   # only when packed with a fleet secret

followed by the entries' directories and files in sorted order, with relative names only.

Unpacking treats the archive as untrusted: members are read one by one (never `extractall`),
every name and type is checked, every byte is hashed against the index, and each entry is
written into a private staging directory inside the target root, verified with
`cache.read_entry`, and only then published with `cache.publish` (one atomic rename; an
existing valid entry wins). A rejected entry leaves nothing behind. Member count, total size
and JSON nesting are bounded before anything is written; with a fleet secret configured, each
entry must carry the fleet's signature (`jitattn.jit.signing`), else an archive is as trusted as
its producer (docs/threat-model.md).
"""
from jitattn.jit.artifact.format import (ARCHIVE, DEFAULT_MAX_MEMBER_BYTES, FORMAT, FORMAT_VERSION, INDEX,
                                         AcceptedEntry, PackedEntry, PackReport, Rejection, UnpackReport,
                                         current_abi)
from jitattn.jit.artifact.packer import pack
from jitattn.jit.artifact.unpacker import unpack, verify_tree

__all__ = ["ARCHIVE", "DEFAULT_MAX_MEMBER_BYTES", "FORMAT", "FORMAT_VERSION", "INDEX", "AcceptedEntry",
           "PackedEntry", "PackReport", "Rejection", "UnpackReport", "current_abi", "pack", "unpack",
           "verify_tree"]
