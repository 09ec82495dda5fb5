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

from helpers import needs

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per xdist worker: no oversubscription of the cores


# ---- the parts a test needs from outside the clone (tests/helpers/needs.py): marked, checked, watched ----

def pytest_configure(config):
    for part, (what, fix) in needs.PARTS.items():
        config.addinivalue_line("markers", f"{part}: needs {what} ({fix}); marks the test external too")
    config.addinivalue_line("markers", f"{needs.EXTERNAL}: needs a part from outside the clone "
                                       f"({', '.join(needs.PARTS)}); `make check` leaves it out, `make test` runs it")
    needs.watch()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marks
def pytest_collection_modifyitems(items):
    for item in items:
        parts = needs.of(item)
        for part in sorted(parts - {m.name for m in item.iter_markers()}):
            item.add_marker(part)
        if parts and item.get_closest_marker(needs.EXTERNAL) is None:
            item.add_marker(needs.EXTERNAL)
    # the heaviest first (slow, then those loading a model or starting a program): the Makefile's
    # `--dist worksteal` gives each worker a share in this order and lets an idle one take the other's tests
    # from the far end, so the run ends on short tests, not on one long test running alone
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 item.get_closest_marker(needs.EXTERNAL) is None))


@pytest.hookimpl(tryfirst=True)  # before the fixtures
def pytest_runtest_setup(item):
    needs.USED.clear()
    for part in needs.PARTS:
        if item.get_closest_marker(part) is not None and (why := needs.missing(part)):
            pytest.fail(needs.message(part, why), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.passed:
        undeclared = {part: how for part, how in needs.USED.items() if item.get_closest_marker(part) is None}
        if undeclared:
            report.outcome = "failed"
            report.longrepr = "\n".join(
                f"{item.nodeid} used {needs.PARTS[part][0]} ({how}) without the mark {part!r}: mark it "
                f"@pytest.mark.{part}, or reach it through a helper decorated @needs({part!r}) "
                f"(tests/helpers/needs.py), so that `make check` leaves it out" for part, how in undeclared.items())
    return report


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
