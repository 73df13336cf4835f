"""GPU: small random-weight Llama, Mistral (sliding window) and Gemma-2 (with and without its logit
soft cap, set to 2 here so that it bites) models with
attn_implementation="jitattn" against transformers' own sdpa (and eager for Gemma-2), in bfloat16,
each judged against the same weights in float32 (sdpa): logits with padding, greedy generation with
the KV cache, one training step's loss and gradients, packed (DataCollatorWithFlattening) against
unpacked. jitattn must be as close to float32 as bfloat16 sdpa is (a small factor of its error).
Padding masks of every kind (gaps inside rows included) against float64 sdpa, a padded training
step with gaps, and the padded path with no host sync in any layer.
The CPU side, with the float64 reference behind the integration: tests/test_transformers_integration.py.
"""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import jitattn.integrations.transformers as jt  # noqa: E402
from tests.varlen_utils import DEVICE, TOL, close  # noqa: E402  ("cuda"; JITATTN_TEST_DEVICE=cpu dry-runs this file)
from tests.test_transformers_integration import (  # noqa: E402  (the float64 side of the padded path)
    MASK_KINDS, masked_reference, random_mask, sdpa as sdpa_float64, visibility)

BF16 = torch.bfloat16
pytestmark = pytest.mark.gpu if DEVICE == "cuda" else []


@pytest.fixture(autouse=True)
def dry_run():
    """On the CPU (a dry run of this file's logic), the float64 reference stands in for the kernels."""
    if DEVICE == "cuda":
        yield
        return
    from jitattn.reference import varlen_attn_reference

    def standin(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                seqused_k=None, softcap=None, mask_mod=None):
        if mask_mod is not None:  # the padded path's mask_mod
            return masked_reference(q, k, v, cu_q, cu_k, seqused_k, scale, window_size, softcap,
                                    visibility(mask_mod)).to(q.dtype)
        out, _ = varlen_attn_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                       seqused_k=seqused_k, softcap=softcap)
        return out.to(q.dtype)

    with jt.use_backend(jt.Backend(standin)):
        yield


def config(name, **kw):
    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    if name == "llama":
        return transformers.LlamaConfig(**common, **kw)
    if name == "mistral":
        return transformers.MistralConfig(**common, sliding_window=16, **kw)
    kw.setdefault("attn_logit_softcapping", SOFT_CAP if name == "gemma2-softcap" else None)
    return transformers.Gemma2Config(**common, head_dim=64, sliding_window=16, query_pre_attn_scalar=80,
                                     final_logit_softcapping=None, **kw)


SOFT_CAP = 2.0  # Gemma-2's is 50; at 2 every logit of these small models is visibly capped
NAMES = ["llama", "mistral", "gemma2", "gemma2-softcap"]


def supports(name, impl) -> bool:
    """Whether this transformers has `impl` for the architecture (5.24 dropped sdpa for Gemma-2).
    transformers' sdpa has no logit soft cap (it drops the argument): only eager computes it."""
    if impl == "sdpa" and name == "gemma2-softcap":
        return False
    try:
        transformers.AutoModelForCausalLM.from_config(config(name), attn_implementation=impl)
    except ValueError as exc:
        if "does not support an attention implementation" in str(exc):
            return False
        raise
    return True


def models(name, peers=("sdpa",), **kw):
    """{implementation: model} sharing random weights: jitattn and the peers this transformers
    has, in bf16; "fp32" = the same in float32 (sdpa, else eager)."""
    jt.register()
    peers = [p for p in peers if supports(name, p)]
    reference = "sdpa" if supports(name, "sdpa") else "eager"
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config(name, **kw), attn_implementation=reference)
    state = base.state_dict()
    out = {}
    for impl, dtype in [("jitattn", BF16), *[(p, BF16) for p in peers], ("fp32", torch.float32)]:
        m = transformers.AutoModelForCausalLM.from_config(config(name, **kw), attn_implementation=
                                                          reference if impl == "fp32" else impl)
        m.load_state_dict(state)
        out[impl] = m.to(device=DEVICE, dtype=dtype).eval()
    return out


