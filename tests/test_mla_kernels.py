"""glm5_next's sparse MLA attention kernel (`kernels/mla_attention.py`) against its torch reference, and the model's
logits with the kernel (INDEXPOOL_KERNELS=triton) against its torch paths.

Without a GPU the kernel runs in Triton's CPU interpreter: TRITON_INTERPRET=1 must be set before Triton is
imported, which tests/test_kernels.py does (or skips, saying why), so it is imported first. Shapes are small and
awkward: selections not a multiple of the 32-latent block, fewer than one block, head counts padded to 16 and 32 or
split over two head blocks, a latent width that is not a power of two, -1 anywhere in a row, positions past the
latents, a query that selects nothing, selections split over programs and merged.
"""

from test_kernels import DEVICE, one_ulp  # first: it sets TRITON_INTERPRET before Triton is imported

import pytest
from kernel_setting import use_kernels
import torch

from indexpool import kernels
from indexpool.kernels import mla_sparse_attention, mla_sparse_attention_reference
from indexpool.kernels.kda import kda_recurrent
from indexpool.model import glm5_next
from indexpool.model.glm5_next_loader import load_glm5_next
from test_glm5_next import N_TOKENS, logits, max_diff
from tests.tiny_glm5_next import VOCAB, build_checkpoint


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    use_kernels(monkeypatch, "triton")


def mla_inputs(batch, n_queries, heads, rank, n_tokens, n_selected, dtype, seed):
    """q_latent, latents and per-query selections: distinct positions in random order, about 1 in 5 set to -1,
    one past the latents, and the last query of the last batch row selecting nothing."""
    g = torch.Generator().manual_seed(seed)
    q_latent = torch.randn(batch, n_queries, heads, rank, generator=g).to(dtype)
    latents = torch.randn(batch, n_tokens, rank, generator=g).to(dtype)
    selected = torch.stack([torch.randperm(n_tokens, generator=g)[:n_selected]
                            for _ in range(batch * n_queries)]).view(batch, n_queries, n_selected)
    selected[torch.rand(selected.shape, generator=g) < 0.2] = -1
    if n_selected:
        selected[0, 0, 0] = n_tokens + 3
    selected[-1, -1] = -1
    return q_latent.to(DEVICE), latents.to(DEVICE), selected.to(DEVICE)


MLA_CASES = {
    # name: (batch, queries T, heads H, rank R, latents L, selected N, dtype, kv splits)
    "decode fp32": (2, 1, 8, 64, 300, 100, torch.float32, None),
    "decode fp32 split": (2, 1, 8, 64, 300, 130, torch.float32, 3),
    "decode bf16 split": (2, 1, 8, 64, 300, 130, torch.bfloat16, 3),
    "prefill bf16": (2, 5, 6, 32, 200, 70, torch.bfloat16, None),
    "prefill fp16 20 heads R=48 split": (1, 3, 20, 48, 120, 45, torch.float16, 2),
    "prefill bf16 40 heads": (1, 2, 40, 32, 100, 40, torch.bfloat16, None),
    "fewer than a block fp32": (2, 4, 4, 32, 50, 5, torch.float32, None),
}


@pytest.mark.parametrize("case", MLA_CASES)
def test_mla_sparse_attention_matches_reference(case):
    batch, n_queries, heads, rank, n_tokens, n_selected, dtype, splits = MLA_CASES[case]
    q_latent, latents, selected = mla_inputs(batch, n_queries, heads, rank, n_tokens, n_selected, dtype, seed=1)
    scale = rank**-0.5
    out = mla_sparse_attention(q_latent, latents, selected, scale, kv_splits=splits)
    expected = mla_sparse_attention_reference(q_latent, latents, selected, scale)
    assert out.dtype == dtype and out.shape == (batch, n_queries, heads, rank)
    assert (out[-1, -1] == 0).all() and (expected[-1, -1] == 0).all()  # selects nothing: zeros, not NaN
    if dtype == torch.float32:
        # fp32 throughout: logits, exp2 against exp, and sums in another order; a few fp32 ulps of the output.
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    # Both use the same dtype operands and fp32 logits. The kernel rounds each unnormalised softmax weight p <= 1
    # to the dtype for weights @ latents: relative error <= eps / 2, or below the dtype's normal range (fp16 under
    # 2**-14) absolute error <= half the subnormal step; the weights sum to >= 1 before normalising, so the output
    # moves by at most (eps / 2 + N * subnormal step / 2) * max|c|. Both round the output (one step apart at most),
    # and 1e-5 covers the fp32 differences above.
    info = torch.finfo(dtype)
    weights_bound = (info.eps / 2 + n_selected * info.smallest_normal * info.eps / 2) * latents.float().abs().max()
    bound = weights_bound + one_ulp(expected, dtype) + 1e-5
    assert ((out.float() - expected.float()).abs() <= bound).all()


