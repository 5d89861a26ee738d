"""A llama-family model's weights kept as the GGUF file stores them: the quantized blocks stay in the memory-mapped
file and the layers compute on them (`kernels.gguf_blocks`), instead of a dequantized copy of the whole model.

`BlockLinear` stands in for an nn.Linear whose output rows are one or more tensors of the file one after another
(the engine fuses Q, K and V, and gate and up): each part is either the file's rows as they lie (blocks of Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, or plain F32, F16 and BF16 values: `gguf_blocks.TYPES`) or, for the file's
other types, a dense weight dequantized at load. llama.cpp's converter stores the rows of Q and K permuted for its
interleaved rotary embedding; the rows cannot be reordered in place, so the layer reorders its outputs instead
(`order`). `BlockEmbedding` dequantizes the rows of the tokens it is given.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from indexpool.kernels import gguf_blocks

# Up to this many rows a layer quantizes its activations and computes on the blocks (a decode step, a few
# branches); more rows (prefill) multiply slices of dequantized weights in the model's dtype, or in fp32 take the
# prompt kernel's int8 products where the format allows (`gguf_blocks.int8_prompts`).
BLOCK_ROWS = 8


class WeightPart:
    """Output rows of a BlockLinear: the file's rows (uint8 (N, row_bytes) of ggml type `qtype`) or a dense
    weight."""

    def __init__(self, in_features: int, blocks: torch.Tensor | None = None, qtype: int | None = None,
                 dense: torch.Tensor | None = None):
        self.in_features, self.blocks, self.qtype, self.dense = in_features, blocks, qtype, dense
        self.rows = dense.shape[0] if dense is not None else blocks.shape[0]

    @property
    def bytes(self) -> int:
        t = self.dense if self.dense is not None else self.blocks
        return t.numel() * t.element_size()

    @property
    def format(self) -> str:
        return gguf_blocks.TYPES[self.qtype][0] if self.dense is None else str(self.dense.dtype).removeprefix("torch.")


class BlockLinear(nn.Module):
    """y = x @ W.T (+ bias) with W the parts' rows in order (then reordered by `order`, where given)."""

    def __init__(self, parts: list[WeightPart], in_features: int, bias: torch.Tensor | None = None,
                 order: torch.Tensor | None = None):
        super().__init__()
        self.parts = parts
        runs: list[list[WeightPart]] = []  # consecutive parts of the same type (dense: alone)
        for part in parts:
            if runs and part.dense is None and runs[-1][0].dense is None and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        # each run of the file's rows as the kernel takes it, made once (a decode step calls it per layer), and the
        # columns its outputs land in after the reordering (a decode step writes them there)
        self.in_features = in_features
        self.out_features = sum(part.rows for part in parts)
        where = torch.argsort(order) if order is not None else torch.arange(self.out_features)
        self.groups, first = [], 0
        for run in runs:
            rows = sum(part.rows for part in run)
            columns = None if order is None and len(runs) == 1 else where[first : first + rows].contiguous()
            matrices = None if run[0].dense is not None else \
                gguf_blocks.Matrices([part.blocks for part in run], run[0].qtype, in_features, columns,
                                     self.out_features)
            self.groups.append((run, matrices, columns))
            first += rows
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.where = None if order is None else where  # the output column of each of the parts' rows
        # [gate, up] of equal rows, on blocks, as they lie: a prompt's segment can take `silu_gated`
        self.gated_pair = len(parts) == 2 and parts[0].rows == parts[1].rows and bias is None and order is None \
            and all(part.dense is None for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self._few_rows(flat):
            y = self._decode(flat)
        else:
            # each part's product written into its columns of one output, reordered as it is written (products
            # joined by torch.cat, then reordered, would hold a prompt's activations three times)
            y = torch.empty(flat.shape[0], self.out_features, dtype=flat.dtype)
            first, activations = 0, None
            for part in self.parts:
                # the part's own columns, or all of y and the columns its rows go to
                out, columns = (y[:, first : first + part.rows], None) if self.where is None else \
                    (y, self.where[first : first + part.rows])
                if part.dense is not None:
                    gguf_blocks.write_columns(out, 0, F.linear(flat, part.dense.to(flat.dtype)), columns)
                elif gguf_blocks.int8_prompts(part.qtype, flat.dtype):
                    activations = activations or gguf_blocks.quantize_activations(flat.contiguous())
                    gguf_blocks.prompt_linear(flat, part.blocks, part.qtype, self.in_features, activations, out=out,
                                              columns=columns)
                else:
                    gguf_blocks.matmul_dequantized(flat, part.blocks, part.qtype, self.in_features, out=out,
                                                   columns=columns)
                first += part.rows
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x @ gate.T) * (x @ up.T) for a layer of two parts [gate, up] and many rows (a prompt's segment),
        the up part's product multiplied in a slice at a time: (..., rows) with no (R, 2 * rows) output. None where
        that does not apply (few rows, other parts, bias or reordering): the caller goes the general way."""
        flat = x.reshape(-1, self.in_features)
        if not self.gated_pair or self._few_rows(flat):
            return None
        gate, up = self.parts
        if gguf_blocks.int8_prompts(gate.qtype, flat.dtype) and gguf_blocks.int8_prompts(up.qtype, flat.dtype):
            activations = gguf_blocks.quantize_activations(flat.contiguous())
            h = gguf_blocks.prompt_linear(flat, gate.blocks, gate.qtype, self.in_features, activations)
            products = gguf_blocks.prompt_products(activations, up.blocks, up.qtype, self.in_features)
        else:
            h = gguf_blocks.matmul_dequantized(flat, gate.blocks, gate.qtype, self.in_features)
            products = gguf_blocks.dequantized_products(flat, up.blocks, up.qtype, self.in_features)
        F.silu(h, inplace=True)
        for first, product in products:
            h[:, first : first + product.shape[1]] *= product
        return h.reshape(*x.shape[:-1], gate.rows)

    @staticmethod
    def _few_rows(flat: torch.Tensor) -> bool:
        """Rows few enough for the int8-activation kernels (a decode step, a few branches)."""
        return flat.shape[0] <= BLOCK_ROWS and gguf_blocks.kernel_runs()

    def _decode(self, flat: torch.Tensor) -> torch.Tensor:
        """A few rows on the file's rows: each run's kernel quantizes the rows and writes its outputs, in the
        model's dtype, into their columns (the reordering done by where they go)."""
        y = torch.empty(flat.shape[0], self.out_features, dtype=flat.dtype)
        into = y if y.dtype in (torch.float32, torch.bfloat16) else torch.empty_like(y, dtype=torch.float32)
        for run, matrices, columns in self.groups:
            if matrices is None:
                product = F.linear(flat, run[0].dense.to(flat.dtype)).to(into.dtype)
                if columns is None:
                    into.copy_(product)
                else:
                    into.index_copy_(1, columns, product)
            else:
                gguf_blocks.linear(flat, matrices, matrices.qtype, out=into)
        return into if into is y else y.copy_(into)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"parts={'+'.join(part.format for part in self.parts)}"


class BlockEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks (or dense): a token's row is dequantized when it is looked up."""

    def __init__(self, part: WeightPart, dim: int, dtype: torch.dtype):
        super().__init__()
        self.part, self.dim, self.dtype = part, dim, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1)
        if self.part.dense is not None:
            rows = self.part.dense.index_select(0, ids)
        elif self.part.qtype in gguf_blocks.FLOAT_TYPES:
            rows = gguf_blocks.float_view(self.part.blocks, self.part.qtype).index_select(0, ids)
        else:
            picked = self.part.blocks.index_select(0, ids)
            rows = (gguf_blocks.dequantize(picked, self.part.qtype, self.dim) if gguf_blocks.kernel_runs()
                    else gguf_blocks.dequantize_reference(picked, self.part.qtype))
        return rows.to(self.dtype).reshape(*tokens.shape, self.dim)


