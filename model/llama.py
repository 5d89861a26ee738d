"""The llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) as one readable file.

RMSNorm, rotary position embedding (the rotate-half layout), grouped-query attention over a preallocated KV cache,
SwiGLU MLP. Q/K/V and gate/up projections are fused into one matmul each: fewer Python calls per token.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from indexpool.kernels import cpu_decode, torch_forced
from indexpool.kernels.cpu_attention import decode_attention, native_attention_takes, prompt_attention
from indexpool.kernels.rope import apply_rope

from .gguf_weights import BlockLinear
from .quant import DecodeQuantLinear


@dataclass
class LlamaConfig:
    arch: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    ffn_dim: int = 11008
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    context_length: int = 4096  # the context the model was trained for
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k before RoPE
    # Per-frequency divisors for long-context RoPE (Llama 3.1's "llama3" scaling); None means plain RoPE.
    rope_freq_factors: list[float] | None = field(default=None, repr=False)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of every layer for one token."""
        return 2 * self.n_layers * self.kv_dim * torch.finfo(dtype).bits // 8


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """A zero tensor for a cache's large buffers; on a CPU in a private anonymous mapping of its own: pages never
    written take no memory, and freeing it gives the memory back at once. From the heap, a finished session's
    buffers stayed with the process, and the next session's slightly larger ones were put beside them (the 8B
    shape's bench, a 4,096-token prompt's session then the decode session's: peak RSS 379 MiB higher)."""
    if torch.device(device or "cpu").type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=dtype).view(shape)


def inverse_frequencies(config: LlamaConfig, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """RoPE's per-pair inverse frequencies (head_dim // 2,), computed in `dtype`."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=dtype) * 2 / config.head_dim))
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=dtype)
    return inv_freq


def rope_tables(config: LlamaConfig, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (length, head_dim) for positions 0..length-1, computed in fp32 as transformers does
    (so dense logits match it) and cast once."""
    inv_freq = inverse_frequencies(config, torch.float32)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class KVCache(nn.Module):
    """Dense attention over static K/V buffers, (batch, kv_heads, max_length, head_dim) per layer, filled left to
    right. The cache owns how a layer attends to its history, so other caches (sparse, offloaded) can take its
    place: `begin` is called once per forward, then `attend` once per layer with unrotated q/k."""

    def __init__(self, config: LlamaConfig, max_length: int, cos: torch.Tensor, sin: torch.Tensor, batch: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device=None, storage: torch.dtype | None = None):
        """cos/sin: the model's RoPE tables covering at least max_length positions; dtype: the model's; storage:
        the K/V buffers' (default dtype; an fp32 model on a CPU may keep bf16 ones, half the bytes a decode step
        reads)."""
        super().__init__()
        self.rope_cos, self.rope_sin = cos, sin
        self.dtype = dtype
        shape = (config.n_layers, batch, config.n_kv_heads, max_length, config.head_dim)
        self.register_buffer("k", zeroed(shape, storage or dtype, device), persistent=False)
        self.register_buffer("v", zeroed(shape, storage or dtype, device), persistent=False)
        self.max_length = max_length
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads

    def truncate(self, length: int) -> int:
        """Keep the first `length` tokens; returns how many are kept (all of them: later writes overwrite)."""
        return length

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """The rotated K/V of the first `length` positions, as views."""
        return {"k": self.k[:, :, :, :length], "v": self.v[:, :, :, :length]}

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        n = state["k"].shape[3] if "k" in state else -1
        if not 0 <= n <= self.max_length or {k: t.shape for k, t in state.items()} != {
                k: t.shape for k, t in self.export_state(n).items()}:
            raise ValueError("the saved cache state does not match this model and these settings")
        for name, target in self.export_state(n).items():
            target.copy_(state[name])

    def begin(self, start: int, length: int) -> None:
        """Positions [start, start+length) come next."""
        if start + length > self.max_length:
            raise ValueError(f"cache holds {self.max_length} tokens; asked for positions up to {start + length}")
        self.start, self.end = start, start + length
        self.cos, self.sin = self.rope_cos[start : self.end, None], self.rope_sin[start : self.end, None]
        # A single query sees the whole filled cache and needs no mask; the first segment is plainly causal;
        # a later segment gets an explicit (length, start+length) mask, but on the CPU (`prompt_attention`).
        self.mask = None
        if length > 1 and start > 0 and self.k.device.type != "cpu":  # additive, built once, not in every layer
            rows = torch.arange(start, self.end, device=self.k.device)[:, None]
            hidden = torch.arange(self.end, device=self.k.device)[None, :] > rows
            self.mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.k.device).masked_fill_(hidden, float("-inf"))

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """qk: (B, T, H + KV, D) query heads then key heads, unrotated; v: (B, T, KV, D); x: the layer's
        attention input (B, T, dim), which an indexer may read. Returns (B, T, H * D)."""
        B, T = qk.shape[:2]
        H = self.n_heads
        qk = apply_rope(qk, self.cos, self.sin)  # q and k heads rotated in one go
        q = qk[:, :, :H].transpose(1, 2)
        self.k[layer, :, :, self.start : self.end] = qk[:, :, H:].transpose(1, 2)
        self.v[layer, :, :, self.start : self.end] = v.transpose(1, 2)
        keys, values = self.k[layer, :, :, : self.end], self.v[layer, :, :, : self.end]
        if T == 1:
            return decode_attention(q.view(B, self.n_kv_heads, H // self.n_kv_heads, -1), keys, values,
                                    self.mask).reshape(B, 1, -1)
        if keys.device.type == "cpu":
            y = prompt_attention(q, keys, values, self.start)
        else:
            y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=self.mask,
                                               is_causal=self.mask is None, enable_gqa=self.n_kv_heads != H)
        return y.transpose(1, 2).reshape(B, T, -1)


