import os
import tempfile

import pytest
import torch

# auto follows the rule in tests, never a calibration of the machine they run on (tests of the
# calibration point this at their own folder); the xdist workers of one run share the folder, so
# the kernels built there (selfattn.kernels.stream) are built once
os.environ["SELFATTN_CACHE_DIR"] = (
    os.path.join(tempfile.gettempdir(), f"selfattn-cache-{os.environ['PYTEST_XDIST_TESTRUNUID']}")
    if os.environ.get("PYTEST_XDIST_TESTRUNUID") else tempfile.mkdtemp(prefix="selfattn-cache-"))
os.environ.pop("SELFATTN_AUTO_TUNE", None)

from selfattn import backends

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per xdist worker: no oversubscription of the cores


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=[False, True], ids=["emulated-half", "native-half"])
def either_cpu(request):
    """Runs the test twice, whatever this CPU is: as on one without native half-precision matmuls
    (AVX2 alone) and as on one with them (AVX512-BF16 or AMX). Yields which."""
    before = backends.assume_native_half(request.param)
    yield request.param
    backends.assume_native_half(before)
