"""The benchmarks, each run from the repository root as `.venv/bin/python -m benchmarks.NAME` (its docstring says
what it measures); what they share is in benchmarks/common.py."""

import indexpool.model  # noqa: F401  (first: the engine's OpenMP policy, set before a benchmark imports torch)
