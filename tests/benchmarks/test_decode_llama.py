"""``python -m benchmarks decode-llama``: ours beside llama-bench on the same model, the sides interleaved, what
each times, llama.cpp's copies of the files, the checks before timing and the targets."""
import argparse
import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import common, decode_llama, llama_cpp
from benchmarks.cli import run as bench
from selfattn.config import GPTConfig
from selfattn.generation.int8 import Int8Linear
from selfattn.model import GPT

from helpers.gemma3 import F32 as GEMMA3_F32
from helpers.smollm2 import smollm2


@pytest.mark.llama_cpp  # the suite runs llama-bench and llama-completion
def test_quick_run_decodes_smollm2_beside_llama_bench_and_writes_json_and_plot(tmp_path):
    smollm2()
    assert bench(["decode-llama", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "decode-llama.json").read_text())
    assert (tmp_path / "decode-llama.png").stat().st_size > 5_000
    (row,) = result["results"]
    assert (row["key"], row["dtype"], row["llama_type"]) == ("smollm2", "float32", "F32") and result["threads"] == 1
    assert row["llama_file"] == str(decode_llama.copy_path(decode_llama.MODELS["smollm2"], "F32"))
    assert row["decode_tps"] > 0 and row["prefill_tps"] > 0 and row["llama_tg_tps"] > 0 and row["llama_pp_tps"] > 0
    assert row["path"] in ("kernel", "graph", "eager") and (row["path"] == "kernel") == (row["path_reason"] is None)
    (check,) = result["checks"]
    assert check["ours"] == check["llama_cpp"] and len(check["ours"].strip()) > 3  # both decode the same model
    assert row["greedy_as_float32"] is True  # the prepared float32 model continues as the model as loaded
    decode_target, prefill_target = result["targets"]
    assert decode_target["status"] in ("PASS", "MISS") and "tg8" in decode_target["target"]
    assert prefill_target["measured"].startswith(f"{row['prefill_tps'] / row['llama_pp_tps']:.2f}x")


LLAMA_BENCH = [{"build_commit": "b1", "model_type": "llama 256M F32", "n_prompt": 16, "n_gen": 0, "avg_ts": 197.3,
                "samples_ts": [197.3]},
               {"build_commit": "b1", "model_type": "llama 256M F32", "n_prompt": 0, "n_gen": 8, "avg_ts": 109.9,
                "samples_ts": [109.9]}]  # the fields of llama-bench -o json the suite reads, from a real run


def test_llama_bench_json_gives_the_prompt_and_generation_tests_tokens_per_s():
    assert decode_llama.parse_bench(json.dumps(LLAMA_BENCH), 16, 8) == {"pp_tps": 197.3, "tg_tps": 109.9,
                                                                        "build": "b1"}
    with pytest.raises(OSError, match="0 pp32 and 0 tg4 tests"):  # control: tests of other sizes are not taken
        decode_llama.parse_bench(json.dumps(LLAMA_BENCH), 32, 4)


def test_llama_cpps_copies_are_named_by_type_beside_the_file_and_gemmas_float32_is_the_tests():
    gemma, smol = decode_llama.MODELS["gemma3"], decode_llama.MODELS["smollm2"]
    assert decode_llama.copy_path(gemma, "F32") == GEMMA3_F32  # reused, never written twice
    names = {decode_llama.copy_path(smol, t).name for t in decode_llama.LLAMA_TYPES.values()}
    assert names == {"SmolLM2-135M-Instruct-f32.gguf", "SmolLM2-135M-Instruct-bf16.gguf",
                     "SmolLM2-135M-Instruct-q8_0.gguf"}
    assert decode_llama.copy_path(smol, "F32").parent == smol.file.parent


