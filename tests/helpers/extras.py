"""Markers for tests of optional extras: Triton is the ``triton`` extra, which a user may not
have installed; ``make test`` installs every extra, so CI runs these tests."""
import importlib.util

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install 'selfattn[triton]'; make test does)")