@pytest.mark.parametrize("n_selected", [0, 40])
def test_mla_sparse_attention_with_nothing_selected_is_zero(n_selected):
    q_latent, latents, selected = mla_inputs(2, 3, 4, 16, 50, n_selected, torch.bfloat16, seed=2)
    selected[:] = -1
    for splits in (None, 2):
        out = mla_sparse_attention(q_latent, latents, selected, 0.25, kv_splits=splits)
        assert out.shape == (2, 3, 4, 16) and (out == 0).all()
    assert (mla_sparse_attention_reference(q_latent, latents, selected, 0.25) == 0).all()


def test_mla_sparse_attention_rejects_bad_input():
    q_latent, latents, selected = mla_inputs(1, 2, 4, 16, 30, 8, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match=r"latents must be \(1, tokens, 16\) in torch.bfloat16"):
        mla_sparse_attention(q_latent, latents.float(), selected, 0.25)
    with pytest.raises(ValueError, match=r"selected must be integer positions \(1, 2, N\)"):
        mla_sparse_attention(q_latent, latents, selected.float(), 0.25)
    with pytest.raises(ValueError, match="kv_splits must be >= 1"):
        mla_sparse_attention(q_latent, latents, selected, 0.25, kv_splits=0)


def test_glm5_next_logits_on_the_kernel_are_the_torch_paths(tmp_path, monkeypatch):
    """150 tokens as a 97-token prefill, a 45-token segment, then 8 single-token decode steps: on the torch
    backend the segments expand keys and values under a mask and decode runs attend_latent in torch; on the Triton
    backend every MLA forward goes through the kernel (and KDA through its own), with the indexer dropping tokens
    and selecting through `kernels.index_topk`.
    The model is tests/test_glm5_next.py's (kpool 4, topk 16: 19 positions per query), in fp32; that file checks
    the torch paths against transformers."""
    build_checkpoint(tmp_path)
    model = load_glm5_next(tmp_path, torch.float32).to(DEVICE)
    ids = torch.randint(0, VOCAB, (1, N_TOKENS), generator=torch.Generator().manual_seed(7))
    kernel, calls = kernels.mla_sparse_attention, []

    def recording_kernel(q_latent, latents, selected, scale):
        calls.append((q_latent.shape[1], latents.shape[1], selected))
        return kernel(q_latent, latents, selected, scale)

    monkeypatch.setattr(kernels, "mla_sparse_attention", recording_kernel)
    topk_kernel, selections = kernels.index_topk, []

    def checked_topk(*args):  # the indexer's Triton selection, against its reference on the model's own inputs
        chosen = topk_kernel(*args)
        selections.append(torch.equal(chosen, kernels.index_topk_reference(*args)))
        return chosen

    monkeypatch.setattr(kernels, "index_topk", checked_topk)
    # On a GPU chunk_kda's dots are TF32 by design (kernels/kda.py; its own bound in tests/test_kda_kernels.py), and
    # a TF32-sized change to a hidden state can swap a near-tied token in or out of an indexer's top-k, which moves
    # that query's logits by whole units (1.9 on an H200; with this change the test passes there): the prefill's KDA
    # runs fla's fp32 recurrent kernel instead, as it does in the interpreter, so that both paths are fp32 throughout.
    monkeypatch.setattr(glm5_next, "kda_chunked", lambda *inputs: kda_recurrent(*inputs)[:2])
    results = {}
    for backend in ("torch", "triton"):
        use_kernels(monkeypatch, backend)
        results[backend] = logits(model, ids.to(DEVICE), [97, 45, 1]).cpu()
    assert sorted({n_queries for n_queries, _, _ in calls}) == [1, 45, 97]  # only the Triton run calls it
    assert len(calls) == 2 * 10  # two MLA layers, ten forwards
    assert selections and all(selections)  # the indexer scored and selected on the kernels, as its reference does
    # The last query of a forward sees all of its 97 or more cached tokens; it selects at most 19 of them.
    assert all(int((selected[:, -1] >= 0).sum()) < n_tokens for _, n_tokens, selected in calls)
    # fp32 on both paths, which differ in association and summation order only (q . (W_uk c) against
    # (W_uk^T q) . c, SDPA against the kernel's online softmax; the KDA kernels against the torch recurrence):
    # measured 5.4e-6 (2.8e-6 with the KDA layers in torch) on logits of magnitude up to 4.3; 2e-5 is the bar
    # both paths meet against transformers (tests/test_glm5_next.py).
    assert max_diff(results["triton"], results["torch"]) <= 2e-5
