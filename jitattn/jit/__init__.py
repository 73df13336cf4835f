"""The JIT pipeline: spec -> render -> build -> cache -> load. See DESIGN.md."""
from jitattn.jit.loader import get_module
from jitattn.jit.spec import DecodeSpec, KernelSpec

__all__ = ["DecodeSpec", "KernelSpec", "get_module"]
