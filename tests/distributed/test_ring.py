"""Ring attention on 2 and 4 gloo processes: outputs and gradients equal single-process math
attention (float64 <= 1e-10, float32 <= 1e-5 relative) for every mask, both layouts and
lengths that need padding; two broken rings fail the same check; bad requests are one error on
every rank, never a hang; the bytes sent are the formula's; a GPT on shards equals the GPT."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfattn.distributed import SequenceShard, layout, ring_attention
from selfattn.masks import Mask

from helpers.ring import CASES, run_ranks

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
KEYS = [f"{name}/{lay}/{dtype}" for name, _ in CASES for lay in ("zigzag", "contiguous")
        for dtype in ("float64", "float32")]


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"{n}-ranks")
def parity(request):
    return request.param, run_ranks("parity", request.param)


@pytest.mark.parametrize("key", KEYS)
def test_ring_attention_equals_math_on_the_whole_sequence(parity, key):
    world, errors = parity
    assert errors[key] <= TOLERANCE[key.rsplit("/", 1)[1]], f"{world} ranks, {key}: relative error {errors[key]:.2e}"


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_ring_that_skips_a_block_or_merges_without_rescaling_fails():  # negative controls
    errors = run_ranks("negative_controls", 2)
    assert errors["skip-a-block"] > 1e-3 and errors["no-rescale"] > 1e-3, errors


@pytest.fixture(scope="module")
def refusals():
    return run_ranks("bad_requests", 2)


@pytest.mark.parametrize("case, message", [
    ("unequal-shards", "ValueError: ring_attention: shards of unequal length: rank 0 has positions=8, rank 1 has "
                       "positions=6"),
    ("bad-dtype-on-one-rank", "TypeError: ring_attention: rank 1: q must be floating point, got dtype torch.int64"),
    ("odd-zigzag-shard", "layout 'zigzag' holds two equal chunks per rank, so a shard needs an even length, got 7"),
    ("another-layout-on-one-rank", "different layouts: rank 0 has layout='zigzag', rank 1 has layout='contiguous'"),
    ("backend-without-lse", "backend 'sdpa' cannot serve a ring: merging the blocks needs each block's log-sum-exp"),
    ("unknown-layout", "layout must be one of 'zigzag', 'contiguous', got 'spiral'"),
    ("window-without-causal", "window=3 needs causal=True"),
])
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_bad_request_is_the_same_one_line_error_on_every_rank(refusals, case, message):
    everyone = refusals[case]
    assert everyone[0] is not None and message in everyone[0], everyone
    assert all(m == everyone[0] for m in everyone) and "\n" not in everyone[0], everyone


@pytest.mark.parametrize("lay, window, steps", [("zigzag", None, 3), ("contiguous", None, 3), ("contiguous", 8, 1),
                                                ("zigzag", 8, 3)])
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_bytes_sent_are_the_formula_and_a_short_window_stops_the_ring_early(lay, window, steps):
    sent = run_ranks("traffic", 4, layout=lay, T=128, window=window)
    kv = 2 * sent["shard_bytes"]  # K and V shards travel together
    assert sent["forward"] == steps * kv
    assert sent["backward"] == steps * 2 * kv + kv  # K/V and their gradients, then the gradients' hop home


@pytest.mark.parametrize("pos, lay, window", [("learned", "zigzag", None), ("rope", "contiguous", 7),
                                              ("rope", "zigzag", 30)])
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_gpt_on_shards_equals_the_gpt_on_whole_sequences(pos, lay, window):
    errors = run_ranks("gpt", 2, pos=pos, layout=lay, window=window)
    assert max(errors.values()) <= 1e-10, errors


def test_the_layouts_cover_the_sequence_once_and_zigzag_balances_causal_work():
    for world in (1, 2, 3, 4):
        for lay in layout.LAYOUTS:
            L = 2 * world * 5
            got = sorted(p for r in range(world) for a, n in layout.chunks(lay, r, world, L) for p in range(a, a + n))
            assert got == list(range(L))
    causal = Mask()
    work = [sum(int(causal.tile(a, a + n, 0, 40).sum()) for a, n in layout.chunks("zigzag", r, 4, 40))
            for r in range(4)]
    assert len(set(work)) == 1  # every rank the same number of visible pairs
    contiguous = [int(causal.tile(a, a + n, 0, 40).sum()) for r in range(4) for a, n in layout.chunks("contiguous", r,
                                                                                                       4, 40)]
    assert max(contiguous) > 3 * min(contiguous)  # control: the contiguous layout is unbalanced


def test_without_a_process_group_the_error_says_how_to_make_one():
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="needs a process group: call torch.distributed.init_process_group"):
        ring_attention(q, q, q)
    with pytest.raises(ValueError, match="needs a process group"):
        SequenceShard(8)


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_the_documented_example_runs_under_torchrun_and_matches_one_process(tmp_path):
    page = (Path(__file__).parents[2] / "docs" / "gpt.md").read_text()  # its ring attention section
    code = page.split("```python\n# torchrun --nproc_per_node=2 ring.py\n", 1)[1].split("```", 1)[0]
    (tmp_path / "ring.py").write_text(code)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(tmp_path / "ring.py")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    printed = dict(line.split() for line in r.stdout.splitlines())
    assert sorted(printed) == ["0", "1"] and all(float(e) < 1e-5 for e in printed.values()), r.stdout
