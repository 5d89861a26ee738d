"""Weight-only quantized linear layers with fp32 activations in C (kernels/cpu_linear.py): the C kernels against
their torch reference on awkward shapes, the layouts against the weights they stand for, DecodeQuantLinear on an
fp32 model against F.linear, the runtime giving an fp32 model the copies (and keeping them through the prepared
weights cache), and the fallback where the library cannot be built."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from kernel_setting import use_kernels
import torch
import torch.nn.functional as F
from torch import nn

from indexpool.kernels import cpu_linear, native_build
from indexpool.model.quant import DecodeQuantLinear, decode_weights_path, quantize_for_decode

U = 2.0**-24  # fp32 unit roundoff


def needs_kernel():
    library, origin = cpu_linear.native_library()
    if library is None:
        pytest.skip(f"the C linear kernels do not build here: {origin}")


def sum_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far two fp32 evaluations of x @ w.T (same fp32 inputs, any summation order, with or without fma) can be
    apart: each is within gamma_K * sum_k |x_k w_k| of the exact value (gamma_K = K u / (1 - K u), any summation
    tree having at most K - 1 additions on a path), so together 2 gamma_K; bounded here by (2K + 1) u."""
    k = x.shape[-1]
    return (2 * k + 1) * U * (x.double().abs() @ w.double().abs().t())


# (N, K): N off every multiple of 8 (and 1); K one block, one pair, a pair and a half (the padded last pair), the
# default model's 576 and 1536.
SHAPES = [(1, 32), (13, 64), (5, 96), (77, 576), (203, 1536)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_matches_the_reference(n, k, bias):
    """rows 1..8 (one pass over the weights each) and 11 (a pass of 8 and one of 3). The two differ only in
    summation order (the reference dequantizes as the kernel does, and q * scale + min is computed with one
    rounding in both where q * scale is exact; elsewhere one more rounding of each weight, u |w|), then the bias
    add: one rounding each."""
    needs_kernel()
    generator = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=generator)
    qweight = cpu_linear.pack_int4(w)
    dequantized = cpu_linear.unpack_int4(qweight, k)
    b = torch.randn(n, generator=generator) if bias else None
    for rows in (*range(1, 9), 11):
        x = torch.randn(rows, k, generator=generator)
        got = cpu_linear.linear_int4(x, qweight, b)
        expected = cpu_linear.linear_int4_reference(x, qweight, b)
        bound = sum_bound(x, dequantized) + 2 * U * (x.double().abs() @ dequantized.double().abs().t())
        if b is not None:
            bound += 2 * U * (expected.double().abs() + b.double().abs())
        assert got.shape == (rows, n)
        assert ((got.double() - expected.double()).abs() <= bound).all(), (rows, (got - expected).abs().max())


@pytest.mark.parametrize("n,k", [*SHAPES, (9, 37), (3, 8), (2, 5)])  # int8 also takes any K: 37 and 5 (scalar tails)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_the_reference(n, k, bias):
    """Summation order again, plus the row scale's product (one rounding each) and the bias add."""
    needs_kernel()
    generator = torch.Generator().manual_seed(n * 1000 + k + 1)
    w = torch.randn(n, k, generator=generator)
    qweight, scales = cpu_linear.pack_int8(w)
    b = torch.randn(n, generator=generator) if bias else None
    for rows in (*range(1, 9), 11):
        x = torch.randn(rows, k, generator=generator)
        got = cpu_linear.linear_int8(x, qweight, scales, b)
        expected = cpu_linear.linear_int8_reference(x, qweight, scales, b)
        plain = x.double().abs() @ qweight.double().abs().t()
        bound = ((2 * k + 1) * U * plain + 2 * U * plain) * scales.double()
        if b is not None:
            bound += 2 * U * (expected.double().abs() + b.double().abs())
        assert ((got.double() - expected.double()).abs() <= bound).all(), (rows, (got - expected).abs().max())


