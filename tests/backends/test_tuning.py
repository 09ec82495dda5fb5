"""``auto`` tuned to the machine: measurements in a cache file keyed by the machine, followed where
they cover a request, ignored (with one warning) when damaged or foreign, taken at first use on request."""
import json
import warnings

import pytest
import torch

from selfattn import Mask, backends
from selfattn.backends import auto, resolve, tuning
from selfattn.cli import main as cli_main
from selfattn.scores import Scores

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's own; what was read is forgotten before and after."""
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SELFATTN_AUTO_TUNE", raising=False)
    tuning.forget()
    yield tmp_path
    tuning.forget()


def _request(T=1024, grad=False, **mask):
    q = torch.randn(1, 2, T, 16, requires_grad=grad)
    k = torch.randn(1, 2, T, 16)
    return q, k, k.clone(), Mask(**mask)


def _choose(q, k, v, mask, scores=None):
    return resolve("auto", q=q, k=k, v=v, mask=mask, scores=scores)


def _fake(request, best, grad=False, scores=None):
    """A measurement of ``request`` in which ``best`` was the fastest."""
    q, k, v, mask = request
    return {"key": tuning.key(q, mask, scores, k.shape[2], grad), "T": q.shape[2], "S": k.shape[2],
            "window": tuning.window(mask, k.shape[2]), "times_s": {best: 1.0, "sdpa": 2.0}, "best": best}


def test_kinds_are_what_the_rule_turns_on():
    S = 1024
    kind = lambda scores=None, **m: tuning.kind(Mask(**m), scores, S)  # noqa: E731
    assert kind() == "causal" and kind(causal=False) == "full" and kind(window=S) == "causal"  # window >= S: causal
    assert kind(window=64) == "window"
    pad, docs = torch.ones(1, S, dtype=torch.bool), torch.zeros(1, S, dtype=torch.long)
    assert kind(window=64, key_padding_mask=pad, doc_ids=docs) == "window+docs+padding"
    assert kind(prefix_len=torch.tensor([8])) == "prefix"
    assert kind(Scores(alibi_slopes=torch.ones(2), softcap=5.0)) == "causal|alibi_slopes+softcap"
    q = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    assert tuning.key(q, Mask(window=4), None, 8, True) == "window bfloat16 fwd+bwd"


def test_auto_follows_the_measurements_where_they_cover_a_request(cache):
    plain = _request()
    assert _choose(*plain) == "sdpa"  # the rule (2): plain causal
    tuning.record(CPU, [_fake(plain, "tiled")])
    assert tuning.path(CPU).exists()
    tuning.forget()  # read back from the file
    assert _choose(*plain) == "tiled"
    assert _choose(*_request(T=4096)) == "tiled"  # T·S 4 octaves up: covered
    assert _choose(*_request(T=64)) == "sdpa"  # 8 octaves down: the rule
    assert _choose(*_request(grad=True)) == "sdpa"  # another mode: the rule
    assert _choose(*_request(window=64)) == ("flex" if backends.availability("flex") is None else "tiled")
    assert resolve("auto", q=plain[0], k=plain[1], v=plain[2], mask=plain[3], dropout_p=0.1) == "sdpa"  # dropout
    assert resolve("auto", q=plain[0], k=plain[1], v=plain[2], mask=plain[3], return_weights=True) == "math"


def test_windows_are_matched_by_their_share_of_the_keys_too(cache):
    tuning.record(CPU, [_fake(_request(window=256), "tiled"), _fake(_request(window=2048, T=4096), "sdpa")])
    assert _choose(*_request(window=128)) == "tiled"
    assert _choose(*_request(window=1024, T=2048)) == "sdpa"
    assert _choose(*_request(window=2048, T=16384)) == "sdpa"  # the T = 1024 one is 8 octaves of T·S away
    tuning.record(CPU, [_fake(_request(window=256, T=4096), "tiled")])
    assert _choose(*_request(window=2048, T=16384)) == "tiled"  # an eighth, like 256 of 4096 (by size: sdpa)


def test_a_measured_choice_that_refuses_gives_way_to_the_rule(cache):
    request = _request(T=512)
    tuning.record(CPU, [_fake(request, "flex", grad=True)])  # flex has no CPU backward
    assert _choose(*_request(T=512, grad=True)) == "sdpa"


def test_a_measured_flex_is_not_followed_when_compiling_is_kept_out(cache):
    request = _request(window=64)
    tuning.record(CPU, [_fake(request, "flex")])
    try:
        auto.allow_compile(False)
        assert _choose(*request) == "tiled"
    finally:
        auto.allow_compile(True)


def test_a_request_traced_by_torch_compile_follows_the_rule(cache, monkeypatch):
    plain = _request()
    tuning.record(CPU, [_fake(plain, "tiled")])
    assert _choose(*plain) == "tiled"  # eagerly, the measurement
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _choose(*plain) == "sdpa"  # traced, one graph serves every size: the rule


