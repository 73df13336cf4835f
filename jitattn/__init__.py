"""jitattn: attention kernels generated and compiled per specialization, cached on disk."""
from jitattn._log import setup_logging
from jitattn.decode import single_decode_with_kv_cache
from jitattn.errors import (
    CacheLockTimeout,
    CacheNotWritable,
    JitCompileError,
    JitattnError,
    MissingSpecializationError,
    ToolchainError,
)

__version__ = "0.1.0"
__all__ = [
    "CacheLockTimeout",
    "CacheNotWritable",
    "JitCompileError",
    "JitattnError",
    "MissingSpecializationError",
    "ToolchainError",
    "single_decode_with_kv_cache",
]
setup_logging()
