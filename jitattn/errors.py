"""Every exception type jitattn raises on purpose."""
from __future__ import annotations


class JitattnError(RuntimeError):
    """Base class of jitattn's own runtime errors (input errors are ValueError/TypeError)."""


class ToolchainError(JitattnError):
    """No usable CUDA toolkit, host compiler or target arch to build with."""


class JitCompileError(JitattnError):
    """A specialization failed to compile. Carries the spec, the first error line and the log."""

    def __init__(self, spec_name: str, first_error: str, log_path: str):
        self.spec_name = spec_name
        self.first_error = first_error
        self.log_path = log_path
        super().__init__(
            f"compiling {spec_name} failed: {first_error}\n  full compiler log: {log_path}"
        )


class MissingSpecializationError(JitattnError):
    """Strict mode (JITATTN_DISABLE_JIT=1) and the specialization is in no cache layer."""


class CacheLockTimeout(JitattnError):
    """Waited JITATTN_LOCK_TIMEOUT seconds for another process's build of the same key."""


class CacheNotWritable(JitattnError):
    """A build is needed but the cache root cannot be written."""


class RemoteCacheError(JitattnError):
    """JITATTN_REMOTE_CACHE is set but cannot be used as configured (no redis client, a bad URL,
    no fleet secret). Faults of the server itself are never raised: they degrade to the local path."""
