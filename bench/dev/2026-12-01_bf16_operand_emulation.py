"""CPU emulation of bf16 dot operands (rounded with .to(bfloat16)) in the chunked forward, against the float64 golden. Usage: python this.py N P R C [S] [seed]; session 6, optimisation.md step 16."""
import torch, math, sys
from mamba3_mimo.inputs import Shape, make_inputs
from mamba3_mimo import reference as ref
from mamba3_mimo.reference import _prepare
torch.manual_seed(0)

def rb(x, on):  # round an operand to bf16
    return x.to(torch.bfloat16).to(x.dtype) if on else x

def fwd(inp, flags, dtype):
    q,k,v = inp["q"],inp["k"],inp["v"]
    B,S,R,G,N = q.shape; H,P = v.shape[2],v.shape[3]; C = inp["chunk_size"]; nc = math.ceil(S/C)
    qb,kb,qr,kr,psi_v,gamma,ts = _prepare(q,k,v,inp["q_bias"],inp["k_bias"],inp["mimo_v"],inp["angles"],inp["dt"],inp["trap"],dtype)
    da_cs, da_cs_rev, segsum = inp["da_cs"].to(dtype), inp["da_cs_rev"].to(dtype), inp["segsum"].to(dtype)
    state = torch.zeros(B,H,N,P,dtype=dtype); raw=[]; sts=[]
    for c in range(nc):
        lo,hi=c*C,c*C+C
        sts.append(state)
        qc,kc,pc = qr[:,lo:hi],kr[:,lo:hi],psi_v[:,lo:hi]
        inter = torch.einsum("blrhn,bhnp->blrhp", rb(qc,flags['q']), rb(state,flags['st']))
        inter = inter*da_cs[:,:,lo:hi].exp().transpose(1,2)[:,:,None,:,None]
        scores = torch.einsum("blrhn,bmuhn->bhlrmu", rb(qc,flags['q']), rb(kc,flags['q']))
        L=C; tri=torch.ones(L,L,dtype=torch.bool).tril(-1)
        decay=torch.where(tri,segsum[:,:,c].exp(),torch.zeros((),dtype=dtype))*ts[:,:,None,lo:hi]+torch.diag_embed(gamma[:,:,lo:hi])
        sw = rb(scores*decay[:,:,:,None,:,None], flags['sw'])
        intra = torch.einsum("bhlrmu,bmuhp->blrhp", sw, rb(pc,flags['pv']))
        y = inter+intra + inp["d"].to(dtype)[None,None,None,:,None]*pc
        raw.append(y)
        w = ts[:,:,lo:hi]*da_cs_rev[:,:,lo:hi].exp()
        kw = kc*w.transpose(1,2)[:,:,None,:,None]
        inc = torch.einsum("blrhn,blrhp->bhnp", rb(kw,flags['inc']), rb(pc,flags['inc']))
        state = state*da_cs[:,:,hi-1].exp()[...,None,None]+inc
    return torch.cat(raw,1).permute(0,1,3,2,4), torch.stack(sts,2)

def outs(inp, raw, dtype):
    B=raw.shape[0]
    with torch.enable_grad():
        phi = inp["mimo_o"].to(dtype).expand(B,*inp["mimo_o"].shape).clone().requires_grad_(True)
        zeta = inp["mimo_z"].to(dtype).expand(B,*inp["mimo_z"].shape).clone().requires_grad_(True)
        zt = inp["z"].to(dtype).clone().requires_grad_(True)
        o = ref.reduce_out(raw, phi, zeta, zt); o.backward(inp["dout"].to(dtype))
    return phi.grad, zeta.grad, zt.grad

def rr(x,r): return ((x.double()-r).norm()/r.norm()).item()
N,P,R,C = [int(a) for a in sys.argv[1:5]]
S_ = int(sys.argv[5]) if len(sys.argv)>5 else 512; sh = Shape(1, S_, 2, 1, N, P, R, C)
inp = make_inputs(sh, torch.bfloat16, True, True, seed=int(sys.argv[6]) if len(sys.argv)>6 else 1) if 'seed' in make_inputs.__code__.co_varnames else make_inputs(sh, torch.bfloat16, True, True)
inp = dict(inp); inp.setdefault("chunk_size", C)
g_raw, g_st = fwd(inp, dict(q=0,st=0,sw=0,pv=0,inc=0), torch.float64)
G = outs(inp, g_raw, torch.float64)
for name, fl in [("fp32", dict(q=0,st=0,sw=0,pv=0,inc=0)),
                 ("q,k bf16", dict(q=1,st=0,sw=0,pv=0,inc=0)),
                 ("q,k,st bf16", dict(q=1,st=1,sw=0,pv=0,inc=0)),
                 ("q,k,st,sw,pv bf16", dict(q=1,st=1,sw=1,pv=1,inc=0)),
                 ("all bf16 (+inc)", dict(q=1,st=1,sw=1,pv=1,inc=1))]:
    raw, st = fwd(inp, fl, torch.float32)
    o = outs(inp, raw, torch.float32)
    dzb = o[2].to(torch.bfloat16)
    stb = st.to(torch.bfloat16)
    print(f"{name:20s} states(bf16 out) {rr(stb,g_st):.2e} dmimo_o {rr(o[0],G[0]):.2e} dmimo_z {rr(o[1],G[1]):.2e} dz(bf16) {rr(dzb,G[2]):.2e}")
# qk_dot: bf16-rounded rotated operands, bf16 output
qb,kb,qr,kr,*_ = _prepare(inp["q"],inp["k"],inp["v"],inp["q_bias"],inp["k_bias"],inp["mimo_v"],inp["angles"],inp["dt"],inp["trap"],torch.float32)
gq = torch.einsum("bsrhn,bsuhn->bhsru", *[x.double() for x in _prepare(inp["q"],inp["k"],inp["v"],inp["q_bias"],inp["k_bias"],inp["mimo_v"],inp["angles"],inp["dt"],inp["trap"],torch.float64)[:2]])
qk = torch.einsum("bsrhn,bsuhn->bhsru", rb(qr,1), rb(kr,1)).to(torch.bfloat16).double()
print(f"qk_dot bf16 ops: rms {rr(qk,gq):.2e} max {((qk-gq).abs().max()/gq.abs().max()).item():.2e}")
