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


def batch_align(cap: int, *strides: int) -> int:
    """The largest power of two <= cap that divides every stride (0 counts as divisible).

    The production launchers pass the batch (and head) strides of the inputs divided by it, and
    the kernels multiply them back by it as a constexpr: these strides change with the sequence
    length, so they are not specialised, and without this the compiler cannot know that a
    (b, h) slice starts aligned, and loads 16-bit inputs two bytes at a time."""
    a = cap
    while a > 1 and any(s % a for s in strides):
        a //= 2
    return a
