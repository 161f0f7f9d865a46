"""The production Triton kernels by family, each module a kernel and its typed launch wrapper:
`step_terms` (per-step terms and rotary tables), `chunk_state` (the state pass), `chunk_output`
(outputs and partial sums), `preprocess` (the whole operator's angles and decay pieces),
`chunk_grads` (phase 2 of the backward: the gradients of raw_y);
`common` holds the shared @triton.jit math. Here: the host-side
integer helpers of their wrappers."""


def dependent_launch(consts) -> dict:
    """The launch option of a kernel that starts with `after_previous_kernel`: launched as
    a programmatic dependent launch where consts.PDL says the device has it (sm_90 and newer)."""
    return {"launch_pdl": True} if consts.PDL else {}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. triton.cdiv is a constexpr function, whose host calls cost a few
    microseconds each; the production launchers run on every call of the operator."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (x >= 1), on the host (see cdiv)."""
    return 1 << (x - 1).bit_length()


def aligned_numel(numel: int) -> int:
    """numel rounded up to whole 256 bytes of fp32. Views of one scratch allocation start at such
    offsets, so that each is as aligned as a separate allocation whatever B and S: an alignment
    that changed with the length would make Triton compile another kernel. One allocation
    instead of several saves host time per call."""
    return cdiv(numel, 64) * 64


def input_align(cap: int, *tensors) -> int:
    """The largest power of two <= cap that divides every stride but the innermost of each
    tensor (0 counts as divisible).

    The production launchers pass the batch (and head) strides of the inputs divided by it, and
    the kernels multiply them back by it as a constexpr: these strides change with the sequence
    length, so they are not specialised, and without this the compiler cannot know that a
    (b, h) slice starts aligned, and loads 16-bit inputs two bytes at a time. The per-step and
    inner strides count too, so that for contiguous inputs the result follows from the model
    dimensions alone (a batch stride is S times a step stride): a new length never changes it,
    and never recompiles."""
    strides = [s for t in tensors for s in t.stride()[:-1]]
    a = cap
    while a > 1 and any(s % a for s in strides):
        a //= 2
    return a