@pytest.mark.parametrize("n,k", [(1, 32), (33, 105), (9, 37), (3, 8), (2, 5), (70, 96)])
def test_bf16_kernel_matches_the_reference(n, k):
    """bf16 weights (IndexPool's pooled keys: 105 wide, rows of a larger store, so a stride past K), rows 1..12 (one
    pass) and 13 and 25 (passes of 12 and a tail), with torch's threads (the outputs split between threads when the
    weights are big enough: 70 x 96 is not, a large case below is). The widening is exact: summation order only."""
    needs_kernel()
    generator = torch.Generator().manual_seed(n * 1000 + k + 2)
    store = torch.randn(n + 2, k + 11, generator=generator).bfloat16()
    w = store[1 : n + 1, 3 : k + 3]  # rows k + 11 apart
    for rows in (*range(1, 13), 13, 25):
        x = torch.randn(rows, k, generator=generator)
        got = cpu_linear.linear_bf16(x, w)
        assert got.shape == (rows, n)
        assert ((got.double() - cpu_linear.linear_bf16_reference(x, w).double()).abs() <= sum_bound(x, w.float())).all()
    wide = torch.randn(4096, 300, generator=generator).bfloat16()  # 1.2M weights: two threads where torch has two
    x = torch.randn(9, 300, generator=generator)
    assert ((cpu_linear.linear_bf16(x, wide).double() - cpu_linear.linear_bf16_reference(x, wide).double()).abs()
            <= sum_bound(x, wide.float())).all()
    with pytest.raises(ValueError, match="not bf16 weights"):
        cpu_linear.linear_bf16(x, wide.float())


def test_kernel_takes_strided_rows_and_batched_shapes():
    """x (2, 3, K) from a wider tensor (rows 2K apart): the kernel reads each row at its stride."""
    needs_kernel()
    w = torch.randn(24, 64)
    qweight = cpu_linear.pack_int4(w)
    x = torch.randn(2, 3, 128)[..., :64]
    got = cpu_linear.linear_int4(x, qweight)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, cpu_linear.linear_int4_reference(x, qweight), rtol=0, atol=1e-4)


def test_int4_layout_reproduces_q4_1_blocks():
    """Q4_1 blocks (32 weights, 16 levels from the block's minimum, fp16 scale and min) are int4 groups exactly:
    the fp32 scale and min of the packed copy hold the fp16 values, and the levels come back the same."""
    w = torch.randn(7, 160)
    q41 = torch.from_numpy(np.array(gguf.quants.dequantize(
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1))).reshape(w.shape)
    unpacked = cpu_linear.unpack_int4(cpu_linear.pack_int4(q41), 160)
    # Each weight: its level times the recomputed scale, which is within a few ulps of the fp16 scale.
    assert (unpacked - q41).abs().max() <= 1e-5 * q41.abs().max()


