"""benchmarks/gpu_kernels.py's agreement check (no GPU needed): the verdict it gives a kernel against its reference
at real sizes, which the timing table prints and which makes the check exit non-zero."""

import pytest
import torch

from benchmarks.gpu_kernels import Case, agreement

CASE = Case("op", lambda: None, lambda: None, 0)


def test_values_within_the_bound_agree_and_beyond_it_do_not():
    expected = torch.linspace(-4, 4, 1000)
    text, ok = agreement(CASE, expected * (1 + 1e-3), expected)
    assert ok and text == "1.0e-03"
    wrong = expected.clone()
    wrong[7] += 1.0  # one value off by an eighth of the largest magnitude
    text, ok = agreement(CASE, (wrong, expected), (expected, expected))
    assert not ok and text.endswith("MISMATCH")


def test_a_selection_may_swap_a_few_positions_but_not_more():
    expected = torch.arange(0, 4000, 2).view(4, 500)  # four rows of 500 selected positions
    swapped = expected.clone()
    swapped[2, :3] += 1  # 3 of 500 in one row: 99.4% of the reference's positions kept
    text, ok = agreement(CASE, swapped, expected)
    assert ok and text == "99.4% sel"
    swapped[1, :10] += 1  # 10 of 500: 98%
    text, ok = agreement(CASE, swapped, expected)
    assert not ok and text == "98.0% sel MISMATCH"


def test_another_shape_or_dtype_stops_the_check():
    with pytest.raises(SystemExit, match="kernel output"):
        agreement(CASE, torch.zeros(3), torch.zeros(4))
    with pytest.raises(SystemExit, match="kernel output"):
        agreement(CASE, torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3))
    with pytest.raises(SystemExit, match=r"kernel output None != reference \(3,\)"):
        agreement(CASE, (None,), (torch.zeros(3),))