def test_a_copy_is_written_once_whole_and_nothing_is_left_where_llama_quantize_fails(tmp_path, monkeypatch):
    calls = []

    def quantize(argv, **kwargs):
        calls.append(argv)
        if argv[4] == "BF16":
            return types.SimpleNamespace(returncode=1, stderr="unknown type\n")
        with open(argv[3], "w") as f:  # the part file, renamed into place after
            f.write("copy")
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(decode_llama.subprocess, "run", quantize)
    source, out = tmp_path / "m.gguf", tmp_path / "m-q8_0.gguf"
    assert decode_llama.requantised(tmp_path / "llama-quantize", source, out, "Q8_0", 2) == out
    assert out.read_text() == "copy" and calls[0][:3] == [str(tmp_path / "llama-quantize"), "--allow-requantize",
                                                         str(source)]
    assert calls[0][4:] == ["Q8_0", "2"]
    decode_llama.requantised(tmp_path / "llama-quantize", source, out, "Q8_0", 2)
    assert len(calls) == 1  # made once, then reused
    with pytest.raises(OSError, match="llama-quantize m.gguf -> BF16 exited 1"):
        decode_llama.requantised(tmp_path / "llama-quantize", source, tmp_path / "m-bf16.gguf", "BF16", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-q8_0.gguf"]


def test_llama_completion_is_read_once_it_printed_its_last_line(monkeypatch):
    outputs = iter([b" Paris.", b" Paris.\n\nThe\n\n"])  # the first run lost the end of its output

    def completion(argv, **kwargs):
        return types.SimpleNamespace(returncode=0, stdout=next(outputs), stderr=b"")

    monkeypatch.setattr(llama_cpp.subprocess, "run", completion)
    assert llama_cpp.complete("llama-completion", "m.gguf", "The capital of France is", 4, threads=2,
                              context=256) == b" Paris.\n\nThe"
    monkeypatch.setattr(llama_cpp.subprocess, "run", lambda argv, **kw: types.SimpleNamespace(
        returncode=0, stdout=b" Paris.", stderr=b""))
    with pytest.raises(OSError, match="lost the end of its output 3 times"):
        llama_cpp.complete("llama-completion", "m.gguf", "The capital of France is", 4, threads=2, context=256,
                           tries=3)


def test_the_check_refuses_to_time_a_model_llama_cpp_continues_otherwise(monkeypatch):
    loaded = types.SimpleNamespace(require_tokenizer=lambda: types.SimpleNamespace(encode=lambda text, special: [1]),
                                   source=decode_llama.MODELS["smollm2"].file)
    monkeypatch.setattr(decode_llama, "_greedy", lambda model, loaded, ids, n: " Paris.")
    monkeypatch.setattr(llama_cpp, "complete", lambda binary, path, prompt, n, **kw: b" Paris.")
    assert decode_llama.check(loaded, None, "llama-completion", Path("f32.gguf"), 8, 2)["llama_cpp"] == " Paris."
    assert decode_llama.check(loaded, None, None, None, 8, 2) == {"prompt": decode_llama.CHECK_PROMPT, "tokens": 8,
                                                                  "ours": " Paris.", "llama_cpp": None}
    monkeypatch.setattr(llama_cpp, "complete", lambda binary, path, prompt, n, **kw: b" Lyon.")
    with pytest.raises(common.CorrectnessError, match="not the same model"):  # control: another continuation fails
        decode_llama.check(loaded, None, "llama-completion", Path("f32.gguf"), 8, 2)


def test_the_sides_take_turns_the_order_rotated_each_repetition():
    order = []
    sides = {"llama.cpp": lambda: order.append("llama.cpp") or {"n": len(order)},
             "ours": lambda: order.append("ours") or {"n": len(order)}}
    runs = decode_llama.interleave(sides, 4, torch.device("cpu"))
    assert order == ["llama.cpp", "ours", "ours", "llama.cpp"] * 2
    assert [r["n"] for r in runs["llama.cpp"]] == [1, 4, 5, 8] and [r["n"] for r in runs["ours"]] == [2, 3, 6, 7]


def test_decode_times_the_steps_after_the_first_token_and_prefill_the_prompts_forward(monkeypatch):
    clock = {"on": False, "pulled": []}  # whether each token was pulled with the clock running

    def generate(model, idx, n, temperature):
        assert temperature == 0.0
        for _ in range(n):
            clock["pulled"].append(clock["on"])
            yield torch.tensor([0])

    def timed(fn, device):
        clock["on"] = True
        fn()
        clock["on"] = False
        return 2.0, None

    monkeypatch.setattr(decode_llama, "generate", generate)
    monkeypatch.setattr(decode_llama.common, "timed", timed)
    assert decode_llama.decode_tps(None, torch.zeros(1, 1, dtype=torch.long), 8, torch.device("cpu")) == 4.0
    assert clock["pulled"] == [False] + [True] * 8  # the 1-token prompt's token untimed, then 8 steps
    clock["pulled"].clear()
    assert decode_llama.prefill_tps(None, torch.zeros(1, 16, dtype=torch.long), torch.device("cpu")) == 8.0
    assert clock["pulled"] == [True]  # the prompt's forward to its first token, timed


def _llama_shaped() -> GPT:
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, n_kv_head=2, pos="rope",
                         norm="rmsnorm", mlp_kind="swiglu")).eval()