def test_int4_error_is_within_half_a_step():
    w = torch.randn(11, 96) * torch.linspace(0.1, 3, 96)
    unpacked = cpu_linear.unpack_int4(cpu_linear.pack_int4(w), 96)
    groups = w.view(11, 3, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    # Half a level, plus the fp32 roundings of (w - min) / scale (a level may round the wrong way by 2^-19 of a step)
    # and of q * scale + min (u |w|, with |w| <= the group's largest magnitude).
    assert ((unpacked - w).abs() <= step * (0.5 + 2**-18) + 4 * U * w.abs().max()).all()


# ------------------------------------------------------------------------------------------------ DecodeQuantLinear

def fp32_linear(n: int, k: int, bias: bool) -> nn.Linear:
    torch.manual_seed(n + k)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_fp32_is_f_linear_within_the_quantization_error(bits, bias):
    """Per output: sum_k |x_k| * (the weight's quantization error: half a step, int4 a group's (max - min) / 15,
    int8 the row's max |w| / 127, plus its fp32 roundings), plus the summation bound and the bias add."""
    needs_kernel()
    layer = fp32_linear(77, 576, bias)
    quantized = DecodeQuantLinear(layer, bits)
    assert quantized.native and quantized.bits == bits
    x = torch.randn(1, 5, 576)
    got = quantized(x)
    expected = layer(x)
    w = layer.weight.detach()
    if bits == 4:
        groups = w.view(77, 18, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, dim=1)
    else:
        step = (w.abs().amax(dim=1) / 127)[:, None].expand_as(w)
    weight_error = step * (0.5 + 2**-18) + 4 * U * w.abs()
    bound = (x.double().abs() @ weight_error.double().t() + sum_bound(x, w.abs() + weight_error)
             + 4 * U * (expected.double().abs() + (layer.bias.double().abs() if bias else 0)))
    assert ((got.double() - expected.double()).abs() <= bound).all()
    # and far tighter than that bound in practice, yet not equal (the copy is what runs)
    assert not torch.equal(got, expected)


def test_more_rows_than_max_rows_use_the_fp32_weights():
    needs_kernel()
    layer = fp32_linear(40, 64, True)
    quantized = DecodeQuantLinear(layer, 4)
    x = torch.randn(1, DecodeQuantLinear.fp32_max_rows + 1, 64)
    assert torch.equal(quantized(x), F.linear(x, layer.weight, layer.bias))
    few = x[:, :DecodeQuantLinear.fp32_max_rows]
    assert torch.equal(quantized(few), cpu_linear.linear_int4(few, quantized.qweight, layer.bias))


def test_kernels_switched_off_use_the_fp32_weights(monkeypatch):
    needs_kernel()
    layer = fp32_linear(40, 64, False)
    quantized = DecodeQuantLinear(layer, 8)
    use_kernels(monkeypatch, "torch")
    x = torch.randn(2, 64)
    assert torch.equal(quantized(x), F.linear(x, layer.weight))
    assert decode_weights_path(nn.Sequential(quantized)) == "fp32 weights (INDEXPOOL_KERNELS=torch)"


def test_compute_false_shapes_the_same_buffers():
    """The prepared-weights cache fills copies made with compute=False: same names, shapes and dtypes."""
    needs_kernel()
    for bits in (4, 8):
        layer = fp32_linear(24, 96, True)
        made = dict(DecodeQuantLinear(layer, bits).named_buffers())
        shaped = dict(DecodeQuantLinear(layer, bits, compute=False).named_buffers())
        assert {k: (t.shape, t.dtype) for k, t in made.items()} == {k: (t.shape, t.dtype) for k, t in shaped.items()}


def test_quantize_for_decode_takes_fp32_where_the_kernel_builds(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(40, 8))
    if cpu_linear.native_library()[0] is not None:
        quantize_for_decode(model, 4)
        assert [(m.native, m.bits) for m in model] == [(True, 4), (True, 8)]  # 40: not a multiple of the group
    monkeypatch.setattr(cpu_linear, "native_library", lambda: (None, "fp32 weights (the C kernel did not build: x)"))
    with pytest.raises(ValueError, match="fp32 model need the C kernels.*did not build"):
        quantize_for_decode(nn.Sequential(nn.Linear(64, 8)), 4)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        quantize_for_decode(nn.Sequential(nn.Linear(64, 8)).half(), 4)


# ------------------------------------------------------------------------------------------------ building

@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty cache directory and no built kernel; the real one is found again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_linear.native_library.cache_clear()
    yield tmp_path
    cpu_linear.native_library.cache_clear()


def test_without_a_compiler_fp32_weights_run(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    library, origin = cpu_linear.native_library()
    assert library is None and origin.startswith("fp32 weights (the C kernel did not build:")
    assert not cpu_linear.kernel_runs() and cpu_linear.linear_path() == origin
    kernels_dir = fresh_build / "indexpool" / "kernels"
    assert [p.suffix for p in kernels_dir.iterdir()] == [".failed"]
    cpu_linear.native_library.cache_clear()  # a later run does not try again
    monkeypatch.setattr(native_build, "_build", lambda *args: pytest.fail("rebuilt after a failed build"))
    assert cpu_linear.native_library() == (None, origin)


def test_build_lands_in_the_cache_directory(fresh_build):
    library, origin = cpu_linear.native_library()
    if library is None:
        pytest.skip(f"the C linear kernels do not build here: {origin}")
    built = list((fresh_build / "indexpool" / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_linear-") and str(built[0]) in origin


# ------------------------------------------------------------------------------------------------ the runtime

def test_fp32_engine_gets_the_copies_and_keeps_them_through_the_prepared_weights_cache():
    """The default model (Q4_1) in fp32: int4 copies of every layer's linears and the output layer at int8, the
    same buffers whether computed or read back from the prepared-weights cache (compute=False)."""
    needs_kernel()
    from indexpool.model.runtime import load_engine

    first = load_engine(None, "fp32")  # computed, or read back if an earlier run saved it
    second = load_engine(None, "fp32")  # read back
    layers = [m for m in first.model.modules() if isinstance(m, DecodeQuantLinear)]
    assert len(layers) == 4 * first.config.n_layers + 1 and all(m.native for m in layers)
    assert sorted(m.bits for m in layers) == [4] * (4 * first.config.n_layers) + [8]
    assert "C kernel" in decode_weights_path(first.model)
    a, b = dict(first.model.named_buffers()), dict(second.model.named_buffers())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    off = load_engine(None, "fp32", decode_weights="off")
    assert not any(isinstance(m, DecodeQuantLinear) for m in off.model.modules())
