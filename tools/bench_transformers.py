"""transformers models with attn_implementation="jitattn" beside "sdpa", in the same run (issue 47's table).

PYTHONPATH=. python tools/bench_transformers.py [--layers 4 32] [--new 64] [--profile] [--padding MODE...]
    [--cases generate train encoder flash]

Random weights, bf16, on the GPU. Rows:
  generate b1 / b8:   a Llama (hidden 2048, 16 query heads of 128 over 4 KV heads), greedy, 256-token
                      prompts (batch 8: left-padded, lengths 256 down to 130), --new tokens each,
                      transformers' DynamicCache; tokens/s = generated tokens / wall time.
  train packed:       one forward + backward of 8 sequences of 1024 tokens packed into one row
                      (DataCollatorWithFlattening: position_ids restart; sdpa gets its 4D mask).
  train padded:       the same 8 sequences cut to 1024 down to 576 tokens, right-padded, with the mask.
  encoder d32 / d64:  a BERT-like encoder (6 layers, hidden 384, 12 heads of 32 / 6 heads of 64),
                      256 right-padded sentences of 8 to 68 tokens; sentences/s.
Each case builds every implementation's model (same weights), then times them in interleaved rounds
(--rounds, default 3: sdpa, jitattn, sdpa, ...; each a warm-up and a few runs, the median of them, or
for generation the fastest of --generate-repeats: a host-bound loop is only slowed by the host's other
work; Python's collector off while timed) and keeps each one's
median rate; the ratio column is the median of the rounds' own ratios (each round's jitattn over
that round's sdpa, timed seconds apart: the host's drift cancels), with their min-max. Generation
rows add a "cpu ratio": the same ratio of tokens per CPU second of the timing thread (the host
work of a host-bound loop, without the time a neighbour's process held its core).
Then SDPA's flash path (sdpa_kernel(FLASH_ATTENTION)) with torch's own kernels beside the same
with jitattn active as torch's flash provider (jitattn.activate()), and SDPA's default choice, for
the cases SDPA can send to flash (no mask): generate b1 and a dense train step.
The host rows (case word "host") time one attention layer call of a decode step alone, on the
host: jitattn's attention_forward beside transformers' sdpa_attention_forward on the same tensors
(batch 1 with no mask, batch 8 with the left-padded mask: 2D for jitattn, the 4D bool mask sdpa is
handed), interleaved rounds of a loop of calls (the model around it, which dominates a
batch-1 step's host time, left out).
--profile prints the host-side profile of one decode step at batch 1 and 8 per implementation
(with its unprofiled wall time, device time and host waits), the host and device totals of one
encoder forward (d32), and a cProfile (Python time between the ops) of batch-1 decode steps and
encoder forwards (d64).
--padding host_read async_read adds a column per mode to the padded cases (generate b8, train
padded, the encoders): jitattn with that Backend.padding (jt.jitattn_backend: warm layer calls as
the default's) beside the default "on_device" (no host read; the mask_mod on every padded call),
in the same run. "host_read": the padded path before issue 47 item 2 (one host read per forward
pass, tight max_k, no mask_mod without gaps); "async_read": "on_device" plus a non-blocking read of
whether any row has gaps, whose later layers leave the mask_mod out once it arrived.
--padding flash_mask adds jitattn registered with FlashAttention's mask function (the model's host
read of `attention_mask.all()` in every forward pass) beside jt.padding_mask, which leaves it out of
inference calls with several queries (the encoders, a prompt).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

import jitattn
import jitattn.integrations.transformers as jt

PROMPT, BATCH, SEQ, SENTENCES = 256, 8, 1024, 256
GENERATE_REPEATS = 3  # generations per implementation per round (--generate-repeats)


def llama(impl: str, layers: int, state=None):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    return _build(transformers.AutoModelForCausalLM, config, impl, state)


def encoder(impl: str, heads: int, state=None):
    config = transformers.BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=heads,
                                     intermediate_size=1536, max_position_embeddings=512)
    return _build(transformers.AutoModel, config, impl, state)


def _build(auto, config, impl, state):
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: seconds less than on the host
        m = auto.from_config(config, attn_implementation=impl, dtype=torch.bfloat16)
    if state is not None:
        m.load_state_dict(state)
    return m


def timed(fn, repeats: int, best: bool = False) -> float:
    """Seconds per fn() (synchronized): the median of `repeats` runs after a warm-up, or with `best`
    the fastest."""
    return timed_both(fn, repeats, best)[0]


def timed_both(fn, repeats: int, best: bool = False) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of the median run of `repeats` after a warm-up, or
    with `best` of the fastest. Python's collector stays off while timed (collected first): a
    collection landing in one implementation's run and not the other's is noise, not either one's
    cost. The CPU time leaves out the time the thread waited off-CPU (another process on its core):
    for a host-bound loop, the work itself."""
    fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    runs = []
    try:
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            torch.cuda.synchronize()
            runs.append((time.perf_counter() - start, time.thread_time() - start_cpu))
    finally:
        gc.enable()
    runs.sort()
    return runs[0] if best else runs[len(runs) // 2]


def inputs(g: torch.Generator):
    """Every case's inputs, made once (the same for both implementations)."""
    ids = torch.randint(1, 32000, (BATCH, PROMPT), generator=g)
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    for i in range(BATCH):  # left padding: prompt i has PROMPT - 18 i tokens
        ids[i, :18 * i], mask[i, :18 * i] = 0, 0
    seqs = [torch.randint(1, 32000, (SEQ,), generator=g).tolist() for _ in range(BATCH)]
    packed = transformers.DataCollatorWithFlattening()([{"input_ids": s, "labels": s} for s in seqs])
    lengths = [SEQ - 64 * i for i in range(BATCH)]
    padded_ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    padded_mask = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for i, n in enumerate(lengths):
        padded_ids[i, :n], padded_mask[i, :n] = torch.tensor(seqs[i][:n]), 1
    labels = padded_ids.masked_fill(padded_mask == 0, -100)
    sent_lengths = torch.randint(8, 69, (SENTENCES,), generator=g)
    sent_ids = torch.randint(1, 30522, (SENTENCES, int(sent_lengths.max())), generator=g)
    sent_mask = (torch.arange(sent_ids.shape[1])[None] < sent_lengths[:, None]).long()
    cuda = lambda d: {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}  # noqa: E731
    return {
        "b1": cuda({"input_ids": ids[:1]}),
        "b8": cuda({"input_ids": ids, "attention_mask": mask}),
        "packed": cuda(dict(packed)),
        "padded": cuda({"input_ids": padded_ids, "attention_mask": padded_mask, "labels": labels}),
        "dense": cuda({"input_ids": torch.tensor(seqs), "labels": torch.tensor(seqs)}),
        "sentences": cuda({"input_ids": sent_ids * sent_mask, "attention_mask": sent_mask}),
    }


def generate_rate(m, batch, new, repeats: int = GENERATE_REPEATS):
    """(tokens/s, tokens per CPU second of this thread) of the fastest of `repeats` generations: a
    host-bound loop is only ever slowed by the host's other work (a neighbour's process, a clock
    step), so the fastest run is its own cost; the CPU rate leaves the time off-CPU out too."""
    m.eval()
    with torch.no_grad():
        seconds, cpu = timed_both(lambda: m.generate(**batch, max_new_tokens=new, min_new_tokens=new,
                                                     do_sample=False, pad_token_id=0), repeats, best=True)
    tokens = batch["input_ids"].shape[0] * new
    return tokens / seconds, tokens / cpu


def train_rate(m, batch, tokens):
    m.train()

    def step():
        m.zero_grad(set_to_none=True)
        m(**batch).loss.backward()

    return tokens / timed(step, 3)


def encode_rate(m, batch):
    m.eval()
    with torch.no_grad():
        return batch["input_ids"].shape[0] / timed(lambda: m(**batch), 5)


def padding(impl: str):
    """The context an implementation runs in: "jitattn:<padding>" sets Backend.padding;
    "jitattn:flash_mask" runs with FlashAttention's mask function instead of jt.padding_mask."""
    name, _, how = impl.partition(":")
    if not how:
        return contextlib.nullcontext()
    if how == FLASH_MASK:
        return flash_mask()
    return jt.use_backend(jt.jitattn_backend(how))


FLASH_MASK = "flash_mask"


@contextlib.contextmanager
def flash_mask():
    """jitattn as registered before jt.padding_mask: FlashAttention's mask function, whose check
    `attention_mask.all()` reads the mask back in every forward pass."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionMaskInterface.register(jt.NAME, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    try:
        yield
    finally:
        AttentionMaskInterface.register(jt.NAME, jt.padding_mask)


def in_turn(settings: tuple, round_index: int):
    """The settings of one interleaved round, in ABBA order (reversed every other round, so none
    always runs first or last), each after a GC pass (the last one's garbage is not collected
    inside the next one's timing)."""
    for setting in settings if round_index % 2 == 0 else settings[::-1]:
        gc.collect()
        yield setting


def compare(make, case, impls=("sdpa", "jitattn"), rounds: int = 3):
    """{impl: rate} for one case, {impl: [its rate over sdpa's, per round]} and the same of the
    rates per CPU second where the case gives them (else empty lists): each implementation
    on the same weights, all built first, then timed in interleaved rounds (sdpa, jitattn, then
    jitattn, sdpa, ...) and the median kept, so a drift of the machine's clocks or host load, or
    a cost of running first or second, reaches every implementation alike."""
    models, state = {}, None
    for impl in impls:
        models[impl] = make(impl.partition(":")[0], state)
        state = state or models[impl].state_dict()
    rates = {impl: [] for impl in impls}
    cpu_rates = {impl: [] for impl in impls}  # cases that also return a rate per CPU second
    for r in range(rounds):
        for impl in in_turn(impls, r):
            with padding(impl):
                rate = case(models[impl])
            if isinstance(rate, tuple):
                rate, cpu = rate
                cpu_rates[impl].append(cpu)
            rates[impl].append(rate)
    del models
    torch.cuda.empty_cache()
    ratios = {impl: sorted(r / base for r, base in zip(rates[impl], rates["sdpa"])) for impl in impls}
    cpu_ratios = {impl: sorted(r / base for r, base in zip(cpu_rates[impl], cpu_rates["sdpa"])) for impl in impls}
    return {impl: statistics.median(r) for impl, r in rates.items()}, ratios, cpu_ratios


def flash_provider_rows(data, layers, new, rounds: int = 3):
    """SDPA's flash path with torch's kernels, then with jitattn's (the provider), and SDPA's
    default: yields (case, {setting: median rate, "ratios": sorted per-round jitattn / flash}) as each
    case's rounds end, the settings timed in interleaved rounds on one set of weights, as `compare` does."""
    def run(setting):
        if setting == "default":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        if setting == "jitattn":
            jitattn.activate()
            stack.callback(jitattn.restore)
        return stack

    settings = ("default", "flash", "jitattn")
    for name, case in (
        ("generate b1 tok/s", lambda m: generate_rate(m, data["b1"], new)[0]),
        ("train dense tok/s", lambda m: train_rate(m, data["dense"], BATCH * SEQ)),
    ):
        models, state = {}, None
        for setting in settings:
            models[setting] = llama("sdpa", layers, state)
            state = state or models[setting].state_dict()
        rates = {setting: [] for setting in settings}
        for r in range(rounds):
            for setting in in_turn(settings, r):
                try:
                    with run(setting):
                        rates[setting].append(case(models[setting]))
                except RuntimeError as exc:  # e.g. SDPA finds no flash-capable call (a mask): say so, go on
                    print(f"{name}, {setting}: {str(exc).splitlines()[0]}")
                    rates[setting].append(float("nan"))
        del models
        torch.cuda.empty_cache()
        row = {setting: statistics.median(r) for setting, r in rates.items()}
        row["ratios"] = sorted(j / f for j, f in zip(rates["jitattn"], rates["flash"]))
        yield name, row


def profile_decode(data, layers):
    """Host time per op of one decode step at batch 1 and batch 8 (the prompt's KV cache already filled)."""
    from torch.profiler import ProfilerActivity, profile

    state = None
    for impl in ("sdpa", "jitattn"):
        m = llama(impl, layers, state).eval()
        state = state or m.state_dict()
        for key in ("b1", "b8"):
            batch = data[key]
            with torch.no_grad():
                out = m(**batch, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                step = {"past_key_values": out.past_key_values, "use_cache": True}
                if "attention_mask" in batch:
                    step["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones_like(nxt)], 1)
                for _ in range(3):  # warm
                    m(nxt, **step)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(10):
                    m(nxt, **step)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - start) / 10
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    m(nxt, **step)
                    torch.cuda.synchronize()
            events = prof.key_averages()
            device = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
            waited = sum(e.self_cpu_time_total for e in events if e.key in SYNC_LIKE) / 1e3
            print(f"\n-- one decode step, {key}, {layers} layers, {impl}: {wall * 1e3:.2f} ms wall (unprofiled), "
                  f"{device:.3f} ms device, {waited:.2f} ms host waits; host time by op, then device time by kernel")
            print(events.table(sort_by="cpu_time_total", row_limit=25))
            print(events.table(sort_by="self_device_time_total", row_limit=12))
            del out
        del m
        torch.cuda.empty_cache()


def profile_python(data, layers, impls):
    """Python-level host profile (cProfile: the time between torch ops, which torch.profiler does
    not count) of 20 batch-1 decode steps and of 10 encoder forwards (d64), per implementation."""
    import cProfile
    import pstats

    def show(label, prof):
        stats = pstats.Stats(prof)
        print(f"\n-- cProfile, {label}: {stats.total_tt * 1e3:.1f} ms in all")
        stats.sort_stats("tottime").print_stats(18)
        stats.sort_stats("cumulative").print_stats("attention|jitattn", 18)

    def steps_wall(m, nxt, step, steps=20):
        """ms a decode step, GC on and off, and the GC passes per generation those steps ran: the
        in-situ cost that a layer call timed alone (decode_host.py) does not show."""
        walls = {}
        for enabled in (True, False, True):
            before = [s["collections"] for s in gc.get_stats()]
            (gc.enable if enabled else gc.disable)()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                m(nxt, **step)
            torch.cuda.synchronize()
            walls.setdefault(enabled, []).append((time.perf_counter() - start) / steps * 1e3)
            gc.enable()
            passes = [s["collections"] - b for s, b in zip(gc.get_stats(), before)]
        print(f"   {steps} steps: {min(walls[True]):.2f} ms a step with GC, {walls[False][0]:.2f} without; "
              f"GC passes by generation in the last {steps}: {passes}")

    state = None
    for impl in ("sdpa", "jitattn"):
        m = llama(impl, layers, state).eval()
        state = state or m.state_dict()
        with torch.no_grad():
            out = m(**data["b1"], use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            step = {"past_key_values": out.past_key_values, "use_cache": True}
            for _ in range(3):
                m(nxt, **step)
            print(f"\n-- {impl}, b1 decode steps, {layers} layers")
            steps_wall(m, nxt, step)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                m(nxt, **step)
            torch.cuda.synchronize()
            prof.disable()
        show(f"20 decode steps, b1, {layers} layers, {impl}", prof)
        del m, out
        torch.cuda.empty_cache()
    state = None
    for impl in impls:
        m = encoder(impl.partition(":")[0], 6, state).eval()
        state = state or m.state_dict()
        with torch.no_grad(), padding(impl):
            for _ in range(3):
                m(**data["sentences"])
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(10):
                m(**data["sentences"])
            torch.cuda.synchronize()
            prof.disable()
        show(f"10 encoder forwards, d64, {impl}", prof)
        del m
        torch.cuda.empty_cache()


SYNC_LIKE = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
             "aten::_local_scalar_dense")


def profile_encoder(data, impls):
    """Host (self CPU) and device (self CUDA) totals of one encoder forward (d32, 256 sentences)."""
    from torch.profiler import ProfilerActivity, profile

    state = None
    print("\n-- one encoder forward, d32, 256 padded sentences: totals")
    for impl in impls:
        m = encoder(impl.partition(":")[0], 12, state).eval()
        state = state or m.state_dict()
        with torch.no_grad(), padding(impl):
            for _ in range(3):  # warm
                m(**data["sentences"])
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                m(**data["sentences"])
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 10
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                m(**data["sentences"])
                torch.cuda.synchronize()
        events = prof.key_averages()
        host = sum(e.self_cpu_time_total for e in events) / 1e3
        device = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / 1e3
        waits = [e for e in events if e.key in SYNC_LIKE]
        syncs, waited = sum(e.count for e in waits), sum(e.self_cpu_time_total for e in waits) / 1e3
        print(f"{impl:20s} wall {wall * 1e3:6.2f} ms (unprofiled)  host {host:8.2f} ms  device {device:8.2f} ms  "
              f"sync-like calls {syncs} "
              f"({waited:.2f} ms in them: the host waiting for the device)")
        print(events.table(sort_by="self_device_time_total", row_limit=10))
        del m
        torch.cuda.empty_cache()


def host_rows(rounds: int) -> list:
    """[(case, sdpa us, jitattn us, min-max of sdpa / jitattn per round)]: one decode layer call's
    host time (tools/bench_util.py's host_us_rounds: a loop of calls, one sync at its end)."""
    from bench_util import host_us_rounds
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attention(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 4

    module, rows = Attention(), []
    g = torch.Generator().manual_seed(2)
    for batch in (1, 8):
        q = torch.randn(batch, 16, 1, 128, generator=g).to("cuda", torch.bfloat16)
        k, v = (torch.randn(batch, 4, PROMPT + 32, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        mask = mask4d = None
        if batch > 1:
            mask = torch.ones(batch, PROMPT + 32, dtype=torch.long, device="cuda")
            for i in range(batch):
                mask[i, :18 * i] = 0
            mask4d = mask.bool()[:, None, None, :]
        with torch.no_grad():
            times = host_us_rounds({"sdpa": lambda: sdpa_attention_forward(module, q, k, v, mask4d, scaling=128 ** -0.5),
                                    "jitattn": lambda: jt.attention_forward(module, q, k, v, mask, scaling=128 ** -0.5)},
                                   calls=2000, rounds=rounds)
        ratios = sorted(a / b for a, b in zip(times["sdpa"], times["jitattn"]))
        rows.append((f"host us per decode layer call, b{batch}", statistics.median(times["sdpa"]),
                     statistics.median(times["jitattn"]), ratios))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per case")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--generate-repeats", type=int, default=GENERATE_REPEATS,
                        help="generations per implementation per round; the fastest is its rate")
    parser.add_argument("--padding", nargs="*", default=[],
                        choices=[p for p in jt.PADDINGS if p != "on_device"] + [FLASH_MASK],
                        help="also jitattn with these Backend.padding modes on the padded cases (flash_mask: "
                             "with FlashAttention's mask function)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help="only the rows whose name holds one of these words (generate, train, encoder, "
                             "host: one decode layer call's host time, flash: the flash-registry rows)")
    args = parser.parse_args()
    wants = lambda name: args.cases is None or any(c in name for c in args.cases)  # noqa: E731
    jt.register()
    data = inputs(torch.Generator().manual_seed(1))
    modes = [f"jitattn:{how}" for how in args.padding]
    padded = ("sdpa", "jitattn", *modes)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"bf16; Llama hidden 2048, 16/4 heads of 128; prompts {PROMPT}, {args.new} new tokens")
    extra = "".join(f" {how:>10s} {'ratio':>7s}" for how in args.padding)
    print(f"{'case':42s} {'sdpa':>10s} {'jitattn':>10s} {'ratio':>7s} {'rounds min-max':>15s} "
          f"{'cpu ratio':>9s} {'min-max':>11s}{extra}", flush=True)

    def row(name, result):
        """One case's line, printed as soon as its rounds are done (a run cut short keeps its rows)."""
        rates, ratios, cpu_ratios = result
        spread, cpu = ratios["jitattn"], cpu_ratios["jitattn"]
        line = (f"{name:42s} {rates['sdpa']:10.0f} {rates['jitattn']:10.0f} {statistics.median(spread):6.2f}x "
                f"{spread[0]:7.2f}-{spread[-1]:.2f}x "
                + (f"{statistics.median(cpu):8.3f}x {cpu[0]:5.3f}-{cpu[-1]:.3f}" if cpu else f"{'':9s} {'':11s}"))
        for mode in modes:
            if mode in rates:
                line += f" {rates[mode]:10.0f} {statistics.median(ratios[mode]):6.2f}x"
        print(line, flush=True)

    for layers in args.layers:
        for name, key in (("generate b1 tok/s", "b1"), ("generate b8 padded tok/s", "b8")):
            if wants(name):
                row(f"{name}, {layers} layers", compare(lambda impl, s: llama(impl, layers, s),
                                                        lambda m: generate_rate(m, data[key], args.new,
                                                                                args.generate_repeats),
                                                        padded if key == "b8" else ("sdpa", "jitattn"), args.rounds))
    layers = args.layers[0]
    if wants("train packed"):
        row(f"train packed tok/s, {layers} layers", compare(
            lambda impl, s: llama(impl, layers, s), lambda m: train_rate(m, data["packed"], BATCH * SEQ),
            rounds=args.rounds))
    padded_tokens = int(data["padded"]["attention_mask"].sum())
    if wants("train padded"):
        row(f"train padded tok/s, {layers} layers", compare(
            lambda impl, s: llama(impl, layers, s), lambda m: train_rate(m, data["padded"], padded_tokens), padded,
            args.rounds))
    for heads in (12, 6):
        if wants("encoder"):
            row(f"encoder d{384 // heads} sentences/s", compare(
                lambda impl, s: encoder(impl, heads, s), lambda m: encode_rate(m, data["sentences"]), padded,
                args.rounds))
    if wants("host"):
        print(f"{'case (us: lower is better)':42s} {'sdpa':>10s} {'jitattn':>10s} {'sdpa/ours':>9s} {'rounds min-max':>15s}")
        for name, sdpa_us, ours_us, ratios in host_rows(args.rounds):
            print(f"{name:42s} {sdpa_us:10.1f} {ours_us:10.1f} {statistics.median(ratios):8.2f}x "
                  f"{ratios[0]:7.2f}-{ratios[-1]:.2f}x")
    if wants("flash"):
        print(f"\nSDPA through torch's flash-attention registry, {layers} layers, {args.rounds} interleaved rounds "
              "(flash: sdpa_kernel(FLASH_ATTENTION); jitattn: the same with jitattn.activate(); vs flash: the median "
              "of the rounds' ratios)")
        print(f"{'case':42s} {'default':>10s} {'flash':>10s} {'jitattn':>10s} {'vs flash':>9s} {'rounds min-max':>15s} "
              f"{'vs default':>11s}", flush=True)
        for name, r in flash_provider_rows(data, layers, args.new, args.rounds):
            ratios = r["ratios"]
            print(f"{name:42s} {r['default']:10.0f} {r['flash']:10.0f} {r['jitattn']:10.0f} "
                  f"{statistics.median(ratios):8.2f}x {ratios[0]:7.2f}-{ratios[-1]:.2f}x "
                  f"{r['jitattn'] / r['default']:10.2f}x", flush=True)
    if args.profile:
        profile_decode(data, layers)
        profile_encoder(data, padded)
        profile_python(data, layers, padded)


if __name__ == "__main__":
    main()