def test_prepare_casts_or_quantises_a_copy_and_says_which_path_decodes_it(monkeypatch):
    base = _llama_shaped()
    model, path, why = decode_llama.prepare(base, "bfloat16")
    assert model.wte.weight.dtype == torch.bfloat16 and base.wte.weight.dtype == torch.float32
    assert path in ("kernel", "graph") and (path == "kernel") == (why is None)
    model, _, _ = decode_llama.prepare(base, "int8")
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert not any(isinstance(m, Int8Linear) for m in base.modules()) and isinstance(base.lm_head, nn.Linear)

    def refuse(model):
        raise ValueError("compile_decode: layer 0 slides over a window of 8 keys")

    monkeypatch.setattr(decode_llama, "compile_decode", refuse)
    model, path, why = decode_llama.prepare(base, "float32")
    assert (path, why) == ("eager", "compile_decode: layer 0 slides over a window of 8 keys")
    first = next(iter(decode_llama.generate(model, torch.zeros(1, 2, dtype=torch.long), 1, temperature=0.0)))
    assert first.shape == (1,)  # it decodes, eagerly


def _row(dtype: str, decode: float, prefill: float, tg: float | None, pp: float | None) -> dict:
    return {"model": "M", "key": "smollm2", "dtype": dtype, "llama_type": decode_llama.LLAMA_TYPES[dtype],
            "path": "kernel", "path_reason": None, "decode_tps": decode, "prefill_tps": prefill,
            "llama_tg_tps": tg, "llama_pp_tps": pp}


def test_targets_pass_and_miss_on_the_measured_ratios_with_their_numbers():
    result = {"settings": {"prompt": 512, "new_tokens": 128, "reps": 3}, "llama_missing": None, "threads": 2,
              "checks": [], "results": [_row("float32", 110.0, 100.0, 100.0, 100.0),
                                        _row("int8", 109.0, 99.0, 100.0, 100.0)]}
    found = decode_llama.targets(result)
    assert [t["status"] for t in found] == ["PASS", "PASS", "MISS", "MISS"]  # control: just under each goal misses
    assert found[0]["target"] == "M float32: batch-1 decode >= 1.1x llama.cpp's tg128 tokens/s"
    assert found[2]["target"].startswith("M int8 vs Q8_0: batch-1 decode")
    assert found[2]["measured"] == "1.09x (109.0 against 100.0 tok/s, ours kernel)"
    assert found[3]["measured"] == "0.99x (99.0 against 100.0 tok/s, ours kernel)"
    result["targets"] = found
    text = decode_llama.report(result)
    assert "pp512" in text and "[MISS] M int8 vs Q8_0: batch-1 prefill >= 1x llama.cpp's pp512" in text
    missing = {**result, "llama_missing": "no llama-bench in /x", "results": [_row("float32", 1.0, 1.0, None, None)]}
    assert [t["status"] for t in decode_llama.targets(missing)] == ["n/a", "n/a"]
    assert decode_llama.targets(missing)[0]["measured"] == "llama.cpp not measured: no llama-bench in /x"


def test_flags_set_the_settings_and_bad_settings_name_the_value():
    from benchmarks import cli as bench_cli
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    argv = ["decode-llama", "--models", "gemma3", "--dtypes", "bfloat16", "int8", "--prompt", "64", "--new-tokens",
            "16", "--check-tokens", "0", "--reps", "5"]
    s = bench_cli._settings("decode-llama", parser.parse_args(argv))
    assert (s.models, s.dtypes, s.prompt, s.new_tokens, s.check_tokens, s.reps) == (("gemma3",), ("bfloat16", "int8"),
                                                                                     64, 16, 0, 5)
    assert bench_cli._settings("decode-llama", parser.parse_args(["decode-llama", "--quick"])) == decode_llama.QUICK
    with pytest.raises(ValueError, match=r"models must be some of smollm2, gemma3, got \['llama'\]"):
        decode_llama.Settings(models=("llama",)).check()
    with pytest.raises(ValueError, match=r"dtypes must be some of float32, bfloat16, int8, got \[\]"):
        decode_llama.Settings(dtypes=()).check()
    with pytest.raises(ValueError, match="new_tokens"):
        decode_llama.Settings(new_tokens=0).check()
