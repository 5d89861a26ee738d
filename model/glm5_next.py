"""The GLM-5.3-Flash text model (architecture `glm5_next`) as one readable file, in plain torch.

A hybrid decoder. Most layers are KDA (Kimi Delta Attention) linear attention: a per-channel decaying delta-rule
state per head, run in a chunked form for prefill and a recurrent form for decode. Every fourth layer is MLA with
NoPE (latent queries and keys, no rotary part) behind the k-pool DSA indexer (`model/indexpool.py`): attention
is exact over the tokens the indexer selects. Feed-forward is a dense SwiGLU in the first layers, then a
sigmoid-routed MoE with one shared expert. The residual is four streams mixed by manifold-constrained
hyper-connections (mHC). One MTP layer predicts the token after next, for self-speculative decoding.

Decoding state lives in `Glm5NextCache`: KDA recurrent and conv states, the MLA latent of every token (attention
runs in the latent space when few queries come, and always on the Triton backend, with the key/value up-projection
absorbed into the query and the output), and the pooled indexer keys. Facts are from SPEC.md section 2 and
transformers' `glm5_next` reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from indexpool.kernels import kernel_backend
from indexpool.kernels.index_math import FP8_DTYPE, score_pools, select_tokens
from indexpool.kernels.kda import kda_chunked, kda_recurrent

from .indexpool import PooledIndexCache, indexer_source_layers

KDA = "linear_attention"
MLA = "indexed_attention"
# Other names checkpoints use for the MLA (DSA) layers.
MLA_ALIASES = {"full_attention": MLA, "deepseek_sparse_attention": MLA}
MODEL_TYPES = ("glm5_next", "glm5_next_text")

# Forwards of at most this many tokens use the decode forms: the KDA recurrence (whose per-token states allow a
# rewind) and attention in the MLA latent space over the gathered selected latents, which never expands the
# history per head. Longer forwards (prefill) use the chunked KDA form and expand the latents once, shared by
# all queries.
DECODE_MAX_TOKENS = 4


# ------------------------------------------------------------------------------------------------- config

@dataclass
class Glm5NextConfig:
    """Text-model hyperparameters, named as in the Hugging Face config. Defaults are the released GLM-5.3-Flash."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288  # dense MLP width
    moe_intermediate_size: int = 2048  # routed and shared expert width
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 4
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    layer_types: list[str] = field(default_factory=list)  # KDA or MLA per layer; [] means the default schedule
    mlp_layer_types: list[str] = field(default_factory=list)  # "dense" or "sparse" per layer
    indexer_types: list[str] = field(default_factory=list)  # "full" or "shared" per layer

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = [MLA if i % 4 == 3 else KDA for i in range(n)]
        self.layer_types = [MLA_ALIASES.get(t, t) for t in self.layer_types]
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3)
        if not self.indexer_types:
            self.indexer_types = ["full"] * n
        self.validate()

    def validate(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} layers")
        allowed = {"layer_types": (KDA, MLA), "mlp_layer_types": ("dense", "sparse"),
                   "indexer_types": ("full", "shared")}
        for name, values in allowed.items():
            unknown = sorted(set(getattr(self, name)) - set(values))
            if unknown:
                raise ValueError(f"{name}: unknown value(s) {unknown} (expected {' or '.join(values)})")
        indexer_source_layers(self.mla_indexer_kinds)  # raises when the first MLA layer is "shared"
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk={self.index_topk} must be a positive multiple of "
                             f"index_kpool={self.index_kpool}")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} must split into n_group={self.n_group} "
                             "groups of at least 2 experts")
        if not 1 <= self.topk_group <= self.n_group or self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("topk_group must be in [1, n_group] and num_experts_per_tok at most n_routed_experts")

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_indexer_kinds(self) -> list[str]:
        return [self.indexer_types[i] for i in self.mla_layers]

    @property
    def indexer_layers(self) -> list[int]:
        """MLA layers that run their own indexer."""
        return [i for i in self.mla_layers if self.indexer_types[i] == "full"]

    def selection_source(self, layer: int) -> int:
        """The MLA layer whose token selection MLA layer `layer` attends over: itself when its indexer is "full",
        the nearest earlier full one when "shared"."""
        mla = self.mla_layers
        return mla[indexer_source_layers(self.mla_indexer_kinds)[mla.index(layer)]]

    # Names the rest of the engine reads from a model config.
    @property
    def arch(self) -> str:
        return "glm5_next"

    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: dict) -> "Glm5NextConfig":
        """From a config.json: flat, or with the text model under `text_config` (the multimodal layout).

        `index_kpool` must be given: the transformers and vLLM config classes default it to 16, the released
        checkpoint says 4, so a silent default would be wrong for one of them. Raises ValueError (one line).
        """
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type is {model_type!r}, not one of {', '.join(MODEL_TYPES)}")
        if "index_kpool" not in cfg:
            raise ValueError("config.json does not give index_kpool (the pool size of the DSA indexer); add it "
                             "(GLM-5.3-Flash uses 4)")
        unsupported = {  # key: (is it outside what we run, what we run)
            "qk_rope_head_dim": ((cfg.get("qk_rope_head_dim") or 0) != 0, "0 (MLA without RoPE)"),
            "attention_bias": (bool(cfg.get("attention_bias")), "false"),
            "hidden_act": (cfg.get("hidden_act", "silu") != "silu", "silu"),
            "index_kpool_always_select_tail": (not cfg.get("index_kpool_always_select_tail", True), "true"),
            "num_key_value_heads": (cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
                                    != cfg.get("num_attention_heads"), "num_attention_heads"),
        }
        for key, (bad, supported) in unsupported.items():
            if bad:
                raise ValueError(f"{key}={cfg.get(key)!r} is not supported (only {supported}, as in GLM-5.3-Flash)")
        linear = cfg.get("linear_attn_config") or {}
        renamed = {"linear_num_heads": linear.get("num_heads"), "linear_head_dim": linear.get("head_dim"),
                   "linear_conv_kernel_dim": linear.get("short_conv_kernel_size")}
        if "gate_lower_bound" in linear:
            renamed["linear_lower_bound"] = linear["gate_lower_bound"]
        if "n_routed_experts" not in cfg and "num_local_experts" in cfg:
            renamed["n_routed_experts"] = cfg["num_local_experts"]
        values = {f.name: cfg[f.name] for f in fields(cls) if cfg.get(f.name) is not None}
        if "linear_lower_bound" in cfg:  # null is meaningful: an unbounded (softplus) forget gate
            values["linear_lower_bound"] = cfg["linear_lower_bound"]
        if linear and linear.get("safe_gate", True) and values.get("linear_lower_bound", -5.0) is None:
            values["linear_lower_bound"] = -5.0  # a "safe" gate always has a bound
        values.update({k: v for k, v in renamed.items() if v is not None})
        values.setdefault("num_nextn_predict_layers", 0)  # a config that does not declare MTP layers has none
        if not values.get("indexer_types"):
            values["indexer_types"] = _indexer_schedule(cfg, int(values.get("num_hidden_layers", 45)))
        try:
            return cls(**values)
        except TypeError as e:
            raise ValueError(f"bad config value: {e}") from None