def file_blocks(data: np.memmap, offset: int, n_bytes: int, rows: int) -> torch.Tensor:
    """A tensor's bytes in the memory-mapped file as uint8 (rows, bytes per row), shared with the map."""
    return torch.from_numpy(data[offset : offset + n_bytes]).view(rows, n_bytes // rows)


def block_parts(model: nn.Module) -> list[WeightPart]:
    """The weight parts of a model's block layers, each once (a tied embedding and output share theirs)."""
    parts: dict[int, WeightPart] = {}
    for module in model.modules():
        for part in [module.part] if isinstance(module, BlockEmbedding) else \
                module.parts if isinstance(module, BlockLinear) else []:
            parts.setdefault(id(part), part)
    return list(parts.values())


def weight_count(model: nn.Module) -> int:
    """A model's weights: its parameters, and those its block layers keep as the file stores them."""
    parameters = {id(p): p for p in model.parameters()}.values()
    return sum(part.rows * part.in_features for part in block_parts(model)) + sum(p.numel() for p in parameters)


def weight_formats(model: nn.Module) -> dict[str, int]:
    """Bytes the model's weights take in memory, by format: the file's block types (memory-mapped), dense dtypes,
    and the quantized decode copies (`model.quant`)."""
    from .quant import DecodeQuantLinear

    sizes: dict[str, int] = {}

    def add(name: str, tensor: torch.Tensor) -> None:
        sizes[name] = sizes.get(name, 0) + tensor.numel() * tensor.element_size()

    for part in block_parts(model):
        sizes[part.format] = sizes.get(part.format, 0) + part.bytes
    for parameter in {id(p): p for p in model.parameters()}.values():
        add(str(parameter.dtype).removeprefix("torch."), parameter)
    for module in model.modules():
        if isinstance(module, DecodeQuantLinear):
            for buffer in module.buffers(recurse=False):
                add(f"int{module.bits} decode copies", buffer)
    return sizes
