"""``selfattn bench int8``: the float and int8 models' perplexity, agreement and decode time."""
import json
import math

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
    assert s["weight_bytes_int8"] < 0.5 * s["weight_bytes_float"]  # the Linears at a quarter; embeddings stay
    assert (tmp_path / "int8.png").stat().st_size > 5_000


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
