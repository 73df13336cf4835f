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


def run_on_each_gpu(call):
    """For each GPU: call(device) with another GPU current and a side stream of `device` active;
    yields (device, other index, result) once that stream has finished."""
    count = torch.cuda.device_count()
    for index in range(count):
        device = torch.device("cuda", index)
        other = (index + 1) % count
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(other), torch.cuda.stream(stream):
            result = call(device)
        stream.synchronize()
        yield device, other, result


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_runs_on_the_inputs_device_and_its_current_stream(tensor_cores):
    def call(device):
        q, k, v = inputs(device, seed=device.index)
        return (q, k, v), jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True, use_tensor_cores=tensor_cores)

    for device, other, ((q, k, v), (out, lse)) in run_on_each_gpu(call):
        assert out.device == device and lse.device == device
        ref_out, ref_lse = single_decode_reference(q, k, v)
        assert_close(out, ref_out, 4e-3, 2e-2, f"cuda:{device.index} with cuda:{other} current")
        assert_close(lse, ref_lse, 1e-4, 2e-3, f"cuda:{device.index} lse")


def test_decode_inputs_on_different_devices_are_rejected():
    q, k, v = inputs(torch.device("cuda", 0), seed=1)
    with pytest.raises(ValueError, match="k is on cuda:1"):
        jitattn.single_decode_with_kv_cache(q, k.to("cuda:1"), v)


def varlen_inputs(device, seed, paged):
    """A GQA batch (32/8 heads, D128 bf16) of 3 sequences; paged: a permuted 16-row page pool."""
    g = torch.Generator(device=device).manual_seed(seed)
    lens_q, lens_k = [7, 1, 300], [900, 33, 300]
    cu_q = torch.tensor([0, 7, 8, 308], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 900, 933, 1233], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), 32, 128, device=device, dtype=torch.bfloat16, generator=g)
    if not paged:
        k = torch.randn(sum(lens_k), 8, 128, device=device, dtype=torch.bfloat16, generator=g)
        return dict(query=q, key=k, value=torch.randn_like(k), cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=300, max_k=900)
    pages = 3 * 57  # 57 pages of 16 hold 900 keys
    k = torch.randn(pages, 16, 8, 128, device=device, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(pages, device=device, generator=g).to(torch.int32).view(3, 57)
    used = torch.tensor(lens_k, dtype=torch.int32, device=device)
    return dict(query=q, key=k, value=torch.randn_like(k), cu_seq_q=cu_q, cu_seq_k=None, max_q=300, max_k=900,
                seqused_k=used, block_table=table)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_runs_on_the_inputs_device_and_its_current_stream(paged):
    from jitattn.reference import varlen_attn_reference

    def call(device):
        args = varlen_inputs(device, seed=device.index, paged=paged)
        return args, jitattn.varlen_attn(**args, window_size=(-1, 0), enable_gqa=True,
                                         return_aux=jitattn.AuxRequest(lse=True))

    for device, other, (args, (out, lse)) in run_on_each_gpu(call):
        assert out.device == device and lse.device == device
        ref_out, ref_lse = varlen_attn_reference(**args, window_size=(-1, 0), enable_gqa=True)
        assert_close(out, ref_out, 2e-2, 8e-2, f"varlen cuda:{device.index} with cuda:{other} current")
        assert_close(lse, ref_lse, 1e-4, 2e-3, f"varlen cuda:{device.index} lse")


def test_varlen_inputs_on_different_devices_are_rejected():
    args = varlen_inputs(torch.device("cuda", 0), seed=2, paged=False)
    args["key"] = args["key"].to("cuda:1")
    with pytest.raises(ValueError, match="key is on cuda:1"):
        jitattn.varlen_attn(**args, enable_gqa=True)
