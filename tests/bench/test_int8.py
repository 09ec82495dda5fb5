"""``selfattn bench int8``: the float and int8 models' perplexity, agreement and decode time."""
import json
import math
import sys
import types

import pytest
import torch

from selfattn.bench import quantized
from selfattn.cli import main
from selfattn.model import GPT, GPTConfig


def test_quick_run_writes_accuracy_and_speed(tmp_path):
    assert main(["bench", "int8", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "int8.json").read_text())
    a, s = result["accuracy"], result["speed"]
    assert a["windows"] == 2 and a["length"] == 64 and 0.9 < a["top1_agreement"] <= 1.0
    assert abs(math.log(a["perplexity_int8"] / a["perplexity_float"])) < 0.05  # int8 rounds, it does not break
    assert s["int8_speedup"] == pytest.approx(s["float_s_per_token"] / s["int8_s_per_token"])
    assert s["int8_compiled_speedup"] == pytest.approx(s["float_compiled_s_per_token"] / s["int8_compiled_s_per_token"])
    assert result["targets"][0]["measured"] == (f"{s['int8_speedup']:.2f}x eager, "
                                                f"{s['int8_compiled_speedup']:.2f}x compiled")
    assert s["weight_bytes_int8"] < 0.5 * s["weight_bytes_float"]  # the Linears at a quarter; embeddings stay
    assert (tmp_path / "int8.png").stat().st_size > 5_000
    assert result["llama_cpp"] == {"status": "unavailable", "reason": "llama.cpp reads a GGUF file; this run's model "
                                                                      "is not one"}


def test_accuracy_is_the_perplexity_of_each_model_and_their_agreement():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    same = quantized.accuracy(model, model, lambda text: list(text.encode()), windows=2, length=32)
    assert same["top1_agreement"] == 1.0 and same["perplexity_float"] == same["perplexity_int8"]
    other = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()  # far from the initialisation both models share the shape of
    differ = quantized.accuracy(model, other, lambda text: list(text.encode()), windows=2, length=32)
    assert differ["top1_agreement"] < 0.5  # control: two different models are told apart


def test_llama_cpp_is_measured_only_on_a_gguf_file_where_it_is_importable(tmp_path, monkeypatch):
    from selfattn.bench import llama_cpp
    assert "not one" in llama_cpp.unavailable(None) and "not one" in llama_cpp.unavailable(str(tmp_path / "m.pt"))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    assert llama_cpp.unavailable(str(tmp_path / "m.gguf")) == f"llama_cpp is not importable: {llama_cpp.INSTALL}"


def test_llama_cpp_decode_time_is_per_token_after_the_prompt_and_a_warm_up(monkeypatch):
    from selfattn.bench import llama_cpp
    calls = []

    class Llama:  # llama_cpp.Llama's surface the timing uses
        def __init__(self, **kw):
            calls.append(("init", kw["n_ctx"]))

        def reset(self):
            calls.append(("reset",))

        def eval(self, tokens):
            calls.append(("eval", len(tokens)))

        def sample(self, top_k):
            assert top_k == 1  # greedy
            return 7

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama, __version__="0.0-test"))
    r = llama_cpp.decode_speed("m.gguf", [1, 2, 3], new_tokens=4, reps=2)
    assert calls[0] == ("init", 8) and calls[1:7] == [("reset",), ("eval", 3)] + [("eval", 1)] * 4
    assert calls.count(("reset",)) == 3 and r["version"] == "0.0-test" and r["s_per_token"] > 0