class BatchKVCache(KVCache):
    """Dense attention for several independent sequences decoded together, one per batch row, each at its own
    length: a forward feeds every row one token (tokens (rows, 1)), rotated at that row's next position and
    attending only to that row's filled slots. A row is filled from a one-sequence cache that has read its prompt
    (`take_row`). When rows finish, `keep` packs the others to the front: the rows fed are always the first
    `rows`, so every layer attends over views of the buffers rather than gathered copies."""

    def __init__(self, config: LlamaConfig, max_length: int, cos: torch.Tensor, sin: torch.Tensor, batch: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device=None, storage: torch.dtype | None = None):
        super().__init__(config, max_length, cos, sin, batch, dtype, device, storage)
        self.lengths = torch.zeros(batch, dtype=torch.long)  # tokens each row holds; on the CPU, read every step
        self.rows = batch

    def take_row(self, row: int, source: KVCache, length: int) -> None:
        """Copy the first `length` tokens a one-sequence cache holds into `row`."""
        self.k[:, row, :, :length] = source.k[:, 0, :, :length]
        self.v[:, row, :, :length] = source.v[:, 0, :, :length]
        self.lengths[row] = length

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (ascending), moved to the front in that order; later forwards feed len(rows) rows."""
        end = int(self.lengths[: self.rows].max())
        for new, old in enumerate(rows):  # new <= old, in ascending order: a row is read before it is overwritten
            if new != old:
                self.k[:, new, :, :end] = self.k[:, old, :, :end]
                self.v[:, new, :, :end] = self.v[:, old, :, :end]
                self.lengths[new] = self.lengths[old]
        self.rows = len(rows)

    def begin(self, start: int, length: int) -> None:
        """One token for each row, at the position after that row's tokens (`start` is unused: each row has its
        own)."""
        if length != 1:
            raise ValueError("a batch is fed one token per row per forward")
        positions = self.lengths[: self.rows].clone()  # a copy: the lengths grow below
        self.end = int(positions.max()) + 1
        if self.end > self.max_length:
            raise ValueError(f"cache holds {self.max_length} tokens; asked for positions up to {self.end}")
        self.slots = positions.to(self.k.device)
        self.cos, self.sin = self.rope_cos[self.slots, None, None], self.rope_sin[self.slots, None, None]
        # Rows of one length see the same slots and need no mask (a batch of one decodes exactly as KVCache does);
        # otherwise each row is masked past its own token.
        self.mask = None
        if int(positions.min()) + 1 < self.end:
            hidden = torch.arange(self.end, device=self.k.device)[None, :] > self.slots[:, None]
            self.mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.k.device).masked_fill_(
                hidden, float("-inf"))[:, None, None, :]  # (rows, 1, 1, end): broadcast over heads
        self.lengths[: self.rows] += 1

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """qk (rows, 1, H + KV, D) unrotated, v (rows, 1, KV, D): each row's next token. Returns (rows, 1, H * D)."""
        B, H = qk.shape[0], self.n_heads
        qk = apply_rope(qk, self.cos, self.sin)
        q = qk[:, :, :H].transpose(1, 2)
        rows = torch.arange(B, device=self.k.device)
        self.k[layer, rows, :, self.slots] = qk[:, 0, H:].to(self.k.dtype)  # an index put does not convert
        self.v[layer, rows, :, self.slots] = v[:, 0].to(self.v.dtype)
        keys, values = self.k[layer, :B, :, : self.end], self.v[layer, :B, :, : self.end]
        return decode_attention(q.view(B, self.n_kv_heads, H // self.n_kv_heads, -1), keys, values,
                                self.mask).reshape(B, 1, -1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wqkv = nn.Linear(config.dim, config.q_dim + 2 * config.kv_dim, bias=config.qkv_bias)
        self.wo = nn.Linear(config.q_dim, config.dim, bias=False)
        if config.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(config.head_dim))
            self.k_norm = nn.Parameter(torch.ones(config.head_dim))
        self.norm_eps = config.norm_eps
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV = self.n_heads, self.n_kv_heads
        qkv = self.wqkv(x).view(B, T, H + 2 * KV, self.head_dim)
        qk, v = qkv[:, :, : H + KV], qkv[:, :, H + KV :]
        if self.qk_norm:
            qk = torch.cat([F.rms_norm(qk[:, :, :H], (self.head_dim,), self.q_norm, self.norm_eps),
                            F.rms_norm(qk[:, :, H:], (self.head_dim,), self.k_norm, self.norm_eps)], dim=2)
        return self.wo(cache.attend(self.layer, qk, v, x))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.ffn_dim = config.ffn_dim
        self.w13 = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        # a prompt's segment on the file's blocks: no (T, 2 * ffn_dim) product at all; else in place, in the
        # gate's columns: no second and third (T, ffn_dim) buffer
        h = self.w13.silu_gated(x) if isinstance(self.w13, BlockLinear) else None
        if h is None:
            y = self.w13(x)  # sliced, not split: autograd lets a slice be changed in place
            h = F.silu(y[..., : self.ffn_dim], inplace=True).mul_(y[..., self.ffn_dim :])
        return self.w2(h)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.attention_norm = nn.Parameter(torch.ones(config.dim))
        self.attention = Attention(config, layer)
        self.ffn_norm = nn.Parameter(torch.ones(config.dim))
        self.feed_forward = FeedForward(config)
        self.eps = config.norm_eps

    def linears(self) -> tuple[nn.Module, ...]:
        """wqkv, wo, w13, w2: the layer's linears in the order of its computation."""
        return self.attention.wqkv, self.attention.wo, self.feed_forward.w13, self.feed_forward.w2

    def forward(self, x, cache):
        shape = (x.shape[-1],)
        x = x + self.attention(F.rms_norm(x, shape, self.attention_norm, self.eps), cache)
        return x + self.feed_forward(F.rms_norm(x, shape, self.ffn_norm, self.eps))


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        weight = torch.empty(config.vocab_size, config.dim)
        if weight.device.type != "meta":  # the loader builds on the meta device, where normal_ alone costs ~3 s
            nn.init.normal_(weight)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, _weight=weight)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = nn.Parameter(torch.ones(config.dim))
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._rope_length = 0  # RoPE tables grow to the longest cache asked for, not the config's context (128K: 64+ MiB)
        self.cache_dtype: torch.dtype | None = None  # the dense K/V cache's dtype, when not the model's (`new_cache`)
        self._decode_layers: cpu_decode.DecodeLayers | None | bool = False  # False: not looked at yet
        self._head_on_blocks = False  # the output layer takes the C step's fp32 output as it is (set with the table)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def new_cache(self, max_length: int, batch: int = 1, kind: type[KVCache] = KVCache) -> KVCache:
        """A `kind` cache (KVCache, or BatchKVCache for independent sequences) of `batch` rows, its K/V in
        `cache_dtype` (None: the model's dtype)."""
        self._ensure_rope(max_length)
        return kind(self.config, max_length, self.rope_cos, self.rope_sin, batch, self.dtype, self.device,
                    self.cache_dtype)

    def _ensure_rope(self, length: int) -> None:
        if length > self._rope_length:
            cos, sin = rope_tables(self.config, length, self.dtype)
            self.rope_cos, self.rope_sin = cos.to(self.device), sin.to(self.device)
            self._rope_length = length

    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions [start, start+T); returns fp32 logits (B, T, V), or (B, 1, V) for the last."""
        cache.begin(start, tokens.shape[1])
        x = self.tok_embeddings(tokens)
        if tokens.shape == (1, 1) and type(cache) is KVCache and self._decodes_in_c(cache, x):
            # the step works in fp32: a bf16 model's embedding row and RoPE row are widened. Its output stays fp32
            # for a head on blocks, which then writes fp32 logits: rounding it to bf16 and the logits back would be
            # a torch parallel region, whose threads spin on after it and slowed the next step's C threads by 12%
            # (1B shape on blocks, bf16, 2 threads, AMX)
            h = x.view(-1).float()
            self._decode_layers(h, start, cache.rope_cos[start].float(), cache.rope_sin[start].float(), cache.k,
                                cache.v)
            x = h.view(x.shape) if self._head_on_blocks else h.view(x.shape).to(x.dtype)
        else:
            for layer in self.layers:
                x = layer(x, cache)
        if not all_logits:
            x = x[:, -1:]
        return self.output(F.rms_norm(x, (x.shape[-1],), self.norm.to(x.dtype), self.config.norm_eps)).float()

    def _decodes_in_c(self, cache: KVCache, x: torch.Tensor) -> bool:
        """Whether this one-token step of one sequence over a dense cache runs all its layers in one C call
        (`kernels.cpu_decode`): an fp32 model whose linears all have C decode copies, or an fp32 or bf16 model whose
        linears all lie in GGUF blocks, a cache the attention kernel reads, no autograd."""
        if self._decode_layers is False:
            self._decode_layers = self._decode_table()
            self._head_on_blocks = isinstance(self.output, BlockLinear) and cpu_decode.takes_blocks(self.output)
        return (self._decode_layers is not None and not x.requires_grad
                and cache.k.shape[1] == 1 and native_attention_takes(cache.k.dtype, self.config.head_dim)
                and not torch_forced())

    def _decode_table(self) -> cpu_decode.DecodeLayers | None:
        """The layers as the C step reads them, or None for a model it does not take (`_not_in_c` says why)."""
        if self._not_in_c() is not None:
            return None
        layers = [{"attention_norm": block.attention_norm, "ffn_norm": block.ffn_norm}
                  | {name: m if isinstance(m, BlockLinear) else
                     (m.qweight, m.scales if m.bits == 8 else None, m.bias, m.bits, m.weight.shape[1])
                     for name, m in zip(("wqkv", "wo", "w13", "w2"), block.linears())}
                  for block in self.layers]
        return cpu_decode.DecodeLayers(layers, self.config.dim, self.config.n_heads, self.config.n_kv_heads,
                                       self.config.head_dim, self.config.ffn_dim, self.config.norm_eps)

    def _not_in_c(self) -> str | None:
        """Why this model's decode steps cannot run in one C call (INDEXPOOL_KERNELS aside: read per step), or
        None."""
        if self.dtype not in (torch.float32, torch.bfloat16) or self.device.type != "cpu":
            return "an fp32 or bf16 model on a CPU only"
        if self.config.qk_norm:
            return "the C step has no q/k norm"
        linears = [m for block in self.layers for m in block.linears()]
        # C decode copies are an fp32 model's (`native`; a bf16 model's are torch's layouts); the block kernels take
        # a bf16 model's rows as they lie too, the step working in fp32 within
        if all(isinstance(m, DecodeQuantLinear) and m.native for m in linears):
            return cpu_decode.unavailable()
        if all(isinstance(m, BlockLinear) and cpu_decode.takes_blocks(m) for m in linears):
            return cpu_decode.unavailable(blocks=True)
        return "the linears have neither C decode copies nor all their weights in GGUF blocks the C step takes"

    def decode_step_path(self) -> str:
        """Which code runs the layers of a one-sequence decode step over a dense cache, for `indexpool info`."""
        why_not = self._not_in_c()
        if why_not is None and torch_forced():
            why_not = "INDEXPOOL_KERNELS=torch"
        if why_not is None and not native_attention_takes(self.cache_dtype or self.dtype, self.config.head_dim):
            why_not = "the C attention kernel does not read this cache"
        if why_not is not None:
            return f"per layer (model/llama.py: {why_not})"
        return f"all layers in one call: {cpu_decode.native_library()[1]}"


def rope_scaling_factors(head_dim: int, theta: float, scaling: dict) -> list[float]:
    """Llama 3.1's "llama3" RoPE scaling as per-frequency divisors of the inverse frequency."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return factors