def test_the_file_belongs_to_the_machine_and_a_foreign_or_damaged_one_is_ignored_with_one_warning(cache):
    plain = _request()
    tuning.record(CPU, [_fake(plain, "tiled")])
    file = tuning.path(CPU)
    data = json.loads(file.read_text())
    data["fingerprint"]["cpu"] = "another CPU"
    file.write_text(json.dumps(data))
    tuning.forget()
    with pytest.warns(UserWarning, match="measured on another machine") as caught:
        assert _choose(*plain) == "sdpa"
        assert _choose(*plain) == "sdpa"  # read once: one warning
    assert len(caught) == 1
    for damage in ("{not json", json.dumps({"version": 1}), json.dumps({"version": 99, "entries": {}}),
                   json.dumps({"version": 1, "fingerprint": data["fingerprint"], "entries": {"x": [{"T": 1}]}})):
        file.write_text(damage)
        tuning.forget()
        with pytest.warns(UserWarning, match="unreadable"):
            assert _choose(*plain) == "sdpa"


def test_the_fingerprint_follows_what_changes_the_timings(cache):
    before = tuning.path(CPU)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert tuning.path(CPU) != before
    finally:
        torch.set_num_threads(threads)
    native = backends.assume_native_half(not backends.multiplies_natively(CPU, torch.bfloat16))
    try:
        assert tuning.path(CPU) != before
    finally:
        backends.assume_native_half(native)
    assert tuning.path(CPU) == before


def test_measure_times_every_backend_that_serves_and_keeps_the_fastest():
    q, k, v, mask = _request(T=128, window=32)
    fwd = tuning.measure(q, k, v, mask, None, False, reps=2, allow_compile=False)
    assert set(fwd["times_s"]) == {"sdpa", "tiled"} and fwd["best"] == min(fwd["times_s"], key=fwd["times_s"].get)
    assert (fwd["key"], fwd["T"], fwd["S"], fwd["window"]) == ("window float32 fwd", 128, 128, 32)
    trains = tuning.measure(q, k, v, mask, Scores(softcap=5.0), True, reps=2)
    assert set(trains["times_s"]) == {"tiled"}  # sdpa takes no soft-capping, flex has no CPU backward


@pytest.mark.parametrize("tie", [1e9, 0.5])  # every runner-up a near tie, or none
def test_a_near_tie_is_timed_again_for_twice_the_rounds(monkeypatch, tie):
    monkeypatch.setattr(tuning, "TIE", tie)
    q, k, v, mask = _request(T=128, window=32)
    m = tuning.measure(q, k, v, mask, None, False, reps=2, allow_compile=False)  # sdpa and tiled
    assert sorted(m["calls"].values()) == ([6, 6] if tie > 1 else [2, 2])


def test_tuning_at_first_use_measures_once_and_keeps_it(cache, monkeypatch):
    monkeypatch.setenv("SELFATTN_AUTO_TUNE", "1")
    calls = []

    def fake_measure(q, k, v, mask, scores, grad, **kw):
        calls.append(q.shape[2])
        return _fake((q, k, v, mask), "tiled", grad, scores)
    monkeypatch.setattr(tuning, "measure", fake_measure)
    plain = _request()
    assert _choose(*plain) == "tiled" and calls == [1024]
    assert _choose(*plain) == "tiled" and calls == [1024]  # measured once
    tuning.forget()
    assert _choose(*_request(T=2048)) == "tiled" and calls == [1024]  # kept in the file, and it covers T = 2048
    monkeypatch.delenv("SELFATTN_AUTO_TUNE")
    assert _choose(*_request(T=32)) == "sdpa" and calls == [1024]  # opt-in only


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_cli_calibrate_writes_the_cache_and_show_says_what_auto_follows(cache, tmp_path, capsys):
    threads = str(torch.get_num_threads())  # as the CLI pins them: part of the machine's fingerprint
    assert cli_main(["calibrate", "--show", "--threads", threads]) == 0
    assert "auto follows its measured rule" in capsys.readouterr().out
    assert cli_main(["calibrate", "--quick", "--kinds", "window-256", "causal", "--lengths", "256", "512",
                     "--dtypes", "float32", "--reps", "1", "--threads", threads, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "window float32 fwd+bwd" in out and (tmp_path / "out" / "calibrate.json").exists()
    result = json.loads((tmp_path / "out" / "calibrate.json").read_text())
    points = [(m["key"], m["T"]) for m in result["results"]]  # a window of 256 at T = 256 is plain causal: once
    assert sorted(points) == sorted((f"{kind} float32 {mode}", T) for kind, T in (("causal", 256), ("window", 512),
                                                                                 ("causal", 512))
                                    for mode in ("fwd", "fwd+bwd"))
    tuning.forget()
    assert cli_main(["calibrate", "--show", "--threads", threads]) == 0
    shown = capsys.readouterr().out
    assert "measurements for 4 kinds" in shown and "T=512 w=256" in shown
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file is this machine's: no warning
        tuning.forget()
        best = {m["key"]: m["best"] for m in result["results"]}
        assert _choose(*_request(T=512, window=256)) == best["window float32 fwd"]


def test_a_decoded_token_takes_sdpa_without_looking_the_measurements_up(cache):
    """One query that sees every key: rule 2 at once, even where a measurement of it says otherwise."""
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 512, 16)
    decode, windowed = (q, k, k.clone(), Mask()), (q, k, k.clone(), Mask(window=8))
    tuning.record(CPU, [_fake(decode, "tiled"), _fake(windowed, "tiled")])
    assert _choose(*decode) == "sdpa"
    assert _choose(*windowed) == "tiled"  # control: a window hides keys from it, the measurement decides
