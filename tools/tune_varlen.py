"""Tile-shape sweep for the varlen kernels: a tuning aid, not a benchmark of record.

On a GPU machine with the JIT enabled: `python tools/tune_varlen.py build` compiles every
variant below in parallel, then `python tools/tune_varlen.py` times each on the bench shapes
(`--defaults` with both: only the current default shapes, to A/B a kernel change; `--wgmma`:
only the wgmma rung's prefill tiles)
(TFLOP/s for prefill, TB/s for paged decode) beside torch's varlen_attn. The winners become
VarlenSpec.default_tile.
"""
import json, subprocess, sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
import contextlib, dataclasses
import jitattn
from jitattn.varlen.plan import override_spec
from jitattn.varlen.spec import VarlenSpec
from torch.nn.attention import varlen as tv

# Prefill tiles (warps_m, m_tiles, block_n, stages), the mma.sync rung then the wgmma one (W).
PREFILL = {64: [(4,2,64,2),(4,2,64,3),(8,1,64,2),(4,2,32,2),(4,2,128,2)],
           128: [(4,2,64,2),(4,2,32,2),(4,2,32,3),(8,1,64,2),(4,1,64,2),(8,2,64,2)],
           256: [(8,1,64,2),(8,1,32,2),(8,1,32,3),(4,1,32,2),(4,1,64,2)]}
W = "wgmma"
PREFILL[64] += [(8,1,64,3,W),(8,1,128,3,W),(8,1,64,4,W)]  # lockstep loop: 3+ stages
PREFILL[128] += [(8,1,128,3,W),(8,1,128,2,W),(8,1,64,3,W),(8,1,64,4,W),(8,1,96,3,W)]  # producer warpgroup
PREFILL[256] += [(8,1,80,2,W),(8,1,64,2,W),(8,1,48,3,W),(8,1,32,3,W)]
DECODE = [(1,1,64,3),(1,1,64,2),(1,1,64,4)]
if "--defaults" in sys.argv:  # only the tuned default shapes (quick A/B of a kernel change)
    sys.argv.remove("--defaults")
    PREFILL = {d: [VarlenSpec.default_tile(d, False), (*VarlenSpec.default_tile(d, False, True), W)] for d in PREFILL}
    DECODE = [VarlenSpec.default_tile(128, True)]
if "--wgmma" in sys.argv:  # only the wgmma rung's prefill tiles
    sys.argv.remove("--wgmma")
    PREFILL = {d: [t for t in ts if t[4:] == (W,)] for d, ts in PREFILL.items()}
    DECODE = []

def prefill_spec(d, tile):
    return VarlenSpec(d, "bfloat16", False, False, *tile[:4], wgmma=tile[4:] == (W,))
specs = [prefill_spec(d, t) for d, ts in PREFILL.items() for t in ts]
specs += [VarlenSpec(128, "bfloat16", True, True, *t) for t in DECODE]
if sys.argv[1:] == ["build"]:
    cmd = [sys.executable, "-m", "jitattn", "prewarm", "-j", str(__import__("os").cpu_count()), "--arch", "9.0"]
    for s in specs: cmd += ["--spec", json.dumps(s.to_dict())]
    subprocess.run(cmd, check=True); sys.exit()

def bench(fn, n=15):
    for _ in range(3): fn()
    torch.cuda.synchronize(); es=[]
    for _ in range(n):
        a=torch.cuda.Event(True); b=torch.cuda.Event(True); a.record(); fn(); b.record(); torch.cuda.synchronize(); es.append(a.elapsed_time(b))
    es.sort(); return es[len(es)//2]
_using = contextlib.ExitStack()
def use(spec):  # the kernel varlen_attn runs for this shape, whichever rung it would pick (the public override)
    global _using
    _using.close(); _using = contextlib.ExitStack()
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
              if f.name not in ("head_dim", "dtype", "paged", "soft_cap")}
    _using.enter_context(override_spec("varlen", when={"head_dim": spec.head_dim, "paged": spec.paged}, **fields))
for d, ts in PREFILL.items():
    h=2048//d; B=8; L=4096
    cq = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device="cuda")
    q = torch.randn(B*L, h, d, device="cuda", dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q)
    for causal in (True, False):
        w = (-1,0) if causal else (-1,-1)
        flops = 4*L*L*d*h*B/(2 if causal else 1)
        t = bench(lambda: tv.varlen_attn(q,k,v,cq,cq,L,L,window_size=w))
        line = [f"d{d} causal={int(causal)} torch {flops/t/1e9:.0f}"]
        for tile in ts:
            use(prefill_spec(d, tile))
            t = bench(lambda: jitattn.varlen_attn(q,k,v,cq,cq,L,L,window_size=w))
            line.append(f"{tile}:{flops/t/1e9:.0f}")
        print(" | ".join(line), flush=True)
if not DECODE: sys.exit()
B=64; L=4096; ps=16; hq,hkv,d=32,8,128
tot=B*L//ps
pk=torch.randn(tot, ps, hkv, d, device="cuda", dtype=torch.bfloat16); pv=torch.randn_like(pk)
table=torch.randperm(tot, device="cuda").to(torch.int32).view(B, L//ps)
used=torch.full((B,),L,dtype=torch.int32,device="cuda"); cq=torch.arange(B+1,dtype=torch.int32,device="cuda")
q=torch.randn(B,hq,d,device="cuda",dtype=torch.bfloat16)
line=["paged decode TB/s"]
for tile in DECODE:
    use(VarlenSpec(128, "bfloat16", True, True, *tile))
    for ns in (None, 2, 3):
        t=bench(lambda: jitattn.varlen_attn(q,pk,pv,cq,None,1,L,enable_gqa=True,seqused_k=used,block_table=table, num_splits=ns))
        line.append(f"{tile} s{ns}:{2*pk.numel()*2/t/1e9:.2f}")
print(" | ".join(line))
