"""The phases of the Mamba-3 MIMO operator, each a public entry over its kernels: `bwd_fwd`
(phase 1 of the backward)."""
