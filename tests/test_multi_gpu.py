"""Several GPUs: every launch uses its inputs' device and that device's current stream, whatever
device is current. Skipped with fewer than 2 GPUs (run it on nvidia-h200-x2 or larger)."""
import pytest
import torch

import jitattn
from jitattn.reference import single_decode_reference
from tests.gpu_utils import assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"),
]


def inputs(device, seed, num_qo=32, num_kv=8, kv_len=5000, head_dim=128):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(num_qo, head_dim, device=device, dtype=torch.float16, generator=g)
    k = torch.randn(kv_len, num_kv, head_dim, device=device, dtype=torch.float16, generator=g)
    v = torch.randn(kv_len, num_kv, head_dim, device=device, dtype=torch.float16, generator=g)
    return q, k, v


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_runs_on_the_inputs_device_and_its_current_stream(tensor_cores):
    count = torch.cuda.device_count()
    for index in range(count):
        device = torch.device("cuda", index)
        other = (index + 1) % count
        q, k, v = inputs(device, seed=index)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(other):  # another GPU is current
            with torch.cuda.stream(stream):  # and the inputs' device runs a side stream
                out, lse = jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True,
                                                               use_tensor_cores=tensor_cores)
        stream.synchronize()
        assert out.device == device and lse.device == device
        ref_out, ref_lse = single_decode_reference(q, k, v)
        assert_close(out, ref_out, 4e-3, 2e-2, f"cuda:{index} with cuda:{other} current")
        assert_close(lse, ref_lse, 1e-4, 2e-3, f"cuda:{index} lse")


def test_decode_inputs_on_different_devices_are_rejected():
    q, k, v = inputs(torch.device("cuda", 0), seed=1)
    with pytest.raises(ValueError, match="k is on cuda:1"):
        jitattn.single_decode_with_kv_cache(q, k.to("cuda:1"), v)
