"""A short, reproducible fuzzing pass over every reader and the model loaders (benchmarks/fuzz.py runs the long one).

For mutated and arbitrary bytes, each target returns a Document (a loaded model) or raises its one error with a
one-line message, within the per-example time and memory limits. Derandomized: the same inputs on every run.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from benchmarks.fuzz import TARGETS, fuzz_property, memory_ceiling

EXAMPLES = 25  # per target: under a second each on two cores


@pytest.fixture(scope="module", autouse=True)
def bounded_memory():
    with memory_ceiling():
        yield


@pytest.mark.parametrize("name", list(TARGETS))
def test_arbitrary_and_mutated_bytes_give_a_result_or_one_line_error(name, tmp_path):
    run = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(
        fuzz_property(TARGETS[name], tmp_path))
    run()
