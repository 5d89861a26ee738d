"""The GGUF block kernels (kernels/gguf_blocks.c) against their torch references (kernels/gguf_blocks.py), and the
references against the `gguf` package: blocks made by gguf's own quantizer, shapes that are awkward for the
kernels (one output row, output counts that do not divide the threads' split, 1 to 9 activation rows, not a
multiple of the 4 rows a pass takes), zero blocks, extreme values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from indexpool.kernels import gguf_blocks

TYPES = {name: GGMLQuantizationType[name].value for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")}
K_QUANTS = ("Q4_K", "Q6_K")  # gguf's quantizer does not make these: random blocks with plausible scales
needs_kernel = pytest.mark.skipif(not gguf_blocks.kernel_runs(),
                                  reason=f"the GGUF block kernels do not run here: {gguf_blocks.path()}")


def blocks_of(weight: np.ndarray, name: str) -> torch.Tensor:
    """The weight quantized by the gguf package, as the rows of uint8 blocks a GGUF file holds; for the K-quants,
    random blocks of its shape (every level, scale and min bit pattern; fp16 scales of 1e-3..1, signs mixed)."""
    if name in K_QUANTS:
        rng = np.random.default_rng(weight.shape[0] * 7919 + weight.shape[1])
        n, k = weight.shape
        size = {"Q4_K": 144, "Q6_K": 210}[name]
        raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
        scales = (rng.uniform(1e-3, 1, size=(n, k // 256, 2)) * rng.choice([-1, 1], size=(n, k // 256, 2)))
        at = 0 if name == "Q4_K" else 208  # d (and Q4_K's dmin after it)
        raw[..., at : at + 2] = scales[..., :1].astype(np.float16).view(np.uint8)
        if name == "Q4_K":
            raw[..., 2:4] = np.abs(scales[..., 1:]).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1))
    return torch.from_numpy(np.ascontiguousarray(quantize(weight, GGMLQuantizationType[name])))


def weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3, size=(n, 1)).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros
    if n > 1:
        w[1, 32:64] = 1e4 if k > 32 else w[1, 32:64]  # one large block
    return w


def widths(name: str, widths: list[int]) -> list[int]:
    """The input widths of a test, in whole blocks of the type (256 for the K-quants)."""
    return [w * 8 if name in K_QUANTS else w for w in widths]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k", [(1, 32), (3, 96), (67, 160), (130, 64)])
def test_the_reference_dequantizes_as_the_gguf_package_does(name, n, k):
    k = widths(name, [k])[0]
    w = weight(n, k, seed=n + k)
    blocks = blocks_of(w, name)
    ours = gguf_blocks.dequantize_reference(blocks, TYPES[name])
    theirs = torch.from_numpy(np.asarray(dequantize(blocks.numpy(), GGMLQuantizationType[name]), dtype=np.float32))
    # ours rounds d * u + m once; gguf rounds d * u, then adds m: half an ulp of d * u apart at most
    levels, scale, _ = gguf_blocks.levels_reference(blocks, TYPES[name])
    product = (levels.double() * scale.double()).abs().reshape(n, k)
    assert ((ours.double() - theirs.double()).abs() <= 2.0 ** -24 * (product + theirs.double().abs())).all()


@pytest.mark.parametrize("name", TYPES)
def test_the_linear_reference_stays_within_the_activations_rounding(name):
    (k,) = widths(name, [128])
    w = weight(40, k, seed=3)
    blocks = blocks_of(w, name)
    x = torch.randn(5, k) * torch.linspace(0.1, 10, k)
    exact = x.double() @ gguf_blocks.dequantize_reference(blocks, TYPES[name]).double().T
    got = gguf_blocks.linear_reference(x, blocks, TYPES[name])
    bound = gguf_blocks.activation_error_bound(x, blocks, TYPES[name])
    assert ((got.double() - exact).abs() <= bound.double() * (1 + 1e-5) + 1e-3).all()
    assert (got.double() - exact).abs().max() > 0  # the activations were rounded: the bound is not vacuous


def test_activation_blocks_match_the_reference():
    if not gguf_blocks.kernel_runs():
        pytest.skip(f"the GGUF block kernels do not run here: {gguf_blocks.path()}")
    x = torch.randn(7, 96) * 3
    x[0, :32] = 0.0  # a zero block: scale 0, levels 0
    x[1, 5] = 2.5 * (x[1, :32].abs().max() / 127 * 2)  # a value near a tie is rounded the same way
    for got, want in zip(gguf_blocks.quantize_activations(x), gguf_blocks.quantize_activations_reference(x)):
        assert torch.equal(got.reshape(want.shape), want) if got.dtype == torch.int8 else \
            torch.allclose(got.reshape(want.shape), want, rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, rows", [(1, 32, 1), (3, 64, 2), (67, 160, 3), (130, 96, 4), (257, 256, 5),
                                        (9, 2048, 9)])
def test_the_kernel_matches_its_reference(name, n, k, rows):
    (k,) = widths(name, [k])
    blocks = blocks_of(weight(n, k, seed=n * k), name)
    x = torch.randn(rows, k) * 2
    want = gguf_blocks.linear_reference(x, blocks, TYPES[name]).double()
    got = gguf_blocks.linear(x, blocks, TYPES[name]).double()
    # the same integer sums; the fp32 scaling and summation orders differ: a few ulps of the sum of |terms|
    scale = (x.double().abs() @ gguf_blocks.dequantize_reference(blocks, TYPES[name]).double().abs().T)
    assert ((got - want).abs() <= scale * 2e-6 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_the_kernel_dequantizes_as_its_reference(name):
    (k,) = widths(name, [96])
    blocks = blocks_of(weight(131, k, seed=5), name)
    got = gguf_blocks.dequantize(blocks, TYPES[name], k)
    assert torch.equal(got, gguf_blocks.dequantize_reference(blocks, TYPES[name]))
    part = gguf_blocks.dequantize(blocks[7:20], TYPES[name], k)  # a slice of the rows
    assert torch.equal(part, got[7:20])


@needs_kernel
def test_many_rows_multiply_the_dequantized_weights_exactly():
    blocks = blocks_of(weight(300, 128, seed=9), "Q4_0")
    x = torch.randn(33, 128)
    got = gguf_blocks.matmul_dequantized(x, blocks, TYPES["Q4_0"], 128, chunk_bytes=64 * 128 * 4)  # 5 slices
    assert torch.allclose(got, x @ gguf_blocks.dequantize_reference(blocks, TYPES["Q4_0"]).T, rtol=1e-5, atol=1e-5)


def test_shapes_the_kernels_cannot_take_are_refused():
    blocks = blocks_of(weight(2, 64, seed=1), "Q8_0")
    with pytest.raises(ValueError):
        gguf_blocks.linear(torch.randn(1, 60), blocks, TYPES["Q8_0"])  # not whole blocks
    with pytest.raises(ValueError):
        gguf_blocks.linear(torch.randn(1, 64), blocks, TYPES["Q4_0"])  # rows of another type's size
