"""KDA (`kernels/kda.py`): flash-linear-attention's kernels against our torch references, and glm5_next on them.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 set before Triton is imported, as in
tests/test_kernels.py, imported first). There only fla's recurrent kernel runs: chunk_kda cannot, so `kda_chunked` runs the
recurrent kernel instead, and chunk_kda's own test needs a GPU (benchmarks/gpu_kernels.py runs this file on one).
Shapes are small and awkward: T = 1, T not a multiple of fla's chunk of 64, batch 2, dk != dv, a head width that is
not a power of two (masked lanes), a nonzero initial state.
"""

from test_kernels import DEVICE  # first: it sets TRITON_INTERPRET before Triton is imported (or skips, saying why)

import pytest
from kernel_setting import use_kernels
import torch

from indexpool.kernels.kda import kda_chunked, kda_chunked_reference, kda_recurrent, kda_recurrent_reference
from indexpool.model.glm5_next_loader import load_glm5_next
from tests.tiny_glm5_next import VOCAB, build_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:Triton is not supported on current platform")  # fla on the CPU

# The recurrent kernel does the reference's fp32 operations in another order, and the update contracts (decay
# <= 1; I - beta k k^T with |k| = 1, 0 < beta < 1), so roundings do not build up over tokens: measured at most
# 2.4e-7, one ulp of the largest state values (~2). 1e-6 is 4 ulps there, room for a GPU's fused multiply-adds.
FP32 = dict(atol=1e-6, rtol=0)
# chunk_kda's dots take fp32 operands as TF32 on a GPU (10-bit mantissa, 4.9e-4 relative): about ten such
# roundings of values ~2. Not yet measured (no GPU in the session that wrote it).
TF32 = dict(atol=1e-2, rtol=0)
SHAPES = [(2, 1, 3, 16, 16), (2, 3, 2, 24, 8), (2, 70, 2, 16, 32)]  # (B, T, H, dk, dv)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    use_kernels(monkeypatch, "triton")


def kda_inputs(B: int, T: int, H: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k (not yet normalised), v, the log-decay g in glm5_next's range [-5, 0], beta, and a random state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, dk, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -5 * torch.sigmoid(2 * torch.randn(B, T, H, dk, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    state = torch.randn(B, H, dk, dv, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, state))


# Per-token states are kept for decode forwards only (at most DECODE_MAX_TOKENS tokens).
@pytest.mark.parametrize("shape, keep_steps", [(SHAPES[0], False), (SHAPES[0], True), (SHAPES[1], True),
                                               (SHAPES[2], False)])
def test_recurrent_matches_the_reference(shape, keep_steps):
    """fla's fused_recurrent_kda, and with keep_steps its continuous-batching mode's per-token states."""
    inputs = kda_inputs(*shape, seed=sum(shape))
    out, final, steps = kda_recurrent(*inputs, keep_steps=keep_steps)
    ref_out, ref_final, ref_steps = kda_recurrent_reference(*inputs, keep_steps=keep_steps)
    assert out.dtype == final.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(final, ref_final, **FP32)
    assert len(steps) == len(ref_steps)
    for step, ref_step in zip(steps, ref_steps):
        torch.testing.assert_close(step, ref_step, **FP32)


@pytest.mark.parametrize("shape", [*SHAPES, (1, 130, 2, 16, 16)])
def test_chunk_kda_matches_the_reference(shape):
    if DEVICE == "cpu":
        pytest.skip("needs a GPU: chunk_kda's autotuner times its configurations through a GPU driver, and one of "
                    "its kernels calls .to() on a loop index, a Python int in the interpreter")
    inputs = kda_inputs(*shape, seed=sum(shape))
    out, final = kda_chunked(*inputs)
    ref_out, ref_final = kda_chunked_reference(*inputs)
    torch.testing.assert_close(out, ref_out, **TF32)
    torch.testing.assert_close(final, ref_final, **TF32)


def test_the_interpreted_prefill_runs_the_recurrent_kernel():
    """chunk_kda still fails in the interpreter (when it no longer does, drop kda_chunked's stand-in), and the
    stand-in matches the reference."""
    if DEVICE == "cuda":
        pytest.skip("the interpreter's stand-in for chunk_kda; on a GPU kda_chunked runs chunk_kda")
    from fla.ops.kda import chunk_kda
    from triton.runtime.errors import InterpreterError

    q, k, v, g, beta, state = kda_inputs(*SHAPES[2], seed=3)
    with pytest.raises((RuntimeError, InterpreterError)):
        chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = kda_chunked(q, k, v, g, beta, state)
    ref_out, ref_final = kda_chunked_reference(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out, **FP32)
    torch.testing.assert_close(final, ref_final, **FP32)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next")
    build_checkpoint(path)
    return load_glm5_next(path, torch.float32).to(DEVICE)


def engine_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A 70-token prefill (past one chunk of 64), a 3-token decode forward kept for a rewind, the rewind to 71
    tokens through its per-token states, and one more token: all logits."""
    cache = model.new_cache(ids.shape[1], batch_size=ids.shape[0], index_dtype=torch.float32, rewindable=True)
    with torch.inference_mode():
        prefill = model(ids[:, :70], 0, cache, all_logits=True)
        draft = model(ids[:, 70:73], 70, cache, all_logits=True)
        assert cache.truncate(71) == 71
        after = model(ids[:, 71:72], 71, cache, all_logits=True)
    return torch.cat([prefill, draft, after], dim=1)


def test_glm5_next_on_triton_gives_the_torch_logits(monkeypatch, tiny_model):
    """The tiny glm5_next (two KDA layers) with every kernel on: its MLA layers take their Triton path too."""
    ids = torch.randint(0, VOCAB, (2, 72), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits = {}
    for backend in ("torch", "triton"):
        use_kernels(monkeypatch, backend)
        logits[backend] = engine_logits(tiny_model, ids)
    # fp32 model: in the interpreter the paths differ in summation order only, 5.6e-6 on logits of magnitude ~4
    # (measured, the KDA layers 5.5e-6 of it). On a GPU chunk_kda's TF32 dots (see TF32) come through the output
    # norms to the logits: a bound, not yet measured.
    atol = 2e-5 if DEVICE == "cpu" else 5e-2
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=atol, rtol=0)
