"""Triton kernels by family: `common` (shared math), `stage0` (baseline), `chunk_state` and
`chunk_output` (production)."""
