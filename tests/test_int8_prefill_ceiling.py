"""The measuring kernel of benchmarks/int8_prefill_ceiling.py (int8 activations against Q4_1 weights) computes the
product it claims: its timings back what docs/benchmarks.md says int8 activations could give the prefill."""

import importlib.util
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "int8_prefill_ceiling.py"
spec = importlib.util.spec_from_file_location("int8_prefill_ceiling", PATH)
ceiling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling)


@pytest.fixture(scope="module")
def lib():
    built, origin = ceiling.library()
    if built is None:
        if "self-test" in origin:  # built, then wrong: a failure, not a missing compiler
            pytest.fail(origin)
        pytest.skip(f"the measuring kernel needs a C compiler and AVX2 + FMA: {origin}")
    return built


@pytest.mark.parametrize("rows,k,n", [(1, 32, 16), (7, 96, 48), (13, 1536, 32), (64, 576, 160)])
def test_the_int8_kernel_computes_the_quantized_product(lib, rows, k, n):
    torch.manual_seed(rows)
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k) * torch.rand(rows, k // 32, 1).repeat_interleave(32, 1).flatten(1).mul(4)
    if rows > 1:
        x[-1, :32] = 0  # a block of zeros: scale 0, no division by it
    levels, scale, low = ceiling.q4_1(weight)
    y = ceiling.int8_linear(lib, x, ceiling.pack_tiles(levels, scale, low), n).double()
    quantized, exact = ceiling.quantized_reference(x, levels, scale, low)
    top = exact.abs().max()
    # fp32 sums of exact integer dot products, one rounding per block: far below one int8 level of any block
    assert (y - quantized).abs().max() <= 2e-6 * top
    # and the quantization itself is what it costs, not nothing (the reference did quantize)
    assert 1e-4 * top < (quantized - exact).abs().max() < 2e-2 * top
