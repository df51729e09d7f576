"""Benchmark harness and baselines; see ``python -m bench.run --help``."""
