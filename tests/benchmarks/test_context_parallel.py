"""python -m benchmarks context-parallel: a small ring measured end to end (its gate, memory, bytes and
balance), and targets that pass and miss on the numbers."""
import copy
import json

import pytest
import torch

from benchmarks import context_parallel as cp

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small_run():
    settings = cp.Settings(nprocs=(2,), T=256, H=2, D=16, layouts=("zigzag",), masks=("causal",), reps=1, gate_len=32)
    return cp.run(settings, CPU, log=lambda _: None)


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_small_ring_meets_its_targets_and_writes_json_and_plot(small_run, tmp_path):
    one, ring = small_run["results"]
    assert (one["nproc"], ring["nproc"], ring["layout"]) == (1, 2, "zigzag")
    assert small_run["gate"][0]["max_rel_err"] <= 1e-9
    assert ring["saved_fraction"] == pytest.approx(0.5)  # q, k, v, out and lse of half the positions
    assert ring["steps"] == 1 and ring["sent_bytes"] == [ring["formula_bytes"]] * 2
    assert ring["work_balance"] == 1.0  # zigzag: both ranks compute the same causal pairs
    assert [t["status"] for t in small_run["targets"]] == ["PASS", "PASS", "PASS", "n/a"]
    assert "ring attention, float32 forward+backward, T=256" in cp.report(small_run)
    assert cp.plot(small_run, tmp_path / "cp.png").stat().st_size > 5_000
    json.dumps(small_run)


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_targets_miss_when_memory_bytes_or_balance_are_off(small_run):
    bad = copy.deepcopy(small_run)
    ring = bad["results"][1]
    ring["saved_fraction"] = 0.6  # > 1.15 / 2
    ring["sent_bytes"] = [ring["formula_bytes"], ring["formula_bytes"] + 4]
    ring["work_balance"] = 1.2
    assert [t["status"] for t in cp.targets(bad)] == ["MISS", "MISS", "MISS", "n/a"]
    ring.update(layout="contiguous", mask="window-64", steps=2)
    assert cp.targets(bad)[3]["status"] == "MISS"


def test_bad_settings_are_value_errors_naming_the_value():
    with pytest.raises(ValueError, match="T=100 must be a multiple of 2 x nproc = 8"):
        cp.Settings(nprocs=(4,), T=100).check()
    with pytest.raises(ValueError, match=r"masks must be among causal, window-64, window-512.*\['window-3'\]"):
        cp.Settings(masks=("window-3",)).check()
