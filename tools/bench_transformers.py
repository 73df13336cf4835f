"""Tokens/s of a transformers model with attn_implementation="jitattn" beside "sdpa", same run.

PYTHONPATH=. python tools/bench_transformers.py [--layers 4] [--new 64]
A random-weight Llama (hidden 2048, 16 query heads of 128 over 4 KV heads, bf16) on the GPU:
  generate: greedy, batch 8 prompts of 512 tokens, --new tokens each (the KV cache through the
            model's own DynamicCache); tokens/s = generated tokens / wall time, median of 2
            after a warm-up.
  train:    one forward + backward of 8 sequences of 1024 tokens, packed with
            DataCollatorWithFlattening (jitattn) and as a batch (sdpa: its padding-free path is
            a 4D mask); tokens/s = tokens / step time, median of 3 after a warm-up.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import jitattn.integrations.transformers as jt


def model(impl: str, layers: int, state=None):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: seconds less than on the host
        m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.bfloat16)
    if state is not None:
        m.load_state_dict(state)
    return m


def timed(fn, repeats):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    jt.register()
    base = model("sdpa", args.layers)
    state = base.state_dict()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 32000, (8, 512), generator=g).cuda()
    seqs = [torch.randint(1, 32000, (1024,), generator=g).tolist() for _ in range(8)]
    packed = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s, "labels": s} for s in seqs])
    packed = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in packed.items()}
    batch = {"input_ids": torch.tensor(seqs).cuda(), "labels": torch.tensor(seqs).cuda()}
    rows = []
    for impl in ("sdpa", "jitattn"):
        m = base if impl == "sdpa" else model(impl, args.layers, state)
        m.eval()
        with torch.no_grad():
            gen = timed(lambda: m.generate(prompts, max_new_tokens=args.new, do_sample=False, pad_token_id=0), 2)
        m.train()
        inputs = packed if impl == "jitattn" else batch

        def train_step():
            m.zero_grad(set_to_none=True)
            m(**inputs).loss.backward()

        step = timed(train_step, 3)
        rows.append((impl, prompts.shape[0] * args.new / gen, gen, 8 * 1024 / step, step))
        del m
        torch.cuda.empty_cache()
    print(f"\nLlama 2048 hidden, 16/4 heads of 128, {args.layers} layers, bf16, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'attention':10s} {'generate tok/s':>15s} {'(s)':>7s} {'train tok/s':>12s} {'(ms/step)':>10s}")
    for impl, gen_rate, gen, train_rate, step in rows:
        print(f"{impl:10s} {gen_rate:15.0f} {gen:7.2f} {train_rate:12.0f} {step * 1e3:10.1f}")


if __name__ == "__main__":
    main()
