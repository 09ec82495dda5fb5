"""python -m benchmarks masks: the cells are the masks they name, wrong implementations are caught
before anything is timed, the contenders get the repetitions, and the targets read the numbers."""
import itertools
import json
import time

import pytest
import torch

from benchmarks import common, masks
from benchmarks.cli import run as bench
from selfattn import Mask
from selfattn.backends import tuning
from selfattn.self_attention import attention

CPU = torch.device("cpu")
FAST = ("auto", "math", "sdpa", "tiled", "sdpa-dense")  # no compiling backend: seconds, not a minute


def _small(**kw):
    base = dict(cells=(("window-256", 512), ("docs-16", 512), ("padding-50", 512)), n_head=2, reps=1,
                gate_len=64, impls=FAST)
    return masks.Settings(**(base | kw))


def test_each_cell_is_the_mask_it_names():
    T = 4096
    window = masks.request(masks.mask_kwargs("window-256", 1, T, CPU), 1, 8, CPU)[0]
    assert masks.visible_pairs(window, 1, 1, T, T) == sum(min(i + 1, 256) for i in range(T))
    docs = masks.request(masks.mask_kwargs("docs-16", 1, T, CPU), 1, 8, CPU)[0]
    assert masks.visible_pairs(docs, 1, 1, T, T) == 16 * sum(range(1, 257))  # 16 causal documents of 256
    pad = masks.request(masks.mask_kwargs("padding-50", 1, T, CPU), 1, 8, CPU)[0]
    assert masks.visible_pairs(pad, 1, 1, T, T) == sum(range(1, T // 2 + 1))  # the real half, causal
    assert masks.visible_pairs(pad, 2, 3, T, T) == 6 * masks.visible_pairs(pad, 1, 1, T, T)
    with pytest.raises(ValueError, match="unknown kind 'stripes'"):
        masks.mask_kwargs("stripes", 1, T, CPU)


GATE_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # against math in float64; bf16 rounds to 8 bits


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_small_run_times_every_implementation_and_reports_auto_against_the_fastest(tmp_path, either_cpu):
    result = masks.run(_small(), CPU, log=lambda _: None)
    dtypes = ["float32", "bfloat16"] if either_cpu else ["float32"]  # bfloat16 where the CPU multiplies it
    assert result["settings"]["dtypes"] == dtypes
    assert {(g["impl"], g["mode"], g["dtype"]) for g in result["gate"]} == {
        (n, m, dt) for n in FAST for m in masks.MODES for dt in dtypes}
    assert all(g["max_err"] < GATE_TOLERANCE[g["dtype"]] for g in result["gate"])
    for mask_name, mode, dt in itertools.product(("window-256", "docs-16", "padding-50"), masks.MODES, dtypes):
        rows = [r for r in result["results"] if (r["mask"], r["mode"], r["dtype"]) == (mask_name, mode, dt)]
        assert {r["impl"] for r in rows} == set(FAST) and all(r["status"] == "ok" for r in rows)
        assert min(r["ratio"] for r in rows) == 1.0
        assert all(r["time_s"] == common.median(r["times_s"]) and r["gflops"] > 0 for r in rows)
        assert len({r["auto_choice"] for r in rows}) == 1
        assert all("check_err" in r for r in rows if r["impl"] != "tiled")  # each checked against tiled
    text = masks.report(result)
    assert "auto chose" in text and "targets" in text and "auto followed its rule" in text
    assert masks.plot(result, tmp_path / "masks.png").stat().st_size > 10_000
    json.dumps(result)  # what the CLI writes


def test_cli_quick_flags_reach_the_settings(tmp_path, capsys):
    assert bench(["masks", "--threads", "1", "--out", str(tmp_path), "--cells", "causal:256",
                     "--impls", "auto", "sdpa", "tiled", "--reps", "1"]) == 0
    result = json.loads((tmp_path / "masks.json").read_text())
    assert result["settings"]["cells"] == [["causal", 256]] and result["settings"]["impls"] == ["auto", "sdpa", "tiled"]
    assert {r["auto_choice"] for r in result["results"]} == {"sdpa"}  # plain causal (rule 2)
    assert "wrote" in capsys.readouterr().out


def test_a_calibrated_auto_is_run_and_marked_as_such(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path / "cache"))
    tuning.forget()
    try:
        threads = str(torch.get_num_threads())
        q = torch.randn(1, 8, 256, 64)
        tuning.record(CPU, [{"key": tuning.key(q, Mask(), None, 256, False), "T": 256, "S": 256, "window": None,
                             "times_s": {"tiled": 1.0, "sdpa": 2.0}, "best": "tiled"}])  # the rule says sdpa
        assert bench(["masks", "--threads", threads, "--out", str(tmp_path), "--cells", "causal:256",
                         "--impls", "auto", "sdpa", "tiled", "--reps", "1", "--dtypes", "float32"]) == 0
        result = json.loads((tmp_path / "masks.json").read_text())
        fwd = [r for r in result["results"] if r["mode"] == "fwd"]
        assert {(r["auto_choice"], r["auto_measured"]) for r in fwd} == {("tiled", True)}
        bwd = [r for r in result["results"] if r["mode"] == "fwd+bwd"]
        assert {(r["auto_choice"], r["auto_measured"]) for r in bwd} == {("sdpa", False)}  # not calibrated: the rule
        out = capsys.readouterr().out
        assert "tiled*" in out and "* chosen by this machine's calibration (1 kinds" in out
    finally:
        tuning.forget()


def test_a_wrong_implementation_fails_the_gate_and_nothing_is_timed(monkeypatch):
    real = masks._implementations

    def with_a_wrong_sdpa(*args):
        fns, why, setup = real(*args)
        fns["sdpa"] = lambda q, k, v: attention(q, k, v, backend="sdpa")  # ignores the cell's mask: plain causal
        return fns, why, setup
    monkeypatch.setattr(masks, "_implementations", with_a_wrong_sdpa)
    with pytest.raises(common.CorrectnessError, match="gate window-4 T=64 fwd sdpa tensor 0: relative error"):
        masks.run(_small(cells=(("window-256", 512),)), CPU, log=lambda _: None)


def test_the_check_in_each_cell_catches_what_the_gate_size_misses(monkeypatch):
    real = masks._implementations

    def wrong_from_512(names, mask_name, B, H, T, device, dtype):
        fns, why, setup = real(names, mask_name, B, H, T, device, dtype)
        if T >= 512:
            fns["sdpa"] = lambda q, k, v: attention(q, k, v, backend="sdpa")
        return fns, why, setup
    monkeypatch.setattr(masks, "_implementations", wrong_from_512)
    with pytest.raises(common.CorrectnessError, match="sdpa .* T=512 fwd tensor 0 vs tiled"):
        masks.run(_small(cells=(("docs-16", 512),)), CPU, log=lambda _: None)


def test_contenders_are_repeated_the_rest_are_not():
    s = masks.Settings(reps=5, slow_s=5.0)
    rounds = masks._rounds({"tiled": 0.1, "flex": 0.14, "auto": 0.11, "sdpa-dense": 0.5, "math": 9.0}, s)
    assert rounds == [(["tiled", "flex", "auto"], 15), (["sdpa-dense"], 5), (["math"], 1)]
    long = masks._rounds({"tiled": 14.0, "auto": 13.0, "sdpa": 40.0}, s)  # contenders at least 3 times
    assert long == [(["tiled", "auto"], 3), (["sdpa"], 1)]
    assert masks._rounds({"tiled": 2.0, "auto": 2.1}, s) == [(["tiled", "auto"], 10)]  # ~20 s each
    assert masks._rounds({}, s) == []


def test_every_implementation_is_judged_by_its_call_after_the_first():
    q, k, v, dout = masks._inputs(1, 2, 128, 16, CPU, torch.float32)

    def slow_first(first_s, then_s=0.0):
        calls = []

        def fn(q, k, v):
            time.sleep(first_s if not calls else then_s)  # the first call compiles, or pays a one-time cost
            calls.append(1)
            return attention(q, k, v, backend="tiled")
        return fn
    fns = {"tiled": lambda q, k, v: attention(q, k, v, backend="tiled"), "flex": slow_first(0.3),
           "sdpa": slow_first(0.3), "math": slow_first(0.3, 0.3)}  # math: slow on every call
    live = {n: {} for n in fns}
    settings = masks.Settings(max_call_s=0.2)
    kept = masks._checked_first_calls(fns, live, q, k, v, dout, "fwd", {}, 1, 128, CPU, torch.float32, settings,
                                      {"flex"})
    assert kept == ["tiled", "flex", "sdpa"]
    for name in ("flex", "sdpa"):
        assert live[name]["first_s"] >= 0.3 > 0.2 >= live[name]["warm_s"]
    assert live["math"]["status"] == "too slow" and live["math"]["reason"].startswith("a call after the first")
    slow = {"math": slow_first(0.3, 0.0)}  # a first call above slow_s is not repeated: judged by it
    live = {"math": {}}
    masks._checked_first_calls(slow, live, q, k, v, dout, "fwd", {}, 1, 128, CPU, torch.float32,
                               masks.Settings(max_call_s=0.2, slow_s=0.1), set())
    assert live["math"]["warm_s"] == live["math"]["first_s"] >= 0.3 and live["math"]["status"] == "too slow"


def _synthetic(times: dict, choice: str = "tiled") -> dict:
    """A result of the given {(impl, mask, T, mode, dtype): seconds}, ratios as run() computes them."""
    rows = [{"impl": i, "mask": m, "T": T, "mode": mode, "dtype": dt, "status": "ok", "time_s": t,
             "auto_choice": choice, "matmul_fraction": 0.5} for (i, m, T, mode, dt), t in times.items()]
    for r in rows:
        r["ratio"] = r["time_s"] / min(x["time_s"] for x in rows
                                       if (x["mask"], x["T"], x["mode"], x["dtype"]) ==
                                       (r["mask"], r["T"], r["mode"], r["dtype"]))
    return {"results": rows}


def test_targets_pass_and_miss_on_the_measured_numbers():
    docs = ("docs-16", 16384)
    good = _synthetic({("auto", *docs, "fwd", "float32"): 1.0, ("tiled", *docs, "fwd", "float32"): 1.0,
                       ("flex-compiled", *docs, "fwd", "float32"): 0.9,
                       ("auto", *docs, "fwd+bwd", "float32"): 1.0, ("sdpa-dense", *docs, "fwd+bwd", "float32"): 9.0,
                       ("tiled", *docs, "fwd+bwd", "float32"): 1.0})
    by = {t["target"].split(":")[0]: t for t in masks.targets(good)}
    assert by["auto <= 1.1x the fastest implementation in every cell"]["status"] == "MISS"  # 1.11x of flex-compiled
    assert by["tiled forward, 16 documents, T=16384 <= 2x compiled FlexAttention"]["status"] == "PASS"
    assert by["forward+backward, 16 documents, T=16384"]["status"] == "PASS"
    assert by["fixed window"]["status"] == "n/a"

    noise = _synthetic({("auto", "window-256", 4096, "fwd", "float32"): 1.25,
                        ("tiled", "window-256", 4096, "fwd", "float32"): 1.0})  # auto ran tiled, 25% slower
    auto = masks.targets(noise)[0]
    assert auto["status"] == "MISS"
    assert auto["measured"].endswith("the backend it chose, timed as itself: worst 1.00x (window-256 4096 fwd float32)")

    cell = ("window-256", 4096, "fwd", "float32")  # the same, with flex between auto's two timings
    among = _synthetic({("auto", *cell): 1.25, ("tiled", *cell): 1.0, ("flex", *cell): 1.2})
    assert masks.targets(among)[0]["measured"].endswith(
        "the slower of the two against every other implementation: worst 1.04x (window-256 4096 fwd float32)")
    wrong = _synthetic({("auto", *cell): 1.0, ("tiled", *cell): 1.0, ("flex", *cell): 0.8})  # a wrong choice
    assert "every other implementation: worst 1.25x" in masks.targets(wrong)[0]["measured"]

    bf16 = {("sdpa", "causal", 4096, "fwd", "bfloat16"): 1.6, ("auto", "causal", 4096, "fwd", "bfloat16"): 1.0,
            ("auto", "causal", 4096, "fwd", "float32"): 1.2}
    by = {t["target"].split(":")[0]: t for t in masks.targets(_synthetic(bf16) | {"native_bf16": True})}
    native = by["bfloat16 on a CPU with native bf16 matmuls"]
    never_slower = by["bfloat16 never slower than float32 (auto, cell by cell)"]
    assert (native["status"], native["measured"]) == ("PASS", "1.60x causal T=4096 fwd")
    assert (never_slower["status"], never_slower["measured"]) == ("PASS", "worst 0.83x (causal 4096 fwd)")
    slow = bf16 | {("sdpa", "causal", 4096, "fwd", "bfloat16"): 1.4, ("auto", "causal", 4096, "fwd", "float32"): 0.9}
    by = {t["target"].split(":")[0]: t for t in masks.targets(_synthetic(slow) | {"native_bf16": True})}
    assert by["bfloat16 on a CPU with native bf16 matmuls"]["status"] == "MISS"
    assert by["bfloat16 never slower than float32 (auto, cell by cell)"]["status"] == "MISS"
    emulated = {t["target"].split(":")[0]: t for t in masks.targets(_synthetic(bf16) | {"native_bf16": False})}
    assert emulated["bfloat16 on a CPU with native bf16 matmuls"]["measured"].startswith("not measured: this CPU")
    assert [t["status"] for t in masks.targets({"results": []})] == ["n/a"] * 8
