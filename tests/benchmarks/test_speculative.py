"""``python -m benchmarks speculative``: its rows, their arithmetic, and the greedy check that stops a
speculative row whose tokens are not plain decoding's."""
import itertools
import json

import pytest

from benchmarks import speculative
from benchmarks.cli import run as bench
from benchmarks.speculative import PEERS


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_quick_run_writes_every_row_and_its_arithmetic(tmp_path):
    assert bench(["speculative", "--quick", "--threads", "1", "--out", str(tmp_path), "--new-tokens", "8",
                 "--workloads", "edit"]) == 0
    result = json.loads((tmp_path / "speculative.json").read_text())
    assert (tmp_path / "speculative.png").stat().st_size > 10_000
    rows = {(r["impl"], r["compiled"]): r for r in result["results"]}
    ours = ("plain", "lookup", f"self:{result['self_layers']}")
    assert set(rows) == {(impl, compiled) for impl in ours for compiled in (False, True)} | \
        {("hf-plain", False), ("hf-lookup", False)}
    bw = result["bandwidth"]["gbps"]
    for (impl, compiled), r in rows.items():
        assert r["status"] == "ok" and r["workload"] == "edit" and r["tokens"] == 8
        assert r["tokens_per_s"] == pytest.approx(8 / r["time_s"])
        assert r["x_plain"] == pytest.approx(r["tokens_per_s"] / rows["plain", compiled]["tokens_per_s"])
        assert r["roofline_fraction"] == pytest.approx(r["bytes_per_token"] * r["tokens_per_s"] / (bw * 1e9))
        assert r["bytes_per_token"] > 0
        if impl in PEERS:
            assert "decode_tokens_per_s" not in r  # their prompt's forward is theirs, not the one timed
            continue
        assert 0 < r["prefill_s"] < r["time_s"]  # each run's first token, the prompt's forward, comes first
        assert r["decode_tokens_per_s"] > 7 / r["time_s"]  # decoding alone: the tokens after the first
        assert r["decode_x_plain"] == pytest.approx(r["decode_tokens_per_s"] /
                                                    rows["plain", compiled]["decode_tokens_per_s"])
    for impl, compiled in itertools.product(ours[1:], (False, True)):
        assert rows[impl, compiled]["tokens_per_forward"] >= 1.0 and 0 <= rows[impl, compiled]["acceptance_rate"] <= 1
    assert "lookup compiled" in speculative.report(result)
    assert rows["hf-plain", False]["same_tokens"]  # transformers on our weights: the same greedy answer
    assert result["checks"] == [{"tokens": 8, "speculative_rows_give_plain_tokens": True, "workload": "edit"}]


def test_a_speculative_row_with_other_tokens_fails_the_run(tmp_path, monkeypatch, capsys):  # negative control
    generate = speculative.generate

    def wrong(model, idx, n, **kw):
        for tok in generate(model, idx, n, **kw):
            yield (tok + 1) % model.config.vocab_size if kw.get("speculative") is not None else tok

    monkeypatch.setattr(speculative, "generate", wrong)
    assert bench(["speculative", "--quick", "--threads", "1", "--out", str(tmp_path), "--new-tokens", "4",
                 "--workloads", "chat"]) == 1
    err = capsys.readouterr().err
    assert "FAILED the correctness check" in err and "are not plain greedy decoding's tokens" in err
    assert not (tmp_path / "speculative.json").exists()


def test_the_targets_take_our_faster_row_of_each_impl():
    def row(workload, impl, compiled, rate, x_plain=1.0):  # 256 tokens, 1 s of them the prompt's forward
        return {"workload": workload, "impl": impl, "compiled": compiled, "status": "ok", "tokens_per_s": rate,
                "x_plain": x_plain, "time_s": 256 / rate, "prefill_s": 1.0,
                "decode_tokens_per_s": 255 / (256 / rate - 1)}

    result = {"results": [row("edit", "plain", False, 20.0), row("edit", "plain", True, 40.0),
                          row("edit", "lookup", False, 30.0, 1.5), row("edit", "lookup", True, 90.0, 2.25),
                          row("edit", "hf-lookup", False, 50.0),
                          row("chat", "plain", True, 40.0), row("chat", "lookup", True, 39.0, 0.975),
                          row("chat", "self:7", False, 18.0, 0.9)]}
    edit, peer, chat = speculative.targets(result)
    assert (edit["status"], edit["measured"]) == ("MISS", "2.25x (lookup compiled against plain compiled; "
                                                  "decoding alone 2.93x, the prompt's forward 1.00 s of plain's 6.40)")
    assert (peer["status"], peer["measured"]) == ("PASS", "1.80x")
    assert (chat["status"], chat["measured"]) == ("MISS", "worst self:7 0.90x")
