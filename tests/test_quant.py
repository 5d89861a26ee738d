"""The quantized decode copies of linear layers (model/quant.py) against plain matmuls."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from indexpool.model.quant import DecodeQuantLinear, quantize_for_decode


def linear_with(weight: torch.Tensor, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.normal_()
    return layer


def test_int4_reproduces_q4_1_blocks():
    """Q4_1 blocks (32 weights, 16 levels, a scale and a minimum) fit the int4 kernel's groups of 32 exactly; only
    the bf16 rounding of scale and zero (relative 2^-9) separates the two."""
    w = torch.randn(96, 160)
    q41 = torch.from_numpy(np.array(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1),
                                                           gguf.GGMLQuantizationType.Q4_1))).reshape(w.shape)
    layer = linear_with(q41)
    x = torch.randn(3, 160).to(torch.bfloat16)
    expected = x.float() @ layer.weight.float().t()
    got = DecodeQuantLinear(layer, bits=4)(x).float()
    # Per output: error <= sum_k |x_k| * (bf16 error of the dequantized weight, <= 2^-8 |w|) plus bf16 output rounding.
    bound = (x.float().abs() @ layer.weight.float().abs().t()) * 2**-7 + expected.abs() * 2**-8
    assert (got - expected).abs().le(bound).all()


def test_int8_error_is_within_three_quarters_of_a_step():
    w = torch.randn(64, 96)
    layer = linear_with(w, bias=True)
    x = torch.randn(2, 96).to(torch.bfloat16)
    expected = x.float() @ layer.weight.float().t() + layer.bias.float()
    got = DecodeQuantLinear(layer, bits=8)(x).float()
    # Per weight: half a step of int8 rounding, plus the bf16 rounding of the row's scale (2^-9 relative, times at
    # most 127 steps: a quarter step). Then the bf16 output and bias add round at 2^-8 relative each.
    step = layer.weight.float().abs().amax(dim=1) / 127
    bound = x.float().abs().sum(dim=1, keepdim=True) * step * 0.75 + (expected.abs() + layer.bias.float().abs()) * 2**-8
    assert (got - expected).abs().le(bound).all()


def test_many_rows_use_the_bf16_weights():
    layer = linear_with(torch.randn(32, 64))
    x = torch.randn(1, DecodeQuantLinear.max_rows + 1, 64).to(torch.bfloat16)
    assert torch.equal(DecodeQuantLinear(layer, bits=4)(x), layer(x))


def test_quantize_for_decode_keeps_named_layers_at_int8_and_odd_widths_at_int8():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48), nn.Linear(48, 8)).to(torch.bfloat16)
    quantize_for_decode(model, 4, keep_int8=("2",))
    assert [m.bits for m in model] == [4, 4, 8]
    odd = nn.Sequential(nn.Linear(40, 8)).to(torch.bfloat16)  # 40 is not a multiple of the int4 group
    assert quantize_for_decode(odd, 4)[0].bits == 8
    with pytest.raises(ValueError, match="bf16 or fp32"):  # fp32: tests/test_cpu_linear.py
        quantize_for_decode(nn.Sequential(nn.Linear(64, 8)).half(), 4)