def prompts(batch=4, width=40, seed=1):
    """Left-padded prompts of lengths width, width - 7, ... (ids >= 1, 0 the pad)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    for i in range(batch):
        ids[i, :7 * i], mask[i, :7 * i] = 0, 0
    return ids.to(DEVICE), mask.to(DEVICE)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", NAMES)
def test_logits_with_padding_are_as_close_to_float32_as_sdpa(name):
    peers = ("sdpa", "eager") if name.startswith("gemma2") else ("sdpa",)
    ms = models(name, peers)
    ids, mask = prompts()
    valid = mask.bool()
    with torch.no_grad():
        logits = {impl: m(ids, attention_mask=mask).logits[valid] for impl, m in ms.items()}
    ours = rel(logits["jitattn"], logits["fp32"])
    for peer in [p for p in peers if p in logits]:
        theirs = rel(logits[peer], logits["fp32"])
        print(f"\n{name}: logits rel error vs float32: jitattn {ours:.2e}, {peer} {theirs:.2e}")
        assert ours <= 2 * theirs + 1e-3, f"{name}: jitattn {ours:.2e} vs {peer} {theirs:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_picks_float32s_argmax(name):
    """Each token jitattn generates (bf16, KV cache, padded batch) is float32's argmax up to bf16
    noise: teacher-forced through the float32 model, its logit is within tol of the best."""
    ms = models(name, peers=("sdpa", "eager"))
    ids, mask = prompts(seed=2)
    new = 24
    common = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = ms["jitattn"].generate(ids, attention_mask=mask, **common)
        theirs = ms["sdpa" if "sdpa" in ms else "eager"].generate(ids, attention_mask=mask, **common)
        full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype, device=mask.device)], 1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
        logits = ms["fp32"](ours, attention_mask=full_mask, position_ids=positions).logits[:, ids.shape[1] - 1:-1]
    chosen = logits.gather(-1, ours[:, ids.shape[1]:, None])[..., 0]
    gap = logits.max(-1).values - chosen
    spread = logits.std(-1).mean().item()
    same = (ours == theirs).float().mean().item()
    print(f"\n{name}: jitattn tokens equal to sdpa's: {same:.1%}; largest gap to float32's best {gap.max():.3f} "
          f"(logit spread {spread:.3f})")
    assert gap.max().item() <= 0.05 * spread + 1e-3, f"{name}: a generated token is not float32's argmax"


def training_batches(seed=3):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (37, 64, 13, 50)]
    width = max(map(len, seqs))
    padded = {"input_ids": torch.tensor([s + [0] * (width - len(s)) for s in seqs]).to(DEVICE),
              "labels": torch.tensor([s + [-100] * (width - len(s)) for s in seqs]).to(DEVICE)}
    padded["attention_mask"] = (padded["labels"] != -100).long()
    features = [{"input_ids": s, "labels": s} for s in seqs]
    packed = {}
    for flash in (False, True):
        b = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)(features)
        packed[flash] = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
    return padded, packed


def step(model, batch):
    model.train()
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("name", NAMES)
def test_training_step_packed_and_unpacked_is_as_close_to_float32_as_sdpa(name):
    """Against bf16 sdpa and eager on the padded batch. With a sliding window and padding, bf16
    sdpa's gradients are NaN (seen on the H200: padded query rows with no visible key), so the
    bound is the closer of the peers whose gradients are finite."""
    ms = models(name, peers=("sdpa", "eager"))
    padded, packed = training_batches()
    ref_loss, ref_grad = step(ms["fp32"], padded)
    peers = {}
    for peer in [p for p in ("sdpa", "eager") if p in ms]:
        loss, grad = step(ms[peer], padded)
        peers[peer] = (loss, rel(grad, ref_grad))
    finite = {p: v for p, v in peers.items() if math.isfinite(v[1]) and math.isfinite(v[0])}
    assert finite, f"{name}: no peer has finite gradients: {peers}"
    loss_bound = min(abs(loss - ref_loss) for loss, _ in finite.values())
    err_bound = min(err for _, err in finite.values())
    said = ", ".join(f"{p} loss {v[0]:.5f} grad {v[1]:.2e}" for p, v in peers.items())
    runs = {"unpacked": padded, "packed (position_ids)": packed[False], "packed (flash kwargs)": packed[True]}
    for label, batch in runs.items():
        loss, grad = step(ms["jitattn"], batch)
        err = rel(grad, ref_grad)
        print(f"\n{name} {label}: loss {loss:.5f} (float32 {ref_loss:.5f}; {said}); grad rel error vs float32 "
              f"{err:.2e}")
        assert abs(loss - ref_loss) <= 2 * loss_bound + 2e-3 * abs(ref_loss), f"{name} {label}: loss"
        assert err <= 2 * err_bound + 1e-3, f"{name} {label}: gradients"


@pytest.mark.parametrize("name", NAMES)
def test_packed_logits_equal_the_unpacked_ones(name):
    model = models(name, peers=())["jitattn"]
    padded, packed = training_batches(seed=4)
    with torch.no_grad():
        rows = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        flat = model(**{k: v for k, v in packed[True].items() if k != "labels"}).logits[0]
    unpacked = rows[padded["attention_mask"].bool()]
    assert unpacked.shape == flat.shape
    assert rel(flat, unpacked) < 1e-2, f"{name}: packed {rel(flat, unpacked):.2e} away from unpacked"



def test_the_soft_cap_reaches_the_kernels():
    """The soft-capped model's logits are its float32 eager twin's, and far from the uncapped
    model's with the same weights: the cap is computed, not dropped."""
    capped, plain = models("gemma2-softcap", peers=()), models("gemma2", peers=())
    ids, mask = prompts(seed=5)
    valid = mask.bool()
    with torch.no_grad():
        ours = capped["jitattn"](ids, attention_mask=mask).logits[valid]
        want = capped["fp32"](ids, attention_mask=mask).logits[valid]
        uncapped = plain["jitattn"](ids, attention_mask=mask).logits[valid]
    err, moved = rel(ours, want), rel(uncapped, want)
    print(f"\ngemma2 soft cap {SOFT_CAP}: jitattn {err:.2e} from float32 eager; the uncapped model {moved:.2e}")
    assert moved > 10 * err, f"soft cap: capped {err:.2e} vs uncapped {moved:.2e} from float32"