def _indexer_schedule(cfg: dict, n_layers: int) -> list[str]:
    """The per-layer indexer kinds a config gives without `indexer_types`: an "F"/"S" pattern, or a frequency and
    offset (GLM-5.2's IndexShare). Without either every layer is "full", as in GLM-5.3-Flash."""
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        kinds = {"F": "full", "S": "shared"}
        return [kinds.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(cfg.get("index_topk_freq", 1) or 1), 1)
    offset = int(cfg.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


# ------------------------------------------------------------------------------------------------ plain ops

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32, cast back to x's dtype, then scaled (the reference's order, which matters in bf16)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(gate) * up with the gate clamped from above and up on both sides at `limit`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution then SiLU. x (B, T, C); weight (C, K); state (B, K-1, C), the previous K-1
    inputs (zeros at the start). Returns the output (B, T, C) in x's dtype and the window (B, K-1+T, C), whose
    last K-1 rows are the next state. Computed in the weight's dtype (kept in fp32)."""
    window = torch.cat([state.to(x.dtype), x], dim=1)
    out = F.conv1d(window.transpose(1, 2).to(weight.dtype), weight[:, None, :], groups=weight.shape[0])
    return F.silu(out).transpose(1, 2).to(x.dtype), window


def hyper_connection(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     config: Glm5NextConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights from the streams (B, T, N, D): returns post (B, T, N), comb (B, T, N, N) (doubly stochastic by
    Sinkhorn iterations, columns first) and the block input, the streams collapsed by pre (B, T, D).

    A one-layer perceptron on the RMS-normalised, flattened streams gives N + N + N*N logits: pre = sigmoid + eps,
    post = 2 sigmoid, comb = softmax over each row + eps, then normalised. All in fp32.
    """
    B, T, N, D = streams.shape
    flat = streams.reshape(B, T, N * D).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + config.rms_norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.float().split([N, N, N * N])
    scale = scale.float()
    eps = config.hc_eps
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(B, T, N, N) * scale[2] + comb_b.view(N, N), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    collapsed = (pre[..., None] * streams).sum(dim=2).to(streams.dtype)
    return post, comb, collapsed


def hyper_merge(block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """New streams: stream m = post_m * block output + sum_n comb[n, m] * residual stream n."""
    dtype = residual.dtype
    return post.to(dtype)[..., None] * block_out[..., None, :] + comb.to(dtype).transpose(-1, -2) @ residual


# ------------------------------------------------------------------------------------------------ the cache

class Glm5NextCache:
    """Decoding state of one model (or of its MTP layer) for a batch of equal-length sequences.

    Per KDA layer: the recurrent state (B, H, dk, dv) in fp32 and the conv state, the last K-1 q/k/v projections.
    Per MLA layer: the normalised kv latent of every token (B, max_length, kv_lora_rank), the only per-token
    attention state. Per indexer layer: pooled keys and the unfinished pool's tail (`PooledIndexCache`).

    Tokens are appended in order: `begin(start, n)` needs start == the tokens held. `truncate(n)` cannot undo a
    recurrent update in general, so it starts over (returns 0) unless the cache is `rewindable` and n falls within
    its last forward of at most DECODE_MAX_TOKENS tokens (a rejected speculative draft): then that forward's
    per-token states are restored. It also goes back to the length of the last `export_state` / `import_state`
    (a document already read, before the next request on it), whose fixed-size state is kept for that.
    """

    def __init__(self, config: Glm5NextConfig, layer_types: list[str], indexer_ape: list[torch.Tensor],
                 max_length: int, batch_size: int = 1, dtype: torch.dtype = torch.bfloat16,
                 index_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 rewindable: bool = False):
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.config, self.max_length, self.batch_size, self.rewindable = config, max_length, batch_size, rewindable
        kda_layers = [i for i, t in enumerate(layer_types) if t == KDA]
        mla_layers = [i for i, t in enumerate(layer_types) if t == MLA]
        self.kda_slot = {layer: s for s, layer in enumerate(kda_layers)}
        self.mla_slot = {layer: s for s, layer in enumerate(mla_layers)}
        heads, dk = config.linear_num_heads, config.linear_head_dim
        conv_channels = 3 * heads * dk
        self.recurrent = torch.zeros(len(kda_layers), batch_size, heads, dk, dk, device=device)
        self.conv = torch.zeros(len(kda_layers), batch_size, config.linear_conv_kernel_dim - 1, conv_channels,
                                dtype=dtype, device=device)
        self.latents = torch.zeros(len(mla_layers), batch_size, max_length, config.kv_lora_rank, dtype=dtype,
                                   device=device)
        self.index = PooledIndexCache(indexer_ape, max_length, batch_size, index_dtype, device) if indexer_ape else None
        self.backend = kernel_backend(self.latents.device)  # read once, not by every layer on every forward
        self.length = 0
        self.selected: dict[int, torch.Tensor] = {}  # this forward's token selection, by indexer layer
        self._undo: dict | None = None
        self._resume: tuple[int, dict[str, torch.Tensor]] | None = None  # (length, fixed-size state) to go back to

    # -- the forward protocol
    def begin(self, start: int, length: int) -> None:
        if start != self.length:
            raise ValueError(f"the cache holds {self.length} tokens; a forward must continue at that position, not "
                             f"at {start} (truncate first)")
        if start + length > self.max_length:
            raise ValueError(f"the cache holds at most {self.max_length} tokens; asked for {start + length}")
        self.start, self.end = start, start + length
        self.positions = torch.arange(start, self.end, device=self.latents.device)
        self.selected = {}
        self._undo = None
        if self.rewindable and length <= DECODE_MAX_TOKENS:
            self._undo = {"start": start, "conv": {}, "steps": {}, "index": {}}
            if self.index is not None:
                for slot in range(self.index.n_layers):
                    keys, gates = self.index.tail(slot)
                    self._undo["index"][slot] = [keys.clone(), gates.clone()]
        self.length = self.end

    @property
    def decode_form(self) -> bool:
        return self.end - self.start <= DECODE_MAX_TOKENS

    def kda_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.kda_slot[layer]
        return self.recurrent[slot], self.conv[slot]

    def set_kda_state(self, layer: int, state: torch.Tensor, window: torch.Tensor, steps: list[torch.Tensor]) -> None:
        """The new recurrent state and the conv window of this forward (the last K-1 rows are the new state)."""
        slot = self.kda_slot[layer]
        if self._undo is not None:
            self._undo["conv"][slot] = window
            self._undo["steps"][slot] = [self.recurrent[slot].clone(), *steps]
        self.recurrent[slot] = state
        self.conv[slot] = window[:, window.shape[1] - self.conv.shape[2]:]

    def append_latents(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Store this forward's latents (B, T, R); returns all latents so far (B, end, R)."""
        slot = self.mla_slot[layer]
        self.latents[slot, :, self.start:self.end] = latent
        return self.latents[slot, :, :self.end]

    def append_index_keys(self, slot: int, keys: torch.Tensor, gate_logits: torch.Tensor) -> None:
        if self._undo is not None:
            self._undo["index"][slot] += [keys.float(), gate_logits.float()]
        self.index.append(slot, keys, gate_logits)

    # -- saved state
    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """What resuming from the `length` tokens held needs: KDA recurrent and conv states, the MLA latents, the
        pooled indexer keys and the unfinished pool's raw keys and gate logits, as views: copy them before
        writing to this cache again. The fixed-size part is also kept here, so `truncate(length)` can come back."""
        if length != self.length:
            raise ValueError(f"the cache holds {self.length} tokens, not {length}")
        views = self._state_views(length)
        self._keep_resume_point(views)
        return views

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Resume from `export_state` of a cache of the same model and settings; raises ValueError on a mismatch."""
        n = state["mla_latents"].shape[2] if "mla_latents" in state else -1
        if not 0 <= n <= self.max_length or {k: (t.shape, t.dtype) for k, t in state.items()} != \
                {k: (t.shape, t.dtype) for k, t in self._state_views(n).items()}:
            raise ValueError("the saved cache state does not match this model and these settings")
        views = self._state_views(n)
        for name, target in views.items():
            target.copy_(state[name])
        if self.index is not None:
            self.index._n_tokens = [n] * self.index.n_layers
        self.length, self.selected, self._undo = n, {}, None
        self._keep_resume_point(views)

    def _state_views(self, n: int) -> dict[str, torch.Tensor]:
        views = {"kda_recurrent": self.recurrent, "kda_conv": self.conv, "mla_latents": self.latents[:, :, :n]}
        if self.index is not None:
            kpool = self.index.kpool
            views["pooled_index"] = self.index._pooled[:, :, :n // kpool]
            if self.index._scales is not None:
                views["pooled_index_scale"] = self.index._scales[:, :, :n // kpool]
            views["index_tail_keys"] = self.index._tail_keys[:, :, :n % kpool]
            views["index_tail_gates"] = self.index._tail_gates[:, :, :n % kpool]
        return views

    def _keep_resume_point(self, views: dict[str, torch.Tensor]) -> None:
        """Copies of the state that later tokens overwrite (all but the latents and pools, which only grow)."""
        fixed = ("kda_recurrent", "kda_conv", "index_tail_keys", "index_tail_gates")
        self._resume = self.length, {name: views[name].clone() for name in fixed if name in views}

    def _go_to_resume_point(self) -> int:
        n, saved = self._resume
        self.recurrent.copy_(saved["kda_recurrent"])
        self.conv.copy_(saved["kda_conv"])
        if self.index is not None:
            self.index.truncate(n // self.index.kpool * self.index.kpool)
            for slot in range(self.index.n_layers):
                self.index.append(slot, saved["index_tail_keys"][slot], saved["index_tail_gates"][slot])
        self.length, self._undo = n, None
        return n

    # -- size and rewind
    def truncate(self, n_tokens: int) -> int:
        """Keep the first n_tokens if the state for them can be restored, else as many as can be (the resume
        point, or none); returns how many are kept."""
        if n_tokens >= self.length:
            return self.length
        undo = self._undo
        if undo is None or n_tokens < undo["start"]:
            if self._resume is not None and self._resume[0] <= n_tokens:
                return self._go_to_resume_point()
            self.reset()
            return 0
        step = n_tokens - undo["start"]
        for slot, states in undo["steps"].items():
            self.recurrent[slot] = states[step]
            self.conv[slot] = undo["conv"][slot][:, step:step + self.conv.shape[2]]
        if self.index is not None:
            kpool = self.index.kpool
            pool_start = n_tokens // kpool * kpool
            self.index.truncate(pool_start)
            first = undo["start"] // kpool * kpool  # the raw keys kept begin at the tail before that forward
            for slot, (tail_keys, tail_gates, keys, gates) in undo["index"].items():
                raw_keys, raw_gates = torch.cat([tail_keys, keys], dim=1), torch.cat([tail_gates, gates], dim=1)
                kept = slice(pool_start - first, n_tokens - first)
                self.index.append(slot, raw_keys[:, kept], raw_gates[:, kept])
        self.length = n_tokens
        self._undo = None
        if self._resume is not None and self._resume[0] > n_tokens:  # its tokens are no longer all held
            self._resume = None
        return n_tokens

    def reset(self) -> None:
        self.recurrent.zero_()
        self.conv.zero_()
        if self.index is not None:
            self.index.truncate(0)
        self.length = 0
        self._undo = self._resume = None

    def bytes_per_token(self) -> float:
        """Storage that grows with the context, per token and sequence: the MLA latents of every MLA layer plus
        the pooled indexer keys of every indexer layer."""
        latent = self.latents.shape[0] * self.latents.shape[-1] * self.latents.element_size()
        index = self.index.n_layers * self.index.bytes_per_token() if self.index is not None else 0
        return latent + index

    def fixed_bytes(self) -> int:
        """Storage per sequence that does not grow with the context: KDA recurrent and conv states, and the
        indexer's tail buffers (raw keys and gate logits of an unfinished pool, fp32)."""
        total = (self.recurrent.numel() * self.recurrent.element_size() + self.conv.numel() * self.conv.element_size())
        if self.index is not None:
            total += 2 * self.index.n_layers * (self.index.kpool - 1) * self.index.head_dim * 4 * self.batch_size
        return total // self.batch_size


@dataclass
class CacheSize:
    n_tokens: int
    latent_bytes: int  # MLA latents, all MLA layers
    index_bytes: int  # indexer keys (pooled, or one per token for comparison), all indexer layers
    fixed_bytes: int  # KDA states and indexer tails

    @property
    def total_bytes(self) -> int:
        return self.latent_bytes + self.index_bytes + self.fixed_bytes


INDEX_LAYOUTS = ("pooled", "per_token", "none")


def cache_size(config: Glm5NextConfig, n_tokens: int, dtype: torch.dtype = torch.bfloat16,
               index_dtype: torch.dtype = torch.bfloat16, index: str = "pooled") -> CacheSize:
    """Bytes `Glm5NextCache` needs for one sequence of n_tokens, computed from the config alone (no allocation):
    for the released model, `cache_size(Glm5NextConfig(), 1 << 20)`. The MTP layer's own cache is not counted.
    index: "pooled" (this cache: one key per kpool tokens, and the unfinished pools' tails), or for comparison
    "per_token" (a DSA indexer's one key per token, as DeepSeek-V3.2 stores it) or "none" (dense MLA)."""
    if index not in INDEX_LAYOUTS:
        raise ValueError(f"index must be one of {', '.join(INDEX_LAYOUTS)}, not {index!r}")
    n_mla, n_index, n_kda = len(config.mla_layers), len(config.indexer_layers), len(config.kda_layers)
    latent = n_mla * n_tokens * config.kv_lora_rank * dtype.itemsize
    key_bytes = config.index_head_dim * index_dtype.itemsize + (4 if index_dtype == FP8_DTYPE else 0)
    keys = {"pooled": n_tokens // config.index_kpool, "per_token": n_tokens, "none": 0}[index]
    qkv = config.linear_num_heads * config.linear_head_dim
    kda = n_kda * (config.linear_num_heads * config.linear_head_dim ** 2 * 4
                   + (config.linear_conv_kernel_dim - 1) * 3 * qkv * dtype.itemsize)
    tails = 2 * n_index * (config.index_kpool - 1) * config.index_head_dim * 4 if index == "pooled" else 0
    return CacheSize(n_tokens, latent, n_index * keys * key_bytes, kda + tails)


# ------------------------------------------------------------------------------------------------ the layers

class KimiDeltaAttention(nn.Module):
    """KDA: q/k/v projections, each through a short causal conv + SiLU; per-channel forget gate
    g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)) (a bounded scale, not a clamp); beta =
    sigmoid(b_proj(x)); the delta rule; the output RMS-normalised per head, gated by sigmoid(g_b(g_a(x)))."""

    def __init__(self, config: Glm5NextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        width, hidden, kernel = self.heads * self.head_dim, config.hidden_size, config.linear_conv_kernel_dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.q_conv1d = nn.Parameter(torch.empty(width, kernel))
        self.k_conv1d = nn.Parameter(torch.empty(width, kernel))
        self.v_conv1d = nn.Parameter(torch.empty(width, kernel))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.b_proj = nn.Linear(hidden, self.heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = nn.Parameter(torch.empty(self.head_dim))
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.lower_bound, self.eps = config.linear_lower_bound, config.rms_norm_eps

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log-decay per key channel, (B, T, H, dk) in fp32, in [lower_bound, 0]."""
        logits = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).unflatten(-1, (self.heads, -1))
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * logits)
        return -rate * F.softplus(logits)

    def forward(self, x: torch.Tensor, cache: Glm5NextCache) -> torch.Tensor:
        B, T, _ = x.shape
        state, conv_state = cache.kda_state(self.layer)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv_weight = torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d])
        qkv, window = short_conv(qkv, conv_weight, conv_state)
        q, k, v = qkv.unflatten(-1, (3 * self.heads, self.head_dim)).split(self.heads, dim=2)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x))
        steps = []
        if cache.decode_form:
            out, state, steps = kda_recurrent(q, k, v, g, beta, state, keep_steps=cache.rewindable)
        else:
            out, state = kda_chunked(q, k, v, g, beta, state)
        cache.set_kda_state(self.layer, state, window, steps)
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.heads, -1))
        out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        out = (out * torch.sigmoid(gate.float())).to(x.dtype)
        return self.o_proj(out.reshape(B, T, -1))


class Indexer(nn.Module):
    """The k-pool DSA indexer's weights; pooling, scoring and selection are `model/indexpool.py`'s."""

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        d, hidden = config.index_head_dim, config.hidden_size
        self.heads, self.head_dim = config.index_n_heads, d
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * d, bias=False)
        self.wk = nn.Linear(hidden, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, self.heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(config.index_kpool, d))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(d, hidden))
        self.kpool, self.topk = config.index_kpool, config.index_topk

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cache: Glm5NextCache, slot: int) -> torch.Tensor:
        """Append this forward's keys to the pooled cache; returns the selected positions (B, T, topk+kpool-1)."""
        cache.append_index_keys(slot, self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate))
        if cache.end <= self.topk:  # every query sees at most topk tokens: all are selected, no scoring
            return select_tokens(None, cache.positions.expand(x.shape[0], -1), cache.end, self.kpool, self.topk)
        q = self.wq_b(q_resid).unflatten(-1, (self.heads, self.head_dim))
        weights = self.weights_proj(x).float() * self.heads ** -0.5
        if cache.backend == "triton":  # scoring, top-k, expansion and the tail in two kernels
            from indexpool.kernels import index_topk

            pooled, scale = cache.index.stored(slot)
            return index_topk(q, weights, pooled, cache.positions, self.kpool, self.topk, scale)
        scores = score_pools(q, weights, cache.index.pooled(slot), cache.positions, self.kpool)
        return select_tokens(scores, cache.positions, cache.end, self.kpool, self.topk)


class MultiLatentAttention(nn.Module):
    """MLA with NoPE and a q LoRA: queries from q_b(norm(q_a(x))), keys and values from the normalised latent
    norm(kv_a(x)) (width kv_lora_rank), which is all the cache keeps. Attention is over the indexer's selection."""

    def __init__(self, config: Glm5NextConfig, layer: int, index_slot: int | None, source_layer: int):
        """layer: this layer's MLA slot in its cache; index_slot: its slot in the pooled index cache, None when it
        has no indexer and attends over the selection of `source_layer`."""
        super().__init__()
        self.layer, self.index_slot, self.source_layer = layer, index_slot, source_layer
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.heads, self.nope, self.v_dim = heads, config.qk_nope_head_dim, config.v_head_dim
        self.rank, self.eps = config.kv_lora_rank, config.rms_norm_eps
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.Parameter(torch.empty(config.q_lora_rank))
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.nope, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.empty(self.rank))
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.indexer = Indexer(config) if index_slot is not None else None
        self.scale = self.nope ** -0.5

    def forward(self, x: torch.Tensor, cache: Glm5NextCache) -> torch.Tensor:
        B, T, _ = x.shape
        q_resid = rms_norm(self.q_a_proj(x), self.q_a_layernorm, self.eps)
        q = self.q_b_proj(q_resid).unflatten(-1, (self.heads, self.nope))
        latents = cache.append_latents(self.layer, rms_norm(self.kv_a_proj_with_mqa(x), self.kv_a_layernorm, self.eps))
        if self.indexer is not None:
            cache.selected[self.layer] = self.indexer.select(x, q_resid, cache, self.index_slot)
        selected = cache.selected[self.source_layer]
        # The kernel reads each query's own selection: prefill runs in the latent form too, with no O(T x L) mask.
        if cache.decode_form or cache.backend == "triton":
            mixed = self.attend_latent(q, latents, selected, cache.backend)
        else:
            mixed = self.attend_expanded(q, latents, selected)
        return self.o_proj(mixed.reshape(B, T, -1))

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head into the key part (H, nope, R) and the value part (H, v_dim, R)."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def attend_latent(self, q: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor, backend: str) -> torch.Tensor:
        """The decode form: q . (W_uk c) = (W_uk^T q) . c, so scores and the weighted sum run on the selected
        latents c (width R) and W_uv is applied once to the result. q (B, T, H, nope) -> (B, T, H, v_dim).
        On the Triton backend the middle part is `kernels.mla_sparse_attention`; the torch branch is kept here rather
        than calling that op's reference, whose module imports Triton (a torch run never does)."""
        w_uk, w_uv = self._up_projections()
        q_latent = torch.einsum("bthd,hdr->bthr", q, w_uk)
        if backend == "triton":
            from indexpool.kernels import mla_sparse_attention

            mixed = mla_sparse_attention(q_latent, latents, selected, self.scale)
        else:
            B, T, W = selected.shape
            gathered = latents.gather(1, selected.clamp(min=0).view(B, T * W, 1).expand(-1, -1, self.rank))
            gathered = gathered.view(B, T, W, self.rank)
            scores = torch.einsum("bthr,btwr->bthw", q_latent, gathered).float() * self.scale
            scores = scores.masked_fill((selected < 0)[:, :, None, :], float("-inf"))
            mixed = torch.einsum("bthw,btwr->bthr", scores.softmax(dim=-1).to(q.dtype), gathered)
        return torch.einsum("bthr,hvr->bthv", mixed, w_uv)

    def attend_expanded(self, q: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """The prefill form: keys and values of every cached token expanded per head, one boolean mask from the
        selection. Returns (B, T, H, v_dim)."""
        B, L, _ = latents.shape
        k, v = self.kv_b_proj(latents).view(B, L, self.heads, -1).split([self.nope, self.v_dim], dim=-1)
        # Padding (-1) goes to an extra column that is then dropped.
        mask = torch.zeros(B, selected.shape[1], L + 1, dtype=torch.bool, device=q.device)
        mask.scatter_(-1, selected.masked_fill(selected < 0, L), True)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask[:, None, :, :L], scale=self.scale)
        return out.transpose(1, 2)


class DenseMLP(nn.Module):
    def __init__(self, config: Glm5NextConfig, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Sigmoid scores; experts chosen by score + correction bias (noaux_tc) within the best groups (a group's
    worth is its two best biased scores); weights are the unbiased scores, normalised, times routed scaling."""

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.n_routed_experts))
        self.config = config

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, D) -> expert weights (N, k) fp32 and expert indices (N, k)."""
        c = self.config
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores + self.e_score_correction_bias.float()
        grouped = biased.view(-1, c.n_group, c.n_routed_experts // c.n_group)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
        in_best = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        biased = grouped.masked_fill(~in_best[..., None], float("-inf")).flatten(1)
        indices = biased.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, indices)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, indices


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: gate/up (E, I, D), down (E, D, I)."""

    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, D))
        self.up_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in indices.unique().tolist():
            token, slot = (indices == expert).nonzero(as_tuple=True)
            h = x[token]
            y = swiglu(h @ self.gate_proj[expert].T, h @ self.up_proj[expert].T, self.limit) @ self.down_proj[expert].T
            out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: Glm5NextConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = DenseMLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        return self.experts(flat, weights, indices).view_as(x) + self.shared_experts(x)


def make_mlp(config: Glm5NextConfig, kind: str) -> nn.Module:
    return MoE(config) if kind == "sparse" else DenseMLP(config, config.intermediate_size)


class DecoderLayer(nn.Module):
    """Attention (KDA or MLA) then MLP, each between an mHC collapse of the streams and an mHC merge back."""

    def __init__(self, config: Glm5NextConfig, layer: int):
        super().__init__()
        self.config = config
        D, N = config.hidden_size, config.hc_mult
        if config.layer_types[layer] == KDA:
            self.self_attn = KimiDeltaAttention(config, layer)
        else:
            full = config.indexer_types[layer] == "full"
            index_slot = config.indexer_layers.index(layer) if full else None
            self.self_attn = MultiLatentAttention(config, layer, index_slot, config.selection_source(layer))
        self.mlp = make_mlp(config, config.mlp_layer_types[layer])
        self.input_layernorm = nn.Parameter(torch.empty(D))
        self.post_attention_layernorm = nn.Parameter(torch.empty(D))
        mix_width = (2 + N) * N
        for block in ("attn", "ffn"):
            self.register_parameter(f"hc_{block}_fn", nn.Parameter(torch.empty(mix_width, N * D)))
            self.register_parameter(f"hc_{block}_base", nn.Parameter(torch.empty(mix_width)))
            self.register_parameter(f"hc_{block}_scale", nn.Parameter(torch.empty(3)))

    def forward(self, streams: torch.Tensor, cache: Glm5NextCache) -> torch.Tensor:
        """streams (B, T, N, D) -> (B, T, N, D)."""
        eps = self.config.rms_norm_eps
        post, comb, x = hyper_connection(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.config)
        streams = hyper_merge(self.self_attn(rms_norm(x, self.input_layernorm, eps), cache), streams, post, comb)
        post, comb, x = hyper_connection(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.config)
        return hyper_merge(self.mlp(rms_norm(x, self.post_attention_layernorm, eps)), streams, post, comb)


class SharedHead(nn.Module):
    def __init__(self, config: Glm5NextConfig, own_head: bool):
        super().__init__()
        self.norm = nn.Parameter(torch.empty(config.hidden_size))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    """The multi-token-prediction layer (checkpoint layer `num_hidden_layers`). At position t it reads the
    embedding of token t+1 (zeroed at position 0) and the main model's final hidden state h_t:
    eh_proj([enorm(e); hnorm(h)]), one decoder layer with plain residuals (no mHC: the checkpoint has no hc
    weights) -- MLA with its own indexer, then the last layers' MLP kind -- and shared_head.norm. Its logits
    predict token t+2 through the main lm_head unless the checkpoint gives shared_head.head."""

    def __init__(self, config: Glm5NextConfig, own_head: bool = False):
        super().__init__()
        D = config.hidden_size
        self.layer = config.num_hidden_layers
        self.config = config
        self.enorm = nn.Parameter(torch.empty(D))
        self.hnorm = nn.Parameter(torch.empty(D))
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.input_layernorm = nn.Parameter(torch.empty(D))
        self.self_attn = MultiLatentAttention(config, 0, 0, 0)  # its own cache's only MLA and indexer layer
        self.post_attention_layernorm = nn.Parameter(torch.empty(D))
        self.mlp = make_mlp(config, config.mlp_layer_types[-1])
        self.shared_head = SharedHead(config, own_head)

    def forward(self, embedded_next: torch.Tensor, hidden: torch.Tensor, cache: Glm5NextCache) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        embedded_next = embedded_next.masked_fill((cache.positions == 0)[None, :, None], 0)
        x = self.eh_proj(torch.cat([rms_norm(embedded_next, self.enorm, eps), rms_norm(hidden, self.hnorm, eps)], -1))
        x = x + self.self_attn(rms_norm(x, self.input_layernorm, eps), cache)
        x = x + self.mlp(rms_norm(x, self.post_attention_layernorm, eps))
        return rms_norm(x, self.shared_head.norm, eps)


# Parameters kept in fp32 whatever the model dtype, as the reference keeps them.
FP32_PARAMETERS = ("e_score_correction_bias", "q_conv1d", "k_conv1d", "v_conv1d", "dt_bias", "A_log",
                   "hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")


class Glm5NextModel(nn.Module):
    """The text model. forward(tokens, start, cache) follows the engine's model protocol (`model/llama.py`)."""

    def __init__(self, config: Glm5NextConfig, with_mtp: bool = False, mtp_own_head: bool = False):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = MTPLayer(config, mtp_own_head) if with_mtp else None
        self.load_notes: list[str] = []  # what the loader skipped or could not use, for the user

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def keep_fp32_parameters(self) -> "Glm5NextModel":
        for name, p in self.named_parameters():
            if name.rsplit(".", 1)[-1] in FP32_PARAMETERS:
                p.data = p.data.float()
        return self

    def new_cache(self, max_length: int, batch_size: int = 1, index_dtype: torch.dtype = torch.bfloat16,
                  rewindable: bool = False) -> Glm5NextCache:
        ape = [self.layers[i].self_attn.indexer.index_kpool_compress_ape for i in self.config.indexer_layers]
        return Glm5NextCache(self.config, self.config.layer_types, ape, max_length, batch_size, self.dtype,
                             index_dtype, self.embed_tokens.weight.device, rewindable)

    def new_mtp_cache(self, max_length: int, batch_size: int = 1,
                      index_dtype: torch.dtype = torch.bfloat16) -> Glm5NextCache:
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (the checkpoint has none, or it was loaded without it)")
        ape = [self.mtp.self_attn.indexer.index_kpool_compress_ape]
        return Glm5NextCache(self.config, [MLA], ape, max_length, batch_size, self.dtype, index_dtype,
                             self.embed_tokens.weight.device)

    def hidden_states(self, tokens: torch.Tensor, start: int, cache: Glm5NextCache) -> torch.Tensor:
        """Final normalised hidden states (B, T, D) of tokens (B, T) at positions [start, start + T)."""
        cache.begin(start, tokens.shape[1])
        streams = self.embed_tokens(tokens)[:, :, None, :].expand(-1, -1, self.config.hc_mult, -1)
        for layer in self.layers:
            streams = layer(streams, cache)
        return rms_norm(streams.mean(dim=2), self.norm, self.config.rms_norm_eps)

    def forward(self, tokens: torch.Tensor, start: int, cache: Glm5NextCache, all_logits: bool = False) -> torch.Tensor:
        """fp32 logits (B, T, V) for tokens (B, T) at positions [start, start + T), or (B, 1, V) for the last."""
        hidden = self.hidden_states(tokens, start, cache)
        return self.lm_head(hidden if all_logits else hidden[:, -1:]).float()

    def mtp_logits(self, next_tokens: torch.Tensor, hidden: torch.Tensor, start: int,
                   cache: Glm5NextCache) -> torch.Tensor:
        """MTP logits (B, T, V) fp32 at positions [start, start + T): next_tokens (B, T) are the tokens at t + 1,
        hidden (B, T, D) the main model's hidden states at t. The logits predict the tokens at t + 2."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (the checkpoint has none, or it was loaded without it)")
        cache.begin(start, next_tokens.shape[1])
        out = self.mtp(self.embed_tokens(next_tokens), hidden, cache)
        head = self.lm_head if self.mtp.shared_head.head is None else self.mtp.shared_head.head
        return head(out).float()


# ------------------------------------------------------------------------------------ speculative decoding

@dataclass
class SpeculativeStats:
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _check_prompt(model: Glm5NextModel, prompt: list[int], max_new_tokens: int) -> None:
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if min(prompt) < 0 or max(prompt) >= model.config.vocab_size:
        raise ValueError(f"token ids must be in [0, {model.config.vocab_size})")


@torch.inference_mode()
def greedy_generate(model: Glm5NextModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one token per forward: the reference for `speculative_generate`."""
    _check_prompt(model, prompt, max_new_tokens)
    device = model.embed_tokens.weight.device
    cache = model.new_cache(len(prompt) + max_new_tokens)
    logits = model(torch.tensor([prompt], device=device), 0, cache)
    out = [int(logits[0, -1].argmax())]
    while len(out) < max_new_tokens:
        logits = model(torch.tensor([[out[-1]]], device=device), len(prompt) + len(out) - 1, cache)
        out.append(int(logits[0, -1].argmax()))
    return out


@torch.inference_mode()
def speculative_tokens(model: Glm5NextModel, prompt: list[int], max_new_tokens: int,
                       stats: SpeculativeStats | None = None, segment: int = 512,
                       on_prefill_progress: Callable[[int, int], None] | None = None) -> Iterator[int]:
    """Greedy decoding with the MTP layer drafting one token, yielding each token as it is confirmed: the main
    model checks [last token, draft] in one forward, keeps the draft when its own choice agrees (and gains the next
    token too), else drops it and rewinds its cache by one. The MTP layer only ever sees confirmed tokens. The
    tokens are `greedy_generate`'s. The prompt is read in segments of `segment` tokens (the MTP layer reading each
    after the main model), calling on_prefill_progress(done, total) after each."""
    _check_prompt(model, prompt, max_new_tokens)
    stats = stats if stats is not None else SpeculativeStats()
    device = model.embed_tokens.weight.device
    capacity = len(prompt) + max_new_tokens + 2
    cache, mtp_cache = model.new_cache(capacity, rewindable=True), model.new_mtp_cache(capacity)
    tokens = torch.tensor([prompt], device=device)
    n = len(prompt)
    for start in range(0, n, segment):
        end = min(n, start + segment)
        hidden = model.hidden_states(tokens[:, start:end], start, cache)
        if end < n:  # the MTP layer reads each position with the token after it
            model.mtp_logits(tokens[:, start + 1 : end + 1], hidden, start, mtp_cache)
        if on_prefill_progress:
            on_prefill_progress(end, n)
    new = [int(model.lm_head(hidden[0, -1]).argmax())]
    next_tokens = torch.cat([tokens[:, start + 1 :], torch.tensor([new], device=device)], dim=1)
    draft = int(model.mtp_logits(next_tokens, hidden, start, mtp_cache)[0, -1].argmax())
    position, produced = n, 0  # position: of new[-1], the newest token, not yet fed to the main model
    while True:
        for token in new[: max_new_tokens - produced]:
            yield token
        produced += len(new)
        if produced >= max_new_tokens:
            return
        hidden = model.hidden_states(torch.tensor([[new[-1], draft]], device=device), position, cache)
        choices = model.lm_head(hidden[0]).argmax(-1).tolist()
        stats.drafted += 1
        if choices[0] == draft:
            stats.accepted += 1
            new = choices
        else:
            new = choices[:1]
            cache.truncate(position + 1)
        draft_logits = model.mtp_logits(torch.tensor([new], device=device), hidden[:, :len(new)], position, mtp_cache)
        draft = int(draft_logits[0, -1].argmax())
        position += len(new)


def speculative_generate(model: Glm5NextModel, prompt: list[int],
                         max_new_tokens: int) -> tuple[list[int], SpeculativeStats]:
    """All of `speculative_tokens`, and how many drafts were made and kept."""
    stats = SpeculativeStats()
    return list(speculative_tokens(model, prompt, max_new_tokens, stats)), stats
