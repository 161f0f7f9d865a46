"""Triton kernels by family: `common` (shared math), `stage0` (baseline), `step_terms`,
`chunk_state` and `chunk_output` (production, launched through `launcher`); and the integer
helpers of their launchers."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. triton.cdiv is a constexpr function, whose host calls cost a few
    microseconds each; the production launchers run on every call of the operator."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (x >= 1), on the host (see cdiv)."""
    return 1 << (x - 1).bit_length()
