"""The single-decode kernel family: jitattn.single_decode_with_kv_cache (FlashInfer's signature).

api (validate -> spec -> module -> launch), spec (DecodeSpec and the call -> spec rule), plan
(the split over CTAs), launch (the C entry point). The API is imported on first use, so finding
the family's spec (jitattn.jit.registry) does not import torch.
"""


def __getattr__(name: str):
    if name == "single_decode_with_kv_cache":
        from jitattn.decode.api import single_decode_with_kv_cache

        return single_decode_with_kv_cache
    raise AttributeError(f"module 'jitattn.decode' has no attribute {name!r}")
