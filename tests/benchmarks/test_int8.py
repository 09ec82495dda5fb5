"""``python -m benchmarks int8``: the float and int8 models' perplexity, agreement and decode time."""
import json
import math
import sys
import types

import pytest
import torch

from benchmarks import quantized
from benchmarks.cli import run as bench
from selfattn.config import GPTConfig
from selfattn.model import GPT


def test_quick_run_writes_accuracy_and_speed(tmp_path):
    assert bench(["int8", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
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
    from benchmarks import llama_cpp
    assert "not one" in llama_cpp.unavailable(None) and "not one" in llama_cpp.unavailable(str(tmp_path / "m.pt"))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    assert llama_cpp.unavailable(str(tmp_path / "m.gguf")) == f"llama_cpp is not importable: {llama_cpp.INSTALL}"


def test_llama_cpp_decodes_greedily_after_the_prompt_as_generate_does(monkeypatch):
    from benchmarks import llama_cpp
    calls = []

    class Llama:  # llama_cpp.Llama's surface the bench uses
        def __init__(self, **kw):
            calls.append(("init", kw["n_ctx"]))

        def reset(self):
            calls.append(("reset",))

        def eval(self, tokens):
            calls.append(("eval", list(tokens)))

        def sample(self, top_k):
            assert top_k == 1  # greedy
            return 7 + sum(c[0] == "eval" for c in calls)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama, __version__="0.0-test"))
    run, ran = llama_cpp.greedy("m.gguf", [1, 2, 3], new_tokens=4)
    assert calls == [("init", 7)] and ran == {"threads": torch.get_num_threads(), "version": "0.0-test"}
    assert run(4) == [8, 9, 10, 11]  # each token fed back but the last, as generate() does
    assert calls[1:] == [("reset",), ("eval", [1, 2, 3]), ("eval", [8]), ("eval", [9]), ("eval", [10])]
    calls[1:] = []
    assert run(1) == [8] and calls[1:] == [("reset",), ("eval", [1, 2, 3])]  # the prompt's forward alone


def test_a_peer_is_timed_among_the_rows(monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    asked = []
    speed = quantized.decode_speed(model, quantized.int8_twin(model), torch.zeros(1, 3, dtype=torch.long), 4,
                                   torch.device("cpu"), reps=2, peer=lambda n: asked.append(n))
    assert sorted(asked) == [1, 1, 1, 4, 4, 4]  # a warm-up and 2 timed rounds of each length
    assert "llama_cpp_s_per_token" in speed
