"""``selfattn bench speculative``: its rows, their arithmetic, and the greedy check that stops a
speculative row whose tokens are not plain decoding's."""
import json

import pytest

from selfattn.cli import main
from selfattn.model import GPT


def test_quick_run_writes_every_row_and_its_arithmetic(tmp_path):
    assert main(["bench", "speculative", "--quick", "--threads", "1", "--out", str(tmp_path), "--new-tokens", "8",
                 "--workloads", "edit"]) == 0
    result = json.loads((tmp_path / "speculative.json").read_text())
    assert (tmp_path / "speculative.png").stat().st_size > 10_000
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == {"plain", "lookup", f"self:{result['self_layers']}", "hf-plain", "hf-lookup"}
    bw = result["bandwidth"]["gbps"]
    for r in rows.values():
        assert r["status"] == "ok" and r["workload"] == "edit" and r["tokens"] == 8
        assert r["tokens_per_s"] == pytest.approx(8 / r["time_s"])
        assert r["x_plain"] == pytest.approx(r["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert r["roofline_fraction"] == pytest.approx(r["bytes_per_token"] * r["tokens_per_s"] / (bw * 1e9))
        assert r["bytes_per_token"] > 0
    for impl in ("lookup", f"self:{result['self_layers']}"):
        assert rows[impl]["tokens_per_forward"] >= 1.0 and 0 <= rows[impl]["acceptance_rate"] <= 1
    assert rows["hf-plain"]["same_tokens"]  # transformers on our weights: the same greedy answer
    assert result["checks"] == [{"tokens": 8, "speculative_rows_give_plain_tokens": True, "workload": "edit"}]


def test_a_speculative_row_with_other_tokens_fails_the_run(tmp_path, monkeypatch, capsys):  # negative control
    generate = GPT.generate

    def wrong(self, idx, n, **kw):
        for tok in generate(self, idx, n, **kw):
            yield (tok + 1) % self.config.vocab_size if kw.get("speculative") is not None else tok

    monkeypatch.setattr(GPT, "generate", wrong)
    assert main(["bench", "speculative", "--quick", "--threads", "1", "--out", str(tmp_path), "--new-tokens", "4",
                 "--workloads", "chat"]) == 1
    err = capsys.readouterr().err
    assert "FAILED the correctness check" in err and "are not plain greedy decoding's tokens" in err
    assert not (tmp_path / "speculative.json").exists()
