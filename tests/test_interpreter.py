"""The numerics the CPU tests rely on: bf16 stores round to nearest even, as on the GPU
(conftest patches Triton 3.6's interpreter, which truncates)."""
import torch
import triton
import triton.language as tl

from conftest import DEVICE


@triton.jit
def _store_bf16(x, y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n), mask=i < n)


def test_bf16_stores_round_to_nearest_even():
    """fp32 values stored into bf16 equal torch's round-to-nearest-even conversion, including
    ties (both directions), values that carry into the exponent, infinities and NaN."""
    g = torch.Generator().manual_seed(3)
    scale = 10.0 ** torch.randint(-6, 6, (900,), generator=g)
    x = torch.cat([torch.randn(900, generator=g) * scale,
                   torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 - 2 ** -9 + 2 ** -24, 255.99,
                                 -(1 + 2 ** -8), float("inf"), -float("inf"), 0.0, -0.0])])
    x = torch.cat([x, torch.full((1,), float("nan"))]).to(DEVICE)
    y = torch.full_like(x, 7.0, dtype=torch.bfloat16)
    _store_bf16[(1,)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16)
    assert torch.equal(y[:-1], want[:-1]), (
        f"{(y[:-1] != want[:-1]).sum().item()} of {x.numel() - 1} values rounded differently")
    assert torch.isnan(y[-1])
