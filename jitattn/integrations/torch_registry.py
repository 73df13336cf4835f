"""Put "jitattn" into torch's flash-attention registry when torch has one, without importing torch.

`import jitattn` calls `register_when_torch_loads()`: if torch is already imported, the name is
registered at once; otherwise a one-shot import hook registers it right after torch loads its
registry module (torch/nn/attention/_registry.py, which imports nothing from torch, so this is safe
in the middle of `import torch`). Registering only stores a function: nothing is activated (torch
asks providers never to activate on import) and the provider (jitattn/integrations/torch_flash.py,
which imports torch) is imported only when a user activates it. A torch without the registry
(before 2.11) gets nothing and no error. `activate()` / `restore()` (jitattn.activate /
jitattn.restore) switch the provider on and off through torch's registry.
"""
from __future__ import annotations

import importlib.machinery
import sys

IMPL_NAME = "jitattn"
REGISTRY_MODULE = "torch.nn.attention._registry"


def activate_provider():
    """The register_fn torch's `activate_flash_attention_impl("jitattn")` calls: route torch's flash
    ops to jitattn (jitattn/integrations/torch_flash.py) and return the handle that undoes it."""
    from jitattn.integrations import torch_flash

    return torch_flash.install()


def register(registry) -> bool:
    """Register jitattn in `registry` (torch's _registry module); False where it has no such API."""
    register_impl = getattr(registry, "register_flash_attention_impl", None)
    if register_impl is None:
        return False
    register_impl(IMPL_NAME, register_fn=activate_provider)
    return True


def register_when_torch_loads() -> None:
    """Register now if torch's registry is loaded, else once it loads; never imports torch."""
    registry = sys.modules.get(REGISTRY_MODULE)
    if registry is not None:
        register(registry)
    elif "torch" not in sys.modules and not any(isinstance(f, _RegistryHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryHook())
    # torch imported but without the registry module: a torch that has no registry.


class _RegistryHook:
    """A meta path finder (duck-typed: importlib.abc costs an import): finds torch's registry module
    with the ordinary finders and registers jitattn after it runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot, whatever happens next
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register(module)

    def __getattr__(self, name):  # get_source, get_code, ... as the wrapped loader has them
        return getattr(self._loader, name)


# ----------------------------------------------------------------------------- switching it on and off
def _torch_registry():
    """torch's registry module (imports torch), or a RuntimeError naming the torch version."""
    import torch

    registry = getattr(torch.nn.attention, "_registry", None)
    if registry is None or not hasattr(registry, "activate_flash_attention_impl"):
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention registry "
                           "(torch.nn.attention.activate_flash_attention_impl, torch >= 2.11)")
    return registry


def activate() -> None:
    """Route torch's flash attention (SDPA's flash path, torch.nn.attention.varlen) to jitattn:
    torch.nn.attention.activate_flash_attention_impl("jitattn"), registering it first if needed."""
    registry = _torch_registry()
    if IMPL_NAME not in registry.list_flash_attention_impls():
        register(registry)
    registry.activate_flash_attention_impl(IMPL_NAME)


def restore() -> None:
    """Give torch its own flash kernels back if jitattn is the active provider (else do nothing)."""
    registry = _torch_registry()
    if registry.current_flash_attention_impl() == IMPL_NAME:
        registry.restore_flash_attention_impl()


def is_active() -> bool:
    """Whether jitattn is torch's active flash-attention provider."""
    registry = sys.modules.get(REGISTRY_MODULE)
    return registry is not None and getattr(registry, "current_flash_attention_impl", lambda: None)() == IMPL_NAME
