"""``python -m benchmarks SUITE``: the suites of :mod:`benchmarks` (:mod:`benchmarks.cli` parses the flags)."""
import sys

from benchmarks.cli import run

sys.exit(run())
