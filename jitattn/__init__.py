"""jitattn: attention kernels generated and compiled per specialization, cached on disk.

The API functions are imported on first use, so the command line and the cache tools start
without importing torch. `activate()` / `restore()` make torch's own flash attention (SDPA's flash
path, torch.nn.attention.varlen) run jitattn's kernels (jitattn/integrations/torch_flash.py).
Each kernel family is one folder (jitattn/decode, jitattn/varlen); the compiler service that
builds, caches and loads their kernels (jitattn/jit) knows none of them.
"""
from jitattn._log import setup_logging
from jitattn.integrations.torch_registry import activate, register_when_torch_loads, restore
from jitattn.errors import (
    CacheLockTimeout,
    CacheNotWritable,
    JitCompileError,
    JitattnError,
    MissingSpecializationError,
    RemoteCacheError,
    ToolchainError,
)

__version__ = "0.1.0"
__all__ = [
    "CacheLockTimeout",
    "CacheNotWritable",
    "JitCompileError",
    "JitattnError",
    "MissingSpecializationError",
    "RemoteCacheError",
    "ToolchainError",
    "AuxRequest",
    "single_decode_with_kv_cache",
    "varlen_attn",
    "varlen_attn_out",
    "flex_attention",
    "create_block_mask",
    "BlockMask",
    "activate",
    "restore",
]
_LAZY = {
    "single_decode_with_kv_cache": "jitattn.decode.api",
    "varlen_attn": "jitattn.varlen.api",
    "varlen_attn_out": "jitattn.varlen.api",
    "AuxRequest": "jitattn.varlen.checks",
    "flex_attention": "jitattn.flex",
    "create_block_mask": "jitattn.flex",
    "BlockMask": "jitattn.flex",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jitattn' has no attribute {name!r}")


setup_logging()
# "jitattn" in torch's flash-attention registry (jitattn/integrations/torch_registry.py): activates
# nothing, imports no torch; `jitattn.activate()` / `jitattn.restore()` switch it on and off.
register_when_torch_loads()
