"""Multi-rank cold start: one process per GPU, one fresh shared cache, every rank asks for the
same decode and varlen specializations at the same moment. Reports per-rank time to first result, correctness, and
the compiles each rank did (the total must equal the number of distinct specializations).

Run on a machine with several GPUs:  PYTHONPATH=. python tools/multirank_start.py [--ranks N]
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends), as this workplace requires; no
collective is used here anyway.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[name] = value

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# (num_qo_heads, num_kv_heads, kv_len, use_tensor_cores): distinct decode specializations.
CALLS = [(32, 32, 4096, False), (32, 8, 8192, False), (32, 4, 8192, True)]
# varlen: a prefill batch (contiguous KV) and a paged decode batch: two more specializations.
VARLEN_CALLS = ["prefill", "paged-decode"]


def varlen_inputs(kind: str) -> dict:
    if kind == "prefill":
        cu = torch.tensor([0, 1000, 3000], dtype=torch.int32, device="cuda")
        q = torch.randn(3000, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(3000, 8, 128, device="cuda", dtype=torch.bfloat16)
        return dict(query=q, key=k, value=torch.randn_like(k), cu_seq_q=cu, cu_seq_k=cu, max_q=2000, max_k=2000,
                    window_size=(-1, 0), enable_gqa=True)
    q = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8 * 256, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(8 * 256, device="cuda").to(torch.int32).view(8, 256)
    return dict(query=q, key=k, value=torch.randn_like(k), cu_seq_q=torch.arange(9, dtype=torch.int32, device="cuda"),
                cu_seq_k=None, max_q=1, max_k=4096, enable_gqa=True,
                seqused_k=torch.full((8,), 4096, dtype=torch.int32, device="cuda"), block_table=table)


def rank_main(rank: int, cache: str, barrier, results):
    os.environ["JITATTN_CACHE_DIR"] = cache
    torch.cuda.set_device(rank)
    import jitattn
    from jitattn.jit import loader
    from jitattn.reference import single_decode_reference, varlen_attn_reference

    inputs = []
    for num_qo, num_kv, kv_len, tc in CALLS:
        q = torch.randn(num_qo, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(kv_len, num_kv, 128, device="cuda", dtype=torch.float16)
        v = torch.randn(kv_len, num_kv, 128, device="cuda", dtype=torch.float16)
        inputs.append((q, k, v, tc))
    varlen_args = [varlen_inputs(kind) for kind in VARLEN_CALLS]
    torch.cuda.synchronize()
    barrier.wait()  # every rank starts cold at the same moment
    start = time.perf_counter()
    outs = [jitattn.single_decode_with_kv_cache(q, k, v, use_tensor_cores=tc) for q, k, v, tc in inputs]
    varlen_outs = [jitattn.varlen_attn(**a) for a in varlen_args]
    torch.cuda.synchronize()
    first_result_s = time.perf_counter() - start
    errors = []
    for (q, k, v, _), out in zip(inputs, outs):
        ref, _ = single_decode_reference(q, k, v)
        errors.append(((out.double() - ref).norm() / ref.norm()).item())
    for a, out in zip(varlen_args, varlen_outs):
        ref, _ = varlen_attn_reference(**a)
        errors.append(((out.double() - ref).norm() / ref.norm()).item())
    results.put((rank, first_result_s, loader.COMPILE_COUNT, max(errors)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    if args.ranks < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as cache:
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(args.ranks), ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, cache, barrier, results)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        rows = sorted(results.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        entries = len(list(Path(cache).rglob("manifest.json")))
    compiles = sum(r[2] for r in rows)
    print("| rank | time to first results (s) | compiles | max rel error |")
    print("|---:|---:|---:|---:|")
    for rank, seconds, count, err in rows:
        print(f"| {rank} | {seconds:.2f} | {count} | {err:.1e} |")
    ok = compiles == entries == len(CALLS) + len(VARLEN_CALLS) and all(r[3] < 2e-2 for r in rows)
    print(f"\n{len(CALLS) + len(VARLEN_CALLS)} specializations, {compiles} compiles across {args.ranks} ranks, {entries} cache entries: "
          f"{'OK' if ok else 'FAILED'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
