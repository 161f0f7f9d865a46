"""Triton kernels by family: `common` (shared math), `stage0` (baseline), `step_terms`,
`chunk_state` and `chunk_output` (production)."""