@pytest.mark.parametrize("padding", ["on_device", "async_read"])
def test_no_layer_of_the_padded_path_syncs_on_the_gpu(padding):
    """The padded path (left padding, and a mask with gaps) and the dense path under
    torch.cuda.set_sync_debug_mode("error"), each mask a new tensor, so the first layer of the
    forward pass (which derives the plan) is checked too. What is warmed outside the check: the
    kernels' build and the first use of the mask_mod's trace. "async_read" padding: its later
    layers, once the read arrived, run without the mask_mod where the mask has no gaps (the
    pass after a synchronize: surely so), with the same result to rounding."""
    if DEVICE != "cuda":
        pytest.skip("the sync debug mode needs CUDA")

    class Attn(torch.nn.Module):
        is_causal = True

    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(8, 16, 1, 128, dtype=BF16, device="cuda", generator=g)
    k, v = (torch.randn(8, 4, 320, 128, dtype=BF16, device="cuda", generator=g) for _ in range(2))

    def left_padded():
        mask = torch.ones(8, 320, dtype=torch.long, device="cuda")
        for i in range(8):
            mask[i, :18 * i] = 0
        return mask

    def with_gaps():
        mask = left_padded()
        mask[1:, 200:210] = 0
        return mask

    same = torch.equal if padding == "on_device" else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-2))
    with torch.no_grad(), jt.use_backend(jt.jitattn_backend(padding)):
        warm = [jt.attention_forward(Attn(), q, k, v, make())[0] for make in (left_padded, with_gaps)]
        jt.attention_forward(Attn(), q, k, v, None)  # the dense path's starts made once, outside the check
        masks = [left_padded(), with_gaps()]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            later = [jt.attention_forward(Attn(), q, k, v, mask)[0] for mask in masks for _ in range(3)]
            dense = [jt.attention_forward(Attn(), q, k, v, None)[0] for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()  # "async_read": the reads arrived
        torch.cuda.set_sync_debug_mode("error")
        try:
            settled = [jt.attention_forward(Attn(), q, k, v, mask)[0] for mask in masks]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert all(same(warm[0], out) for out in later[:3]) and all(same(warm[1], out) for out in later[3:])
    assert same(warm[0], settled[0]) and same(warm[1], settled[1])
    assert all(torch.equal(dense[0], out) for out in dense[1:])
    assert not torch.equal(warm[0], warm[1])  # the gaps were masked


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("len_q", [40, 1])
def test_every_padding_mask_is_as_close_to_float64_sdpa_as_bfloat16_allows(kind, len_q):
    """Random masks of each kind (gaps included), the prompt and a decode step, GQA or not, causal
    or not, with and without a sliding window, through the kernels (bf16) against float64 sdpa on
    the same inputs: the query rows from each row's first valid query to its last (a decode step
    and an encoder's prompt: every row), and zeros before and after."""
    class Attn(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    batch, len_k, head_dim = 4, 40, 64
    for heads_kv in (2, 8):
        for causal in (True, False):
            for window in (None, 9):
                q = torch.randn(batch, 8, len_q, head_dim, generator=g)
                k, v = (torch.randn(batch, heads_kv, len_k, head_dim, generator=g) for _ in range(2))
                q, k, v = (t.to(BF16) for t in (q, k, v))
                mask = random_mask(kind, batch, len_k, g)
                with torch.no_grad():
                    out, _ = jt.attention_forward(Attn(), *(t.to(DEVICE) for t in (q, k, v)), mask.long().to(DEVICE),
                                                  is_causal=causal, sliding_window=window)
                out = out.cpu()
                want = sdpa_float64(q, k, v, mask=mask, causal=causal, window=window)
                valid_q = mask[:, -len_q:]
                cols = torch.arange(len_q)
                first = torch.where(valid_q, cols, len_q).amin(-1, keepdim=True)
                last = torch.where(valid_q, cols, -1).amax(-1, keepdim=True)
                # a decode step and an encoder's prompt (not causal, no window) are a sequence per
                # row: every query row attends as sdpa's
                whole_rows = len_q == 1 or (not causal and window is None)
                inside = torch.ones_like(valid_q) if whole_rows else (cols >= first) & (cols <= last)
                said = f"{kind}, L_q {len_q}, {heads_kv} kv heads, causal {causal}, window {window}"
                close(out[inside], want[inside], *TOL[BF16], said)  # the kernels' bf16 tolerances
                assert (out[~inside] == 0).all(), said


def test_a_padded_training_step_with_gaps_matches_float64():
    """With grad (keys packed, the mask_mod through the kernels' backward): the gradients of a
    batch with gaps inside its rows and a sliding window against float64 sdpa."""
    class Attn(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q = torch.randn(3, 8, 48, 64, generator=g).to(BF16)
    k, v = (torch.randn(3, 2, 48, 64, generator=g).to(BF16) for _ in range(2))
    mask = random_mask("gaps", 3, 48, g)
    leaves = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out, _ = jt.attention_forward(Attn(), *leaves, mask.long().to(DEVICE), sliding_window=16)
    weights = torch.randn(out.shape, generator=g) * mask[:, :, None, None]
    grads = torch.autograd.grad((out.float() * weights.to(DEVICE)).sum(), leaves)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((sdpa_float64(*exact, mask=mask, window=16) * weights.double()).sum(), exact)
    for name, got, ref in zip("qkv", grads, want):
        assert rel(got.cpu(), ref) <= 2e-2, f"d{name}: {rel(got.cpu(), ref):.3e} from float64"
