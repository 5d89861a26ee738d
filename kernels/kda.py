"""KDA (Kimi Delta Attention), glm5_next's linear attention: a delta-rule state per head decaying per key channel.

Per head, with the state S (dk, dv) and per token: S <- diag(exp g) S; S <- S + k (beta (v - S^T k))^T;
o = S^T q. g (<= 0) is a log-decay per key channel, beta in (0, 1) per head. q and k are L2-normalised,
x / sqrt(sum x^2 + 1e-6) (eps inside the root), and q is scaled by dk^-0.5; all of it in fp32, the state too.

Two forms of the one recurrence, each a public op next to its plain torch `*_reference` (also the CPU path):
  - `kda_recurrent`: a token at a time (decode), optionally keeping the state after each token, so that a rejected
    speculative draft can be rewound;
  - `kda_chunked`: 64 tokens at a time (prefill), a triangular solve within each chunk.

The Triton path is flash-linear-attention's kernels (`fla-core`, imported only when that path runs):
`fused_recurrent_kda` and `chunk_kda` compute this recurrence in these layouts ((B, T, H, D) inputs, an fp32
(B, H, dk, dv) state), so we depend on them rather than keep kernels of our own. The inputs are normalised and
scaled here (fla is given scale 1) so that both paths start from the same fp32 operands. The one thing fla's
public ops lack, the per-token states, comes from its recurrent kernel's continuous-batching mode (vLLM's
speculative decoding), which stores the state after each token in a slot of a pool.

Numerics: the recurrent kernel is fp32 throughout, as the reference (they differ by summation order only).
chunk_kda's tensor-core dots take fp32 operands as TF32 on NVIDIA GPUs (a 10-bit mantissa). In Triton's CPU
interpreter chunk_kda cannot run (its autotuner times its configurations through a GPU driver, and one kernel calls
.to() on a loop index that the interpreter hands out as a Python int), so there the prefill runs the recurrent
kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import check_launchable, kernel_backend, triton_interpreting

KDA_CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps): eps inside the root, as the KDA kernels compute it."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _kda_inputs(q, k, v, g, beta):
    """fp32 copies, q and k L2-normalised per head, q scaled by 1/sqrt(head_dim)."""
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def kda_recurrent_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, keep_steps: bool = False):
    """KDA one token at a time: the reference semantics and the decode form.

    q, k (B, T, H, dk); v (B, T, H, dv); g (B, T, H, dk) log-decay per key channel (<= 0); beta (B, T, H);
    state (B, H, dk, dv) fp32. Per token: S <- diag(exp g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.
    Returns o (B, T, H, dv) fp32, the final state, and (when keep_steps) the state after each token.
    """
    q, k, v, g, beta = _kda_inputs(q, k, v, g, beta)
    outputs, steps = [], []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]
        remembered = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = beta[:, t, :, None] * (v[:, t] - remembered)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        if keep_steps:
            steps.append(state)
    return torch.stack(outputs, dim=1), state, steps


def kda_chunked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, chunk: int = KDA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence as `kda_recurrent_reference`, a chunk of tokens at a time (the prefill form).

    Within a chunk, with G the running sum of g from the chunk start, the state before it S0 and the per-token
    updates d_t = beta_t (v_t - (S_{t-1} decayed)^T k_t), the recurrence unrolls to a unit lower-triangular system
    (I + A) D = beta (V - (K exp G) S0), A[t, s] = beta_t sum_c k_tc k_sc exp(G_tc - G_sc) for s < t. Then
    O = (Q exp G) S0 + M D with M[t, s] = sum_c q_tc k_sc exp(G_tc - G_sc) for s <= t, and the next state is
    exp(G_last) S0 + (K exp(G_last - G))^T D. Only differences G_t - G_s (t >= s) are exponentiated: no overflow.
    Padding the last chunk with k = v = beta = g = 0 leaves the state unchanged.
    """
    q, k, v, g, beta = _kda_inputs(q, k, v, g, beta)
    B, T, H, dk = k.shape
    pad = -T % chunk

    def split(x):  # (B, T, H, ...) -> (B, H, n_chunks, chunk, ...)
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(B, -1, chunk, H, *x.shape[3:]).transpose(1, 3)
        return x.transpose(2, 3)

    q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
    G = g.cumsum(dim=-2)
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # s > t
    decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(later[..., None], float("-inf")).exp()
    A = (beta[..., None] * torch.einsum("...tc,...sc,...tsc->...ts", k, k, decay)).tril(-1)
    M = torch.einsum("...tc,...sc,...tsc->...ts", q, k, decay)
    system = A + torch.eye(chunk, device=q.device)
    U = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, beta[..., None] * k * G.exp(), upper=False, unitriangular=True)
    outputs = []
    for c in range(q.shape[2]):
        deltas = U[:, :, c] - W[:, :, c] @ state
        outputs.append((q[:, :, c] * G[:, :, c].exp()) @ state + M[:, :, c] @ deltas)
        last = G[:, :, c, -1]
        decayed_keys = k[:, :, c] * (last[:, :, None] - G[:, :, c]).exp()
        state = last.exp()[..., None] * state + decayed_keys.transpose(-1, -2) @ deltas
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :T]  # (B, H, T, dv)
    return out.transpose(1, 2), state


def _fla_recurrent(q, k, v, g, beta, state, keep_steps: bool):
    """fla's recurrent kernel on prepared inputs (`_kda_inputs`): (o, final state, per-token states or [])."""
    from fla.ops.kda import fused_recurrent_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd, fused_recurrent_kda_fwd_kernel

    check_launchable(fused_recurrent_kda_fwd_kernel.fn, q.device)
    if not keep_steps:
        out, final = fused_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True)
        return out, final, []
    # The public op returns the last state only. In continuous-batching mode the kernel reads sequence n's initial
    # state from pool slot slots[n, 0] and writes its state after token t to slot slots[n, t].
    B, T, H, dk = q.shape
    pool = state.new_empty(B, T, H, dk, v.shape[-1])
    pool[:, 0] = state
    slots = torch.arange(B * T, dtype=torch.int32, device=q.device).view(B, T)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # the internal entry does not ensure it
    out, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool.view(B * T, H, dk, -1), scale=1.0,
                                     inplace_final_state=True, ssm_state_indices=slots)
    steps = list(pool.unbind(1))
    return out, steps[-1], steps


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, keep_steps: bool = False):
    """`kda_recurrent_reference`'s arguments and results; fla's `fused_recurrent_kda` on the Triton backend."""
    if kernel_backend(q.device) == "torch":
        return kda_recurrent_reference(q, k, v, g, beta, state, keep_steps)
    return _fla_recurrent(*_kda_inputs(q, k, v, g, beta), state, keep_steps)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_chunked_reference`'s arguments and results; fla's `chunk_kda` on the Triton backend."""
    if kernel_backend(q.device) == "torch":
        return kda_chunked_reference(q, k, v, g, beta, state)
    inputs = _kda_inputs(q, k, v, g, beta)
    if triton_interpreting():  # chunk_kda cannot run there (module docstring)
        out, final, _ = _fla_recurrent(*inputs, state, keep_steps=False)
        return out, final
    from fla.ops.kda import chunk_kda

    return chunk_kda(*inputs, scale=1.0, initial_state=state, output_final_state=True)
