"""Several continuations of one document, decoded as one batch over a shared IndexPool cache.

Eight questions on one document are eight branches: the document's tokens (the prefix) stay in the base
`IndexPoolCache`, read-only, and each branch keeps its own tokens after it (its question, then its answer) in a
small exact buffer, rotated at their true positions. One forward feeds every live branch its next token (tokens
(B, 1)), so the weights, the window's keys and Python's per-op cost are paid once per step instead of once per
branch.

Each branch attends exactly as the base cache would if it held that branch alone: the same window start, the same
far selection (the indexer scores each branch's query only over the pools before its own window; its question's
pools, `IndexPoolCache.read_question`, first), the same window positions left out (its question's look-alikes), the
same remapped positions. That holds while a branch has fewer than `window - kpool` tokens of its own: its window
start then lies inside the document, so every far token it may select is a document token, already in the history
and the pooled index. `max_branch_tokens` says how many that is.

A branch's question is read by the base cache alone (`Session.generate_branches`: per-query selection as usual),
then its rotated K/V are copied into the branch's buffer (`take_branch`) and the base cache is truncated back to
the document.

Written and tested for the CPU (its bookkeeping tensors live there; attention goes through `attention_with_lse`);
a CUDA run of batched branches has not been made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from indexpool.kernels.cpu_attention import attention_with_lse, merge_attention
from indexpool.kernels.rope import apply_rope, rope_at

from .indexpool_cache import (AttentionEvidence, IndexPoolCache, additive_mask, far_attention, gathered_key_mass,
                              keep_question_pools, place_far_tokens)


def max_branch_tokens(base: IndexPoolCache) -> int:
    """Most tokens a branch may hold of its own (question + answer) and still select only document tokens."""
    return base.settings.window - base.settings.kpool


def bytes_per_branch(base: IndexPoolCache, capacity: int) -> int:
    """Memory one branch adds: its own K/V buffers, and its share of a layer's temporaries (gathered far K/V in
    the storage dtype and rotated, and their fp32 copies)."""
    config, s = base.config, base.settings
    width = config.n_kv_heads * config.head_dim
    own = 2 * config.n_layers * capacity * width * base.dtype.itemsize
    far = (s.sinks + s.topk) * width * 2 * (2 * base.dtype.itemsize + 4)
    return own + far


class IndexPoolBranches:
    """Decode-time cache for `n_branches` continuations of the tokens `base` holds (same begin/attend interface as
    the caches in model/llama.py, for forwards of one token per live branch)."""

    def __init__(self, base: IndexPoolCache, n_branches: int, capacity: int):
        if capacity > max_branch_tokens(base):
            raise ValueError(f"a branch may hold at most {max_branch_tokens(base)} tokens of its own, not {capacity}")
        self.base, self.prefix = base, base.length
        self.n_heads, self.n_kv_heads, self.head_dim = base.n_heads, base.n_kv_heads, base.head_dim
        config = base.config
        shape = (config.n_layers, n_branches, capacity, config.n_kv_heads, config.head_dim)
        self.own_k = torch.zeros(shape, dtype=base.dtype, device=base.inv_freq.device)  # rotated, true positions
        self.own_v = torch.zeros(shape, dtype=base.dtype, device=base.inv_freq.device)
        self.capacity = capacity
        self.lengths = torch.zeros(n_branches, dtype=torch.long)  # tokens of its own each branch holds
        self.live = torch.arange(n_branches)  # the branches the next forward feeds, in row order
        self.evidence: list[AttentionEvidence | None] = [None] * n_branches
        # Each question's pools and the positions its window leaves out (IndexPoolCache.read_question).
        self.question_pools: list[torch.Tensor | None] = [None] * n_branches
        self.question_hidden: list[torch.Tensor | None] = [None] * n_branches

    @property
    def max_length(self) -> int:
        return self.prefix + self.capacity

    def take_branch(self, branch: int) -> None:
        """Move what the base cache holds past the prefix (a branch's first tokens, just read) into `branch`'s
        buffer, and truncate the base cache back to the prefix."""
        base = self.base
        n = base.length - self.prefix
        if not 0 < n <= self.capacity:
            raise ValueError(f"a branch starts with 1 to {self.capacity} tokens, not {n}")
        held = slice(self.prefix - base.recent_start, base.length - base.recent_start)
        self.own_k[:, branch, :n] = base.recent_k[:, :, held].transpose(1, 2)
        self.own_v[:, branch, :n] = base.recent_v[:, :, held].transpose(1, 2)
        self.lengths[branch] = n
        self.question_pools[branch], self.question_hidden[branch] = base.question_pools, base.question_hidden
        base.truncate(self.prefix)

    def begin(self, start: int, length: int) -> None:
        """One token for each live branch, at the position after that branch's own tokens (`start` is unused:
        each branch has its own)."""
        if length != 1:
            raise ValueError("branches are fed one token each per forward")
        base, s = self.base, self.base.settings
        live = self.live
        if int(self.lengths[self.live].max()) >= self.capacity:
            raise ValueError(f"a branch is full ({self.capacity} tokens of its own)")
        self.own_slots = self.lengths[live].clone()  # where each live branch's token goes
        self.lengths[live] += 1
        self.positions = self.prefix + self.own_slots  # (B,)
        device = base.inv_freq.device
        self.cos, self.sin = rope_at(base.inv_freq, self.positions.to(device)[:, None])  # (B, 1, 1, D)
        self.ws = (self.positions - s.window).clamp_min(0) // s.kpool * s.kpool  # each branch's window start
        if int(self.ws.min()) < base.recent_start:
            raise ValueError("the document's window has left the base cache's recent buffer")
        self.n_sinks = self.ws.clamp(max=s.sinks)
        self.n_far = self.ws - self.n_sinks
        # Everything before the window is taken while it fits in topk; then it sits at its true positions while the
        # branch is inside the trained context (as in IndexPoolCache.begin), and in either case at 0..ws-1.
        self.takes_all = self.n_far <= s.topk
        n_attended = torch.where(self.takes_all, self.ws, self.n_sinks + s.short_topk())  # a step is a short forward
        width = int(n_attended.max())
        self.far_slots = torch.arange(width)
        self.far_valid = self.far_slots < n_attended[:, None]  # (B, N)
        placed = place_far_tokens(self.far_slots, self.ws[:, None], n_attended[:, None], self.n_sinks[:, None],
                                  base.sink_gap)
        cos, sin = rope_at(base.inv_freq, placed.to(device))  # (B, N, 1, D)
        half = self.head_dim // 2
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        self.far_cos, self.far_sin_signed = cos.to(base.dtype), sin_signed.to(base.dtype)
        self.far_rope_fp32 = cos[:, :, 0], sin_signed[:, :, 0]  # (B, N, D) each, for the C decode kernel
        # Additive masks, built once per step for every layer: invalid far slots; document window keys before a
        # branch's window start or left out by its question; own slots past a branch's current token.
        self.far_mask = None if bool(self.far_valid.all()) else additive_mask(~self.far_valid, device)[:, None, None, :]
        self.doc_window_start = int(self.ws.min())
        doc_positions = torch.arange(self.doc_window_start, self.prefix)
        self.doc_hidden = doc_positions[None, :] < self.ws[:, None]  # (B, W)
        for row, branch in enumerate(live.tolist()):
            if self.question_hidden[branch] is not None:
                self.doc_hidden[row] |= torch.isin(doc_positions, self.question_hidden[branch].cpu())
        group = self.n_heads // self.n_kv_heads
        self.doc_mask = None if not bool(self.doc_hidden.any()) else \
            additive_mask(self.doc_hidden, device).repeat_interleave(group, dim=0)[None, None]  # (1, 1, B * group, W)
        self.own_mask = additive_mask(torch.arange(self.capacity)[None, :] > self.own_slots[:, None],
                                  device)[:, None, None, :]
        # The bookkeeping above stays on the CPU (read as Python ints); what meets the model's tensors, on its device.
        self.taken = torch.where(self.far_valid & self.takes_all[:, None], self.far_slots, 0).to(device)
        self.on_device = {name: getattr(self, name).to(device)
                          for name in ("takes_all", "far_valid", "positions")}
        tracked = [e for e in self.evidence if e is not None]
        if len({e.local_band for e in tracked}) > 1:
            raise ValueError("the branches' evidence must share one local band")
        self.local_band = tracked[0].local_band if tracked else None
        for branch in live.tolist():
            if self.evidence[branch] is not None:
                self.evidence[branch].queries += 1
        self.selections: dict[int, torch.Tensor] = {}
        self.layer_scores = None

    def _select(self, layer: int, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Far positions (B, N) of each live branch: sinks then its selected pools' tokens, or everything before
        its window (padded where far_valid is False), ascending."""
        base, s = self.base, self.base.settings
        source = base.sources[layer]
        if source != layer:
            return self.selections[source]
        B = q.shape[0]
        taken = self.taken  # everything before ws
        if bool(self.takes_all.all()):
            return taken
        first_pool = s.sinks // s.kpool  # branches that select have ws > sinks + topk: all sinks are in
        end_pools = self.ws // s.kpool  # (B,)
        pooled = base.scored_pools(base.index, base.indexer, layer, first_pool, int(end_pools.max()))
        index_q, weights = base.indexer.queries(layer, x, q)  # (B, 1, ...): each branch's one query
        limits = (end_pools - first_pool).clamp_min(0).view(1, B).to(pooled.device)
        scores = base.indexer.score(layer, index_q.transpose(0, 1), weights.transpose(0, 1), pooled, limits)[0]
        if s.cumulative_scores:  # as IndexPoolCache._select ranks a query's pools
            scores = self.layer_scores = scores if self.layer_scores is None else self.layer_scores + scores
        kept = [(row, self.question_pools[branch]) for row, branch in enumerate(self.live.tolist())
                if self.question_pools[branch] is not None]
        if kept:
            scores = scores.clone()  # layer_scores stays the plain sum
            for row, pools in kept:
                scores[row] = keep_question_pools(scores[row], pools - first_pool)
        pools = scores.topk(s.short_topk() // s.kpool, dim=-1, sorted=False).indices
        pools = pools.sort(dim=-1).values + first_pool  # (B, topk/kpool)
        device = pools.device
        chosen = torch.cat([torch.arange(s.sinks, device=device).expand(B, -1),
                            (pools[..., None] * s.kpool + torch.arange(s.kpool, device=device)).flatten(-2)], dim=-1)
        chosen = F.pad(chosen, (0, taken.shape[1] - chosen.shape[1]))
        return torch.where(self.on_device["takes_all"][:, None], taken, chosen)

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """qk (B, 1, H + KV, D) unrotated, v (B, 1, KV, D): each live branch's next token. Attention over its far
        tokens, the document's part of its window (one kernel call for all branches: the keys are shared) and its
        own tokens, merged by their log-sum-exps as IndexPoolCache.attend merges its parts."""
        base = self.base
        B = qk.shape[0]
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        group = H // KV
        qk_rot = apply_rope(qk, self.cos, self.sin).to(base.dtype)[:, 0]  # (B, H + KV, D)
        slots = self.own_slots
        self.own_k[layer, self.live, slots] = qk_rot[:, H:]
        self.own_v[layer, self.live, slots] = v[:, 0]
        q = qk_rot[:, :H].view(B, KV, group, D)
        far = self._select(layer, x, qk[:, :, :H])
        self.selections[layer] = far
        parts, far_probs, evidence = [], None, self.local_band is not None
        if far.shape[1]:  # none while every window starts at 0
            # As IndexPoolCache.attend computes its far part, so both give the same logits.
            *far_part, far_probs = far_attention(base.store, layer, q, far, self.far_rope_fp32,
                                                 (self.far_cos, self.far_sin_signed), self.far_mask, evidence)
            parts.append(tuple(far_part))
        # The document's part of the window, from the earliest branch's window start to the prefix: every branch's
        # query rows against the same keys, each masked before its own window start.
        window = slice(self.doc_window_start - base.recent_start, self.prefix - base.recent_start)
        doc_k, doc_v = base.recent_k[None, layer, :, window], base.recent_v[None, layer, :, window]  # (1, KV, W, D)
        q_rows = q.transpose(0, 1).reshape(1, KV, B * group, D)  # rows branch-major within each KV head
        doc_out, doc_lse = attention_with_lse(q_rows, doc_k, doc_v, mask=self.doc_mask)
        parts.append((doc_out.view(KV, B, group, D).transpose(0, 1), doc_lse.view(KV, B, group).transpose(0, 1)))
        width = int(slots.max()) + 1
        own_k = self.own_k[layer, self.live, :width].transpose(1, 2)  # (B, KV, S, D)
        own_v = self.own_v[layer, self.live, :width].transpose(1, 2)
        parts.append(attention_with_lse(q, own_k, own_v, mask=self.own_mask[..., :width]))
        if evidence:
            lse = torch.stack([part_lse for _, part_lse in parts]).logsumexp(dim=0)  # (B, KV, group)
            self._add_evidence(q, lse, far, (far_probs, parts[0][1]) if far_probs is not None else None, doc_k[0])
        return merge_attention(parts).reshape(B, 1, H * D)

    def _add_evidence(self, q, lse, far, far_part, doc_k) -> None:
        """Each branch's attention probability per document token against the whole step's log-sum-exp, as
        IndexPoolCache._add_evidence: the far tokens' from their probabilities within the far part (far_part:
        probabilities, log-sum-exp), the window's from logits recomputed (bf16 products, fp32 after), leaving out
        the window's keys before the branch's window start or in the local band before its query."""
        B, KV, group, D = q.shape
        scale = D**-0.5
        device, band_end = far.device, self.on_device["positions"] - self.local_band
        far_mass = torch.zeros(far.shape, device=device) if far_part is None else \
            gathered_key_mass(*far_part, lse) * self.on_device["far_valid"]
        far_mass.masked_fill_(far > band_end[:, None], 0)  # a band reaching past the window
        q_rows = q.transpose(0, 1).reshape(KV, B * group, D)
        # Keys in every branch's local band are left out below: not computed at all.
        limit = max(self.doc_window_start, min(self.prefix, int(self.positions.max()) - self.local_band + 1))
        doc_k = doc_k[:, : limit - self.doc_window_start]
        doc_logits = (q_rows @ doc_k.transpose(-1, -2)).float().view(KV, B, group, -1).transpose(0, 1) * scale
        doc_mass = (doc_logits - lse[..., None]).exp().sum(dim=(1, 2))  # (B, W)
        doc_positions = torch.arange(self.doc_window_start, limit, device=device)
        hidden = self.doc_hidden[:, : limit - self.doc_window_start].to(device) | (doc_positions > band_end[:, None])
        positions = torch.cat([far, doc_positions.expand(B, -1)], dim=1)
        mass = torch.cat([far_mass, doc_mass.masked_fill_(hidden, 0)], dim=1)
        for row, branch in enumerate(self.live.tolist()):
            if self.evidence[branch] is not None:
                self.evidence[branch].add(positions[row], mass[row])

