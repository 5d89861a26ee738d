"""The GGUF block kernels (kernels/gguf_blocks.c) against their torch references (kernels/gguf_blocks.py), and the
references against the `gguf` package: blocks made by gguf's own quantizer (random blocks for the K-quants, which it
cannot make), shapes that are awkward for the kernels (one output row, output counts that do not divide the
threads' split, 1 to 9 activation rows, not a multiple of the 4 rows a pass takes, rows of blocks that are not
whole groups of 8), zero blocks, extreme values; the kernels built for AVX2 alone too (without VNNI, and AVX-512
without GFNI); the prompt kernel (8 weight rows a tile: tails of tiles and of activation rows); a decode step's
layer in one call (its rows quantized in the call, its outputs written in the model's dtype where the layer's order
puts them); and the float types' rows used where they lie."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from indexpool.kernels import gguf_blocks

TYPES = {name: GGMLQuantizationType[name].value
         for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                      "Q6_K")}
QUANTIZED = [name for name, qtype in TYPES.items() if qtype not in gguf_blocks.FLOAT_TYPES]
# where a K-quant block keeps its fp16 d (and dmin): gguf's quantizer does not make these, so the tests write random
# blocks with plausible scales there
K_QUANTS = {"Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
needs_kernel = pytest.mark.skipif(not gguf_blocks.kernel_runs(),
                                  reason=f"the GGUF block kernels do not run here: {gguf_blocks.path()}")


def blocks_of(weight: np.ndarray, name: str) -> torch.Tensor:
    """The weight quantized by the gguf package, as the rows of bytes a GGUF file holds; for the K-quants, random
    blocks of its shape (every level, scale and min bit pattern; fp16 scales of 1e-3..1, signs mixed)."""
    n, k = weight.shape
    if name in K_QUANTS:
        rng = np.random.default_rng(n * 7919 + k)
        size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
        raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
        scales = (rng.uniform(1e-3, 1, size=(n, k // 256, 2)) * rng.choice([-1, 1], size=(n, k // 256, 2)))
        d, dmin = K_QUANTS[name]
        raw[..., d : d + 2] = scales[..., :1].astype(np.float16).view(np.uint8)
        if dmin is not None:
            raw[..., dmin : dmin + 2] = np.abs(scales[..., 1:]).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1))
    rows = np.ascontiguousarray(quantize(weight, GGMLQuantizationType[name]))
    return torch.from_numpy(rows.view(np.uint8).reshape(n, -1))


def weight(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3, size=(n, 1)).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros
    if n > 1:
        w[1, 32:64] = 1e4 if k > 32 else w[1, 32:64]  # one large block
    return w


def width(name: str, k: int) -> int:
    """An input width of a test in whole blocks of the type (K-quants: 256 weights for each 32 of the others)."""
    return k * 8 if name in K_QUANTS else k


def gguf_dequantized(blocks: torch.Tensor, name: str) -> torch.Tensor:
    values = dequantize(blocks.numpy(), GGMLQuantizationType[name])
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(blocks.shape[0], -1)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k", [(1, 32), (3, 96), (67, 160), (130, 64)])
def test_the_reference_dequantizes_as_the_gguf_package_does(name, n, k):
    k = width(name, k)
    blocks = blocks_of(weight(n, k, seed=n + k), name)
    ours, theirs = gguf_blocks.dequantize_reference(blocks, TYPES[name]), gguf_dequantized(blocks, name)
    assert ours.shape == (n, k)
    if name not in QUANTIZED:  # the values themselves, widened
        assert torch.equal(ours, theirs)
        return
    # ours rounds scale * u + offset once; gguf rounds scale * u, then adds the offset: half an ulp of the product
    # apart at most
    levels, scale, _ = gguf_blocks.levels_reference(blocks, TYPES[name])
    product = (levels.double() * scale.double()).abs().reshape(n, k)
    assert ((ours.double() - theirs.double()).abs() <= 2.0 ** -24 * (product + theirs.double().abs())).all()


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_linear_reference_stays_within_the_activations_rounding(name):
    k = width(name, 128)
    blocks = blocks_of(weight(40, k, seed=3), name)
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


def assert_linear_matches(name: str, n: int, k: int, rows: int, library=None, prompt: bool = False) -> None:
    """The decode kernel (`prompt`: the prompt kernel) against the reference."""
    blocks = blocks_of(weight(n, k, seed=n * k), name)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n + k)) * 2
    want = gguf_blocks.linear_reference(x, blocks, TYPES[name]).double()
    got = (gguf_blocks.prompt_linear(x, blocks, TYPES[name], k, library=library) if prompt
           else gguf_blocks.linear(x, blocks, TYPES[name], library=library)).double()
    # the same integer sums (the float types: the same products); the fp32 scaling and summation orders differ: a
    # few ulps of the sum of |terms|
    scale = (x.double().abs() @ gguf_blocks.dequantize_reference(blocks, TYPES[name]).double().abs().T)
    assert ((got - want).abs() <= scale * 2e-6 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n, k, rows", [(1, 32, 1), (3, 64, 2), (67, 160, 3), (130, 96, 4), (257, 256, 5),
                                        (5, 352, 6), (9, 2048, 9)])
def test_the_kernel_matches_its_reference(name, n, k, rows):
    assert_linear_matches(name, n, width(name, k), rows)


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_the_kernel_dequantizes_as_its_reference(name):
    k = width(name, 352)
    blocks = blocks_of(weight(131, k, seed=5), name)
    want = gguf_blocks.dequantize_reference(blocks, TYPES[name])
    got = gguf_blocks.dequantize(blocks, TYPES[name], k)
    assert torch.equal(got, want)
    part = gguf_blocks.dequantize(blocks[7:20], TYPES[name], k)  # a slice of the rows
    assert torch.equal(part, got[7:20])
    # bf16 straight from the kernel: the fp32 weights rounded as torch rounds them
    assert torch.equal(gguf_blocks.dequantize(blocks, TYPES[name], k, dtype=torch.bfloat16), want.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("flags", [("-march=haswell", "-DMAX_ROWS=2"), ("-march=native", "-mno-gfni", "-DMAX_ROWS=1")],
                         ids=["avx2", "no-gfni"])
def test_the_other_builds_of_the_kernels_match_the_reference(flags):
    """The code this CPU does not take: AVX2 without VNNI (pairs of 256-bit registers, Q8_0's levels through
    maddubs, the 4- and 5-bit pairs' own unpacking), and AVX-512 with shifts where GFNI's bit matrices would be.
    Built with at most 2 activation rows a pass (a quarter to a third of the compile time of 4; the AVX2 build takes
    2, as its pairs of nibble blocks loop over the rows in code of their own: 3 rows are a pass of 2 and one of 1)."""
    library, origin = gguf_blocks.native_library(("-O3", *flags, "-fPIC", "-shared"))
    assert "self-test" not in origin, origin  # built on a CPU that runs it (needs_kernel), but wrong
    if library is None:
        pytest.skip(f"not built here: {origin}")
    for name in TYPES:
        if name not in ("F32", "BF16"):  # those are torch's and cpu_linear's
            assert_linear_matches(name, 67, width(name, 352), 3, library)
            if name in LEVEL_BYTES:
                largest_sums(name, width(name, 64), library)
            if TYPES[name] in gguf_blocks.PROMPT_TYPES:  # the prompt kernel's maddubs sums, 4 rows, a tail
                assert_linear_matches(name, 67, width(name, 352), 7, library, prompt=True)
                largest_sums(name, width(name, 64), library, prompt=True)
            k = width(name, 352)
            blocks = blocks_of(weight(5, k, seed=2), name)
            assert torch.equal(gguf_blocks.dequantize(blocks, TYPES[name], k, library=library),
                               gguf_blocks.dequantize_reference(blocks, TYPES[name]))


PROMPT_NAMES = [name for name, qtype in TYPES.items() if qtype in gguf_blocks.PROMPT_TYPES]


def mixed_layer(runs: tuple[tuple[int, str], ...]):
    """A fused layer of the given (rows, type) parts of 256 inputs and a dense part of 16 rows, its 144 outputs
    reordered: (in_features, parts, order, layer)."""
    from indexpool.model.gguf_weights import BlockLinear, WeightPart

    k = width("Q4_K", 32)
    parts = [WeightPart(k, blocks_of(weight(n, k, seed=n), name), TYPES[name]) for n, name in runs]
    parts.append(WeightPart(k, dense=torch.randn(16, k, generator=torch.Generator().manual_seed(4))))
    order = torch.randperm(144, generator=torch.Generator().manual_seed(5))
    return k, parts, order, BlockLinear(parts, k, order=order)


@needs_kernel
@pytest.mark.parametrize("name", PROMPT_NAMES)
@pytest.mark.parametrize("n, k, rows", [(1, 32, 9), (7, 64, 1), (13, 96, 5), (67, 160, 13), (130, 32, 4),
                                        (9, 2048, 18)])
def test_the_prompt_kernel_matches_its_reference(name, n, k, rows):
    """8 weight rows a tile (1, 7, 9, 13 rows: a tile's tail), 4 activation rows a pass (1, 5, 13, 18: a tail),
    an odd number of blocks a row (96, 160); every quantized format (Q6_K's 16-bit sums widened every 2 steps,
    the others' every 4, Q8_0's signed levels every step without VNNI), a scale per 16 or 32 weights."""
    assert_linear_matches(name, n, width(name, k), rows, prompt=True)


# the bytes of a block that hold its levels (the rest: scales, mins)
LEVEL_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q8_0": (2, 34),
               "Q2_K": (16, 80), "Q3_K": (0, 96), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


def largest_sums(name: str, k: int, library=None, prompt: bool = False) -> None:
    """Every level at its largest (all bits set; Q8_0's -128) against activations whose levels are all 127: the
    integer sums as large as they get, where 16-bit partial sums added too far would wrap."""
    blocks = blocks_of(weight(9, k, seed=3), name).reshape(9, -1, GGML_QUANT_SIZES[GGMLQuantizationType[name]][1])
    first, end = LEVEL_BYTES[name]
    blocks[..., first:end] = 255 if name != "Q8_0" else 128  # the byte of int8 -128
    blocks = blocks.reshape(9, -1)
    x = torch.ones(5, k)
    want = gguf_blocks.linear_reference(x, blocks, TYPES[name]).double()
    got = (gguf_blocks.prompt_linear(x, blocks, TYPES[name], k, library=library) if prompt
           else gguf_blocks.linear(x, blocks, TYPES[name], library=library)).double()
    scale = x.double().abs() @ gguf_blocks.dequantize_reference(blocks, TYPES[name]).double().abs().T
    assert ((got - want).abs() <= scale * 2e-6 + 1e-6).all(), name


@needs_kernel
@pytest.mark.parametrize("name", QUANTIZED)
def test_the_largest_integer_sums_do_not_wrap(name):
    largest_sums(name, width(name, 64))
    largest_sums(name, width(name, 64), prompt=True)


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_1", "Q5_K"])
def test_the_prompt_kernel_writes_its_columns_in_the_rows_dtype(name):
    """Into a column slice of a wider output, or into the columns given (bf16 rounded as torch rounds), its
    activations quantized once for several matrices; the same as its own fp32 output."""
    k = width(name, 64)
    blocks = blocks_of(weight(45, k, seed=8), name)
    x = torch.randn(10, k, generator=torch.Generator().manual_seed(3))
    activations = gguf_blocks.quantize_activations(x)
    want = gguf_blocks.prompt_linear(x, blocks, TYPES[name], k)
    wide = torch.zeros(10, 60)
    gguf_blocks.prompt_linear(None, blocks, TYPES[name], k, activations, out=wide[:, 5:50])
    assert torch.equal(wide[:, 5:50], want) and not wide[:, :5].any() and not wide[:, 50:].any()
    columns = torch.randperm(60, generator=torch.Generator().manual_seed(4))[:45]
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.zeros(10, 60, dtype=dtype)
        gguf_blocks.prompt_linear(None, blocks, TYPES[name], k, activations, out=out, columns=columns)
        assert torch.equal(out[:, columns], want.to(dtype))
        assert not out[:, [c for c in range(60) if c not in columns.tolist()]].any()
    with pytest.raises(ValueError):  # a format it does not take
        gguf_blocks.prompt_linear(x, blocks_of(weight(8, k, seed=8), "F16"), TYPES["F16"], k)


@needs_kernel
def test_a_prompt_through_a_layer_takes_the_prompt_kernel_where_it_applies():
    """fp32 prompts: a fused, reordered layer of Q4_K, F16, Q6_K and dense parts computes its Q4_K and Q6_K parts
    by the prompt kernel (its activations quantized once) and the others as before, and a gate/up pair's
    silu(gate) * up takes it for both; bf16 prompts keep the dequantized GEMMs."""
    from indexpool.model.gguf_weights import BlockLinear, WeightPart

    k, parts, order, layer = mixed_layer(((64, "Q4_K"), (40, "F16"), (24, "Q6_K")))
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(6))
    want = torch.cat([gguf_blocks.prompt_linear(x, parts[0].blocks, TYPES["Q4_K"], k),
                      gguf_blocks.matmul_dequantized(x, parts[1].blocks, TYPES["F16"], k),
                      gguf_blocks.prompt_linear(x, parts[2].blocks, TYPES["Q6_K"], k), x @ parts[3].dense.T], dim=-1)
    assert torch.equal(layer(x), want.index_select(-1, order))
    xb = x.to(torch.bfloat16)
    assert torch.equal(layer(xb)[:, order.argsort()[:64]],
                       gguf_blocks.matmul_dequantized(xb, parts[0].blocks, TYPES["Q4_K"], k))
    gate, up = (WeightPart(k, blocks_of(weight(72, k, seed=s), name), TYPES[name])
                for s, name in ((1, "Q4_K"), (2, "Q6_K")))
    gated = BlockLinear([gate, up], k).silu_gated(x)
    assert torch.equal(gated, torch.nn.functional.silu(gguf_blocks.prompt_linear(x, gate.blocks, TYPES["Q4_K"], k))
                       * gguf_blocks.prompt_linear(x, up.blocks, TYPES["Q6_K"], k))


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_a_fused_layer_split_between_threads_is_its_parts_side_by_side(name):
    """Parts of several sizes in one call: the threads' shares cross the parts' boundaries."""
    k = 2048
    parts = [blocks_of(weight(n, k, seed=n), name) for n in (700, 9, 555)]
    x = torch.randn(2, k)
    activations = None if name in ("F16", "BF16") else gguf_blocks.quantize_activations(x)
    got = gguf_blocks.linear(x, gguf_blocks.Matrices(parts, TYPES[name], k), TYPES[name], activations)
    want = torch.cat([gguf_blocks.linear(x, part, TYPES[name]) for part in parts], dim=-1)
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_the_kernel_quantizes_fp32_and_bf16_rows_itself(name):
    """x given as fp32 or bf16 rows (a decode step's), quantized in the call: the same as x quantized first."""
    k = width(name, 352)
    blocks = blocks_of(weight(70, k, seed=6), name)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    for rows in (x, x.to(torch.bfloat16)):
        want = gguf_blocks.linear(x, blocks, TYPES[name], gguf_blocks.quantize_activations(rows.float()))
        assert torch.equal(gguf_blocks.linear(rows, blocks, TYPES[name]), want)


@needs_kernel
@pytest.mark.parametrize("name", ["Q5_1", "Q3_K", "F16", "BF16"])
def test_outputs_go_to_their_columns_in_the_rows_dtype(name):
    """`out` in bf16 (rounded as torch rounds) or fp32, output n in column columns[n] of a wider row."""
    k = width(name, 64)
    blocks = blocks_of(weight(50, k, seed=7), name)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    want = gguf_blocks.linear(x, blocks, TYPES[name])
    columns = torch.randperm(60, generator=torch.Generator().manual_seed(3))[:50]
    matrices = gguf_blocks.Matrices([blocks], TYPES[name], k, columns, 60)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.zeros(2, 60, dtype=dtype)
        assert gguf_blocks.linear(x, matrices, TYPES[name], out=out) is out
        assert torch.equal(out[:, columns], want.to(dtype))
        assert not out[:, [c for c in range(60) if c not in columns.tolist()]].any()  # the others untouched


@needs_kernel
def test_a_decode_step_of_a_mixed_reordered_layer_is_its_parts_reordered():
    """A fused layer of several types (a Q4_K_M file's Q, K in Q4_K and V in Q6_K) and a dense part, its outputs
    reordered (llama's Q and K rows): the decode path writes each run's outputs in place, in the model's dtype; the
    same as the runs' products put side by side, reordered and rounded."""
    k, parts, order, layer = mixed_layer(((64, "Q4_K"), (32, "Q4_K"), (32, "Q6_K")))
    for dtype in (torch.float32, torch.bfloat16):  # the model's dtype: the rows', the outputs'
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).to(dtype)
        products = [gguf_blocks.linear(x, [p.blocks for p in parts[:2]], TYPES["Q4_K"]),
                    gguf_blocks.linear(x, parts[2].blocks, TYPES["Q6_K"]), (x @ parts[3].dense.to(dtype).T).float()]
        want = torch.cat(products, dim=-1).index_select(-1, order).to(dtype)
        assert torch.equal(layer(x), want)


@needs_kernel
@pytest.mark.parametrize("name, dtype", [("Q4_0", torch.float32), ("Q4_K", torch.bfloat16)])
def test_many_rows_multiply_the_dequantized_weights_exactly(name, dtype):
    """Slices of the weights dequantized in the activations' dtype (into a buffer kept between calls) and
    multiplied by torch: the product of the reference's weights, slice for slice."""
    k = width(name, 128)
    blocks = blocks_of(weight(300, k, seed=9), name)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    w = gguf_blocks.dequantize_reference(blocks, TYPES[name]).to(dtype)
    want = torch.cat([x @ w[first : first + 64].T for first in range(0, 300, 64)], dim=-1)
    for _ in range(2):  # the second time into the buffer the first one made
        got = gguf_blocks.matmul_dequantized(x, blocks, TYPES[name], k, chunk_bytes=64 * k * 4)  # 5 slices
        assert torch.equal(got, want)


@pytest.mark.parametrize("name, dtype", [("F32", torch.float32), ("BF16", torch.bfloat16), ("F16", torch.float32)])
def test_float_rows_are_used_where_they_lie(tmp_path, name, dtype):
    """F32, F16 and BF16 tensors of a memory-mapped file: the layer's weights are the map's rows (no copy) for a
    decode step and a prompt alike, and its embedding picks its tokens' rows there."""
    from indexpool.model.gguf_weights import BlockEmbedding, BlockLinear, WeightPart, file_blocks, weight_formats

    n, k = 48, 96
    rows = blocks_of(weight(n, k, seed=4), name)
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(16) + rows.numpy().tobytes())
    data = np.memmap(path, dtype=np.uint8, mode="c")
    part = WeightPart(k, file_blocks(data, 16, rows.numel(), n), TYPES[name])
    layer, embedding = BlockLinear([part], k), BlockEmbedding(part, k, dtype)
    start = data.ctypes.data
    assert start <= gguf_blocks.float_view(part.blocks, TYPES[name]).data_ptr() < start + data.size
    assert weight_formats(layer) == {name: n * rows.shape[1]}  # the file's bytes, nothing else
    w = gguf_blocks.dequantize_reference(rows, TYPES[name]).double()
    generator = torch.Generator().manual_seed(0)
    for length in (1, 20):  # a decode step, a prompt
        x = torch.randn(length, k, generator=generator).to(dtype)
        exact = x.double() @ w.T
        # fp32 sums in some order: a few ulps of the sum of |terms|; then bf16 outputs round once more
        bound = (x.double().abs() @ w.abs().T) * 2e-6 + (exact.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0)
        assert ((layer(x).double() - exact).abs() <= bound).all()
    assert torch.equal(embedding(torch.tensor([[3, 0, 47]])), w[[3, 0, 47]].to(dtype)[None])


def test_shapes_the_kernels_cannot_take_are_refused():
    blocks = blocks_of(weight(2, 64, seed=1), "Q8_0")
    with pytest.raises(ValueError):
        gguf_blocks.linear(torch.randn(1, 60), blocks, TYPES["Q8_0"])  # not whole blocks
    with pytest.raises(ValueError):
        gguf_blocks.linear(torch.randn(1, 64), blocks, TYPES["Q4_0"])  # rows of another type's size
    with pytest.raises(ValueError):  # a column past the rows' end: refused before any kernel writes there
        gguf_blocks.Matrices([blocks], TYPES["Q8_0"], 64, torch.tensor([0, 5]), 5)
    with pytest.raises(ValueError):  # rows of the wrong width to write into
        gguf_blocks.linear(torch.randn(1, 64), blocks, TYPES["Q8_0"], out=torch.empty(1, 3))
