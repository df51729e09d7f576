"""Benchmark harness and baselines; see ``python -m bench.run --help``."""

import os

# The benches time the batched map itself: the online choice of the eager loop
# (acrobat.config.MAP_CHOICE) would turn some of their timed maps into the eager loop's
# trials. Set before acrobat is imported (bench.patterns turns it on for its own column).
os.environ.setdefault("ACROBAT_MAP_CHOICE", "0")
