"""The phases of the Mamba-3 MIMO operator, each a public entry over its kernels: `operator`
(the whole operator and its autograd Function), `bwd_fwd` (phase 1 of the backward alone),
`packed` (the layout of packed sequences), `step` (the decode step) and `context_parallel` (one
sequence across the ranks of a process group)."""
