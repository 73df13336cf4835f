"""Host work of the transformers integration's attention call, per layer, on the CPU (no GPU needed).

    python3 tools/transformers_host_calls.py [path/to/transformers.py]

Loads the integration module from the given file (default: this checkout's, so an older copy can
be compared, e.g. `git show 00b4846:jitattn/integrations/transformers.py > /tmp/old.py`), replaces
jitattn.varlen_attn, which every copy calls through, by `torch.empty`, and runs 32 layer calls of a batch-8 decode step (a 320-slot
cache, 16/4 heads of 128, left padding 0..126 tokens) with and without the padding mask: prints
the torch calls per layer, the host reads (item/tolist/nonzero/...) per 32 layers, and CPU time per
layer call. notes/transformers-host.md has the figures.
"""
import importlib.util
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = {"item", "tolist", "nonzero", "__bool__", "__int__", "__float__"}
LAYERS, BATCH, SLOTS = 32, 8, 320


class CallCounter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def load(path: Path):
    spec = importlib.util.spec_from_file_location("integration_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stand_in(q, *args, **kwargs):
    return torch.empty(q.shape, dtype=q.dtype)


def main():
    import jitattn

    jitattn.varlen_attn = stand_in  # public: each integration copy looks it up at call time
    default = Path(__file__).resolve().parents[1] / "jitattn" / "integrations" / "transformers.py"
    integration = load(Path(sys.argv[1]) if len(sys.argv) > 1 else default)

    class Attn(torch.nn.Module):
        is_causal = True

    q = torch.randn(BATCH, 16, 1, 128, dtype=torch.bfloat16)
    k = torch.randn(BATCH, 4, SLOTS, 128, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(BATCH, SLOTS, dtype=torch.long)
    for i in range(BATCH):
        mask[i, :18 * i] = 0
    with torch.no_grad():
        for case, m in (("padded decode, batch 8", mask), ("dense decode, batch 8", None)):
            counter = CallCounter()
            with counter:
                for _ in range(LAYERS):
                    integration.attention_forward(Attn(), q, k, v, m)
            start = time.perf_counter()
            for _ in range(20):
                for _ in range(LAYERS):
                    integration.attention_forward(Attn(), q, k, v, m)
            per_layer = (time.perf_counter() - start) / 20 / LAYERS
            reads = sum(c in HOST_READS for c in counter.calls)
            print(f"{case}: {len(counter.calls) / LAYERS:.1f} torch calls per layer, {reads} host reads per "
                  f"{LAYERS} layers, {per_layer * 1e6:.0f} us CPU per layer call")
            print("   last layer's calls:", dict(Counter(counter.calls[-len(counter.calls) // LAYERS:])))


if __name__ == "__main__":
    main()
