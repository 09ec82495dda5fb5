"""python -m benchmarks: the peers compute what we compute, the counts and checks are right, and
each suite's quick run writes its JSON and plot."""
import argparse
import copy
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import attention, common, decode, finetune, memory, surgery, train
from benchmarks.cli import run as bench
from benchmarks.peers import ATTENTION_PEERS, NanoGPT, SeedSelfAttention, attention_peer
from selfattn import SelfAttention
from selfattn._util import validate as _validate
from selfattn.config import GPTConfig
from selfattn.lora import lora_modules
from selfattn.model import GPT


def _grads(module, x, g):
    x = x.detach().requires_grad_()
    y = module(x)
    y.backward(g)
    return y, x.grad


def _why_not_here(name: str) -> str | None:
    return attention.implementation(name).unavailable(torch.device("cpu"), torch.float64, 4, 6)


def test_implementations_that_cannot_run_here_say_why():
    refused = {name: _why_not_here(name) for name in ATTENTION_PEERS + attention.OURS if _why_not_here(name)}
    assert set(refused) <= {"triton", "flex"} and all(refused.values()), refused  # no GPU; no CPU float64 backward


@pytest.mark.parametrize("name", [n for n in ATTENTION_PEERS + attention.OURS if _why_not_here(n) is None])
def test_every_implementation_agrees_with_math_in_float64(name):
    ref = SelfAttention(24, 4, backend="math").double()  # 4 heads of 6
    x, g = torch.randn(2, 37, 24, dtype=torch.float64), torch.randn(2, 37, 24, dtype=torch.float64)
    impl = attention.implementation(name).build(ref)
    y_ref, dx_ref = _grads(ref, x, g)
    y, dx = _grads(impl, x, g)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-10, atol=1e-12)


def test_seed_peer_takes_the_reference_weights():
    ref = SelfAttention(16, 4)
    assert torch.equal(attention_peer("seed", ref).qkv.weight, ref.qkv.weight)


def test_attention_peer_rejects_what_peers_cannot_express():
    with pytest.raises(ValueError, match="unknown attention peer 'flash'"):
        attention_peer("flash", SelfAttention(8, 2))
    with pytest.raises(ValueError, match="without biases"):
        attention_peer("seed", SelfAttention(8, 2, bias=True))
    with pytest.raises(TypeError, match="SelfAttention reference"):
        attention_peer("seed", torch.nn.Linear(8, 8))


def test_nanogpt_equivalent_computes_our_gpt():
    gpt = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=True)).double()
    nano = NanoGPT.from_ours(gpt)
    idx, tgt = torch.randint(50, (3, 16)), torch.randint(50, (3, 16))
    (logits, _), (_, loss), (nano_logits, nano_loss) = gpt(idx), gpt(idx, tgt), nano(idx, tgt)
    torch.testing.assert_close(nano_logits, logits, rtol=1e-12, atol=1e-12)
    loss.backward()
    nano_loss.backward()
    nano_params = dict(nano.named_parameters())
    for key, p in gpt.named_parameters():  # two cross-entropies summing in other orders
        torch.testing.assert_close(nano_params[NanoGPT.key_for(key)].grad, p.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="GPT-2-style"):
        NanoGPT.from_ours(GPT(GPTConfig(pos="rope")))


def test_flop_formula_counts_the_causal_half_of_what_the_seed_computes():
    B, T, C, H = 2, 12, 24, 3
    assert attention.attention_flops(1, 2, 1, 1, "fwd") == 8  # 2·B·H·T²·D
    assert attention.attention_flops(B, T, H, C // H, "fwd+bwd") == 3.5 * 2 * B * H * T * T * (C // H)
    with FlopCounterMode(display=False) as counter:
        SeedSelfAttention(C, H)(torch.randn(B, T, C))
    full_attention = 4 * B * H * T * T * (C // H)  # the seed computes every (query, key) pair
    assert counter.get_total_flops() == 8 * B * T * C * C + full_attention
    assert attention.module_flops(B, T, C, H, "fwd") == counter.get_total_flops() - full_attention / 2
    assert attention.module_flops(B, T, C, H, "fwd+bwd") == 3 * 8 * B * T * C * C + 3.5 * full_attention / 2


def _settings(**kw):
    base = dict(seq_lens=(32, 64), tokens=64, n_embd=16, n_head=2, dtypes=("float32",), reps=1, gate_len=40,
                matmul_n=64, impls=("math", "sdpa"), memory=False)
    return attention.Settings(**(base | kw))


def test_configuration_over_the_memory_cap_does_not_fit_and_is_not_run():
    s = _settings(seq_lens=(64,))
    est = {n: attention.estimate_bytes(n, 1, 64, 16, 2, torch.float32, "fwd+bwd") for n in ("math", "sdpa")}
    assert est["math"] > est["sdpa"]  # math materialises the (T, T) scores
    cap_gib = (est["math"] + est["sdpa"]) / 2 / attention.GIB  # between the two
    rows = attention.run(attention.Settings(**(vars(s) | {"max_mem_gib": cap_gib})), torch.device("cpu"),
                         log=lambda _: None)["results"]
    by = {(r["impl"], r["mode"]): r for r in rows}
    assert by[("math", "fwd+bwd")]["status"] == "does not fit"
    assert "would need" in by[("math", "fwd+bwd")]["reason"] and "time_s" not in by[("math", "fwd+bwd")]
    assert by[("sdpa", "fwd+bwd")]["status"] == "ok" and by[("sdpa", "fwd+bwd")]["time_s"] > 0
    tiny = attention.run(_settings(max_mem_gib=1e-6), torch.device("cpu"), log=lambda _: None)["results"]
    assert {r["status"] for r in tiny} == {"does not fit"}


def test_out_of_memory_during_timing_drops_only_that_implementation():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    times, failed = common.interleaved({"fine": lambda: 1, "huge": oom}, torch.device("cpu"), warmup=1, reps=3)
    assert len(times["fine"]) == 3 and "huge" not in times
    assert "out of memory" in failed["huge"]
    with pytest.raises(RuntimeError, match="a real bug"):  # anything else is not swallowed
        common.interleaved({"bug": lambda: (_ for _ in ()).throw(RuntimeError("a real bug"))},
                           torch.device("cpu"), warmup=1, reps=1)


class _NoMask(torch.nn.Module):
    """A deliberately wrong implementation: attention without the causal mask."""

    def __init__(self, ref, from_len=0):
        super().__init__()
        self.ref, self.from_len = ref, from_len

    def forward(self, x):
        if x.shape[1] < self.from_len:
            return self.ref(x)
        q, k, v = self.ref.qkv(x).split(x.shape[-1], dim=2)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.ref.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v  # (B, H, T, D)
        return self.ref.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


def test_gate_fails_loudly_on_a_wrong_implementation():
    wrong = attention.Impl("no-mask", "peer", lambda ref: _NoMask(ref))
    with pytest.raises(common.CorrectnessError, match="no-mask .* output: relative error"):
        attention.run(_settings(), torch.device("cpu"), impls=[attention.implementation("math"), wrong],
                      log=lambda _: None)


def test_per_configuration_check_catches_what_the_gate_size_misses():
    wrong_at_64 = attention.Impl("wrong-at-64", "peer", lambda ref: _NoMask(ref, from_len=64))
    impls = [attention.implementation("math"), wrong_at_64]
    with pytest.raises(common.CorrectnessError, match="wrong-at-64 at T=64"):
        attention.run(_settings(), torch.device("cpu"), impls=impls, log=lambda _: None)


def test_cli_reports_a_failed_check_with_exit_status_1(monkeypatch, tmp_path, capsys):
    real = attention.implementation
    monkeypatch.setattr(attention, "implementation", lambda name: attention.Impl(
        name, "peer", lambda ref: _NoMask(ref)) if name == "nanogpt" else real(name))
    assert bench(["attention", "--quick", "--threads", "1", "--dtype", "float32", "--no-memory",
                     "--impls", "math", "nanogpt", "--out", str(tmp_path)]) == 1
    assert "FAILED the correctness check" in capsys.readouterr().err
    assert not (tmp_path / "attention.json").exists()


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_memory_of_a_materialising_implementation_grows_with_its_scores():
    specs = [memory.Spec(name, 1, 1024, 64, 1, "float32", ("fwd", "fwd+bwd"), 1) for name in ("math", "sdpa")]
    math_peak, sdpa_peak = (r["peak_bytes"] for r in memory.measure(specs, torch.device("cpu")))
    scores = 1024 * 1024 * 4  # one (T, T) float32 matrix
    assert math_peak["fwd+bwd"] - sdpa_peak["fwd+bwd"] >= 2 * scores
    assert 0 < sdpa_peak["fwd"] <= sdpa_peak["fwd+bwd"]


def _synthetic(times: dict[tuple[str, str, int], float], peaks: dict[int, int]) -> dict:
    rows = [{"impl": i, "dtype": "float32", "mode": m, "T": T, "status": "ok", "time_s": t,
             "matmul_fraction": 0.7 if i == "auto" else 0.5} for (i, m, T), t in times.items()]
    rows += [{"impl": "tiled", "dtype": "float32", "mode": "fwd+bwd", "T": T, "status": "ok", "time_s": 1.0,
              "peak_bytes": p} for T, p in peaks.items()]
    return {"results": rows}


def test_attention_targets_pass_and_miss_on_the_measured_numbers():
    good = _synthetic({("auto", "fwd", 4096): 1.0, ("sdpa", "fwd", 4096): 1.0, ("tiled", "fwd", 4096): 1.2,
                       ("auto", "fwd+bwd", 2048): 1.0, ("seed", "fwd+bwd", 2048): 3.5,
                       ("sdpa", "fwd+bwd", 2048): 1.02}, {128: 100, 16384: 120})
    bad = _synthetic({("auto", "fwd", 4096): 1.1, ("sdpa", "fwd", 4096): 1.0, ("tiled", "fwd", 4096): 1.4,
                      ("auto", "fwd+bwd", 2048): 1.0, ("seed", "fwd+bwd", 2048): 2.5,
                      ("sdpa", "fwd+bwd", 2048): 1.0}, {128: 100, 16384: 900})
    for r in bad["results"]:
        if r["impl"] == "auto":
            r["matmul_fraction"] = 0.4
    assert [t["status"] for t in attention.targets(good)] == ["PASS"] * 5
    assert [t["status"] for t in attention.targets(bad)] == ["MISS"] * 5
    assert [t["status"] for t in attention.targets({"results": []})] == ["n/a"] * 5


@pytest.mark.slow  # make check leaves it out: a whole quick suite
def test_attention_quick_run_writes_json_and_plot(tmp_path, capsys):
    assert bench(["attention", "--quick", "--threads", "1", "--out", str(tmp_path),
                     "--dtype", "float32", "--impls", "auto", "math", "sdpa", "tiled", "seed", "hf-gpt2"]) == 0
    out = capsys.readouterr().out
    assert "targets" in out and "float32 fwd+bwd peak memory" in out
    result = json.loads((tmp_path / "attention.json").read_text())
    assert (tmp_path / "attention.png").stat().st_size > 10_000
    assert {"suite", "machine", "settings", "flops", "matmul", "gate", "results", "targets"} <= set(result)
    assert result["machine"]["threads"] == 1 and result["machine"]["torch"] == torch.__version__
    assert result["matmul"]["float32"]["gflops"] > 0
    assert {g["impl"] for g in result["gate"] if g["status"] == "ok"} == {"auto", "math", "sdpa", "tiled", "seed",
                                                                         "hf-gpt2"}
    ok = [r for r in result["results"] if r["status"] == "ok"]
    assert {(r["T"], r["mode"]) for r in ok} == {(T, m) for T in (128, 256, 512) for m in attention.MODES}
    for r in ok:
        assert r["B"] * r["T"] == 512 and len(r["times_s"]) == 3 and r["time_s"] == sorted(r["times_s"])[1]
        assert r["gflops"] == pytest.approx(r["flops"] / r["time_s"] / 1e9) and r["ratio"] >= 1.0
        assert r["peak_bytes"] >= 0  # RSS growth over the idle child; tiny here
    assert min(r["ratio"] for r in ok if (r["T"], r["mode"]) == (128, "fwd")) == 1.0
    assert len(result["targets"]) == 5


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_decode_quick_run_writes_json_and_plot(tmp_path, capsys):
    assert bench(["decode", "--quick", "--threads", "1", "--out", str(tmp_path), "--prompts", "8",
                     "--new-tokens", "6", "--reps", "2", "--batches", "1", "2", "--bandwidth-mib", "16"]) == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.png").stat().st_size > 10_000
    assert {"suite", "machine", "settings", "bandwidth", "params", "ckpt", "checks", "results",
            "targets"} <= set(result)
    bw = result["bandwidth"]
    assert bw["gbps"] == max(bw["sum_gbps"], bw["copy_gbps"], bw["matvec_gbps"]) > 0 and bw["bytes"] == 16 * 2 ** 20
    assert bw["gbps"] == max(bw["before"]["gbps"], bw["after"]["gbps"])  # measured at both ends of the run
    timed = [r for r in result["results"] if not r["estimated"]]
    assert all(r["roofline_fraction"] == r["achieved_gbps"] / r["bandwidth_gbps"] for r in timed)
    assert all(r["bandwidth_gbps"] > 0 for r in timed)  # the probes around each row's runs
    # a run's time is its prefill and decode, not the probes around it
    assert all(r["times_s"] == [p + d for p, d in zip(r["prefills_s"], r["decodes_s"])] for r in timed)
    rows = {(r["impl"], r["dtype"], r["batch"]): r for r in result["results"]}
    assert set(rows) == {(i, d, b) for i in ("kv-cache", "compiled", "hf-sdpa") for d in ("float32", "bfloat16")
                         for b in (1, 2)} | {("no-cache", "float32", 1)}
    assert all(r["status"] == "ok" and r["model"] == decode.GPT2_MODEL and r["prompt"] == 8
               for r in rows.values())
    assert rows[("no-cache", "float32", 1)]["estimated"]
    for (impl, dtype, B), r in rows.items():
        if impl == "no-cache":
            continue
        assert not r["estimated"] and len(r["prefills_s"]) == len(r["decodes_s"]) == 2
        assert r["decode_tokens_per_s"] == pytest.approx(B * 5 / r["decode_s"])  # 6 new tokens: the first, 5 steps
        assert r["tokens_per_s"] == pytest.approx(B * 6 / r["time_s"])
        assert r["achieved_gbps"] == pytest.approx(r["bytes_per_step"] / (r["decode_s"] / 5) / 1e9)
        assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_bytes_per_step"]
        assert r["peak_bytes"] >= r["weight_bytes"] and r["peak_ratio"] > 0
        assert r["first_s"] > 0
    assert all(rows[("compiled", "float32", b)]["greedy_agrees"] for b in (1, 2))  # float32: eager's tokens
    ours = {(d, b): rows[("kv-cache", d, b)] for d in ("float32", "bfloat16") for b in (1, 2)}
    assert ours[("bfloat16", 1)]["weight_bytes"] * 2 == ours[("float32", 1)]["weight_bytes"]  # half the bytes
    assert ours[("float32", 2)]["kv_bytes_per_step"] == 2 * ours[("float32", 1)]["kv_bytes_per_step"]
    checks = {c["dtype"]: c for c in result["checks"]}
    assert checks["float32"]["vs_hf_err"] < 1e-4 and checks["float32"]["cache_err"] < 1e-4
    assert checks["float32"]["compiled_err"] < 1e-4
    assert 0 < checks["bfloat16"]["vs_fp32_err"] <= 2 * checks["bfloat16"]["hf_vs_fp32_err"] + 0.02
    out = capsys.readouterr().out
    assert "x roof" in out and "streaming bandwidth after the rows, over 16 MiB" in out
    assert "GPT-2-small shape: batch-1 decode" in out
    assert len(result["targets"]) == 9 and result["ckpt"] is None
    assert result["targets"][-1]["status"] == "PASS", result["targets"][-1]  # the one call took the decode kernel
    assert {c["compiled_path"] for c in result["checks"]} == {"kernel" if checks["float32"]["kernel_serves"]
                                                               else "graph"}


def test_decode_check_fails_loudly_when_the_weights_differ():
    ours, hf, _ = decode.models(decode.QUICK, torch.device("cpu"))
    with torch.no_grad():
        hf.transformer.h[0].attn.c_attn.weight[0, 0] += 1.0
    with pytest.raises(common.CorrectnessError, match="our logits vs transformers'"):
        decode._check(ours, hf, torch.randint(512, (1, 8)), decode.QUICK, "gpt2", "float32", ours, ours)


def test_a_low_precision_check_measures_both_roundings_against_float32():
    torch.manual_seed(0)
    exact = torch.randn(4, 64) * 5
    theirs = exact.bfloat16()
    ours = (exact + 0.01 * torch.randn(4, 64)).bfloat16()  # another rounding: ours and theirs differ by both
    assert common.rel_error(ours, theirs) > 0
    err, ref = common.check_rounding("ok", ours, theirs, exact)
    assert 0 < err <= 2 * ref + 0.02
    with pytest.raises(common.CorrectnessError, match="wrong: relative error to float32"):
        common.check_rounding("wrong", exact + 0.2 * exact.abs().max(), theirs, exact)  # control: 20% off


def test_one_position_far_off_in_either_rounding_is_not_a_failure_but_every_position_off_is():
    torch.manual_seed(1)
    exact = torch.randn(1, 48, 64) * 5  # (B, T, V)
    ours, theirs = exact.bfloat16(), exact.bfloat16()
    ours[0, 1] += 0.5 * exact.abs().max()  # a massive activation's position, rounded unluckily
    err, ref = common.check_rounding("one position", ours, theirs, exact)
    assert err > ref and err <= 2 * ref + 0.02
    with pytest.raises(common.CorrectnessError):
        common.check_rounding("every position", exact + 0.05 * exact.abs().max(), theirs, exact)  # control


def _tiny_llama_folder(path):
    from selfattn.families import writing
    from selfattn.io import export
    from selfattn.tokenizers import ByteTokenizer
    sizes = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32, n_kv_head=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**sizes, **writing.block("llama", sizes), intermediate_size=48)).eval()
    export.export(model, ByteTokenizer(), path)
    return model


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_decode_ckpt_rows_time_ours_and_transformers_eager_and_sdpa_on_our_weights(tmp_path):
    model = _tiny_llama_folder(tmp_path / "llama")
    assert bench(["decode", "--quick", "--threads", "1", "--out", str(tmp_path / "out"), "--prompts", "4",
                     "--new-tokens", "3", "--batches", "1", "2", "--dtypes", "float32", "--reps", "1",
                     "--ckpt", str(tmp_path / "llama"), "--ckpt-prompt", "8", "--ckpt-new-tokens", "4",
                     "--bandwidth-mib", "16"]) == 0
    result = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert result["settings"]["ckpt"] == str(tmp_path / "llama") and result["settings"]["dtypes"] == ["float32"]
    assert result["ckpt"]["name"] == "llama" and result["ckpt"]["params"] == model.num_params()
    rows = {(r["impl"], r["batch"]): r for r in result["results"] if r["model"] == "llama"}
    assert set(rows) == {(i, b) for i in ("kv-cache", "compiled", "hf-sdpa", "hf-eager") for b in (1, 2)}
    for (impl, B), r in rows.items():
        assert r["status"] == "ok" and r["prompt"] == 8 and r["new_tokens"] == 4 and r["dtype"] == "float32"
        assert r["greedy_agrees"]  # identical weights, float32: the same tokens
        assert r["weight_bytes"] == decode.step_bytes(model, B, 9)["weights"]
        assert r["cache_bytes"] == 2 * 2 * B * 2 * 11 * 8 * 4  # 2 layers x (k, v) x B x Hkv x (8 + 4 - 1) x D x 4
    check = next(c for c in result["checks"] if c["model"] == "llama")
    assert check["vs_hf_err"] < 1e-4 and check["cache_err"] < 1e-4 and check["compiled_err"] < 1e-4
    by = {t["target"].split(":")[0]: t for t in result["targets"]}
    assert by["llama"]["status"] in ("PASS", "MISS") and "B=1" in by["llama"]["measured"]
    text = decode.report(result)
    assert "hf-eager" in text and "llama" in text


def test_decode_ckpt_rows_say_when_the_file_is_missing(tmp_path):
    s = decode.Settings(**(vars(decode.QUICK) | dict(prompts=(4,), new_tokens=3, batches=(1,), dtypes=("float32",),
                                                     reps=1, ckpt=str(tmp_path / "absent.gguf"), bandwidth_mib=16,
                                                     memory=False)))
    result = decode.run(s, torch.device("cpu"), log=lambda _: None)
    missing = [r for r in result["results"] if r["model"] == "absent"]
    assert {r["impl"] for r in missing} == {"kv-cache", "compiled", "hf-sdpa", "hf-eager"}
    assert all(r["status"] == "unavailable" and "absent.gguf is missing" in r["reason"] for r in missing)
    assert "unavailable" in decode.report(result)


def test_step_bytes_count_each_weight_once_in_its_dtype_and_the_cache_read():
    torch.manual_seed(0)
    gpt2 = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=4, bias=True))  # tied head
    # by hand, in elements: wte 10x4 (read whole, as the head), ln_1 4+4, qkv 12x4+12, proj 4x4+4, ln_2 4+4,
    # c_fc 16x4+16, c_proj 4x16+4, ln_f 4+4 = 40 + 8 + 60 + 20 + 8 + 80 + 68 + 8 = 292; wpe: B rows of 4
    for B in (1, 3):
        got = decode.step_bytes(gpt2, B, keys=5)
        assert got == {"weights": (292 + 4 * B) * 4, "kv": 2 * B * 2 * 5 * 2 * 4}  # k, v: B x H x S x D x 4 bytes
    assert decode.step_bytes(gpt2.to(torch.bfloat16), 1, 5) == {"weights": 296 * 2, "kv": 2 * 2 * 5 * 2 * 2}
    untied = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=4, bias=True,
                           tie_embeddings=False))
    assert decode.step_bytes(untied, 1, 5)["weights"] == (292 - 40 + 40 + 4 + 4) * 4  # the head whole, a wte row
    window = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=4, bias=True, window=3))
    assert decode.step_bytes(window, 1, 5)["kv"] == 2 * 2 * 3 * 2 * 4  # a window of 3 reads 3 keys, not 5
    gqa = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=2, n_head=4, n_embd=8, n_kv_head=1, pos="rope"))
    assert decode.step_bytes(gqa, 1, 5)["kv"] == 2 * 2 * 1 * 5 * 2 * 4  # 2 layers, one kv head of 2
    from selfattn.generation.int8 import quantize_int8
    wide = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=64, tie_embeddings=False))
    int8 = decode.step_bytes(quantize_int8(copy.deepcopy(wide)), 1, 5)["weights"]  # int8 weights, float32 scales
    assert int8 < decode.step_bytes(wide, 1, 5)["weights"] / 3


def test_roofline_averages_the_cache_over_the_decode_steps():
    torch.manual_seed(0)
    gpt2 = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=4, bias=True))
    r = decode.roofline(gpt2, 1, prompt=3, new_tokens=3)  # steps feed positions 3 and 4: 4 and 5 keys
    per_key = 2 * 2 * 2 * 4  # k and v, H = 2, D = 2, float32
    assert r["kv_bytes_per_step"] == 4.5 * per_key and r["cache_bytes"] == 5 * per_key
    assert r["bytes_per_step"] == r["weight_bytes"] + 4.5 * per_key


def test_peak_memory_sees_what_a_call_allocates_and_not_what_was_there():
    peak = common.PeakMemory(torch.device("cpu"))
    assert peak.unavailable is None
    held = torch.ones(32 * 2 ** 20 // 4)  # resident before: not counted  # noqa: F841
    grown, total = peak.growth(lambda: torch.ones(64 * 2 ** 20 // 4).sum().item())
    assert total == 64 * 2 ** 20 // 4  # the call's own result comes back
    assert 60 * 2 ** 20 <= grown < 96 * 2 ** 20  # 64 MiB, give or take pages the system reclaims meanwhile
    idle, _ = peak.growth(lambda: held.sum().item())  # control: reading what exists allocates nothing
    assert idle < 8 * 2 ** 20


def test_stream_bandwidth_reports_each_kernel_and_the_fastest():
    bw = common.stream_bandwidth(torch.device("cpu"), 8 * 2 ** 20, reps=2)
    assert bw["bytes"] == 8 * 2 ** 20 and bw["reps"] == 2
    assert bw["gbps"] == max(bw[f"{k}_gbps"] for k in ("sum", "copy", "matvec")) > 0
    with pytest.raises(ValueError, match="at least 16 KiB, got 100 bytes"):
        common.stream_bandwidth(torch.device("cpu"), 100)


def test_bandwidth_probe_sums_its_bytes_and_reads_the_median_time():
    probe = common.BandwidthProbe(torch.device("cpu"), 2 ** 20)
    assert probe().item() == 2 ** 18  # a sum of 2^18 ones
    assert probe.gbps([0.001, 1.0, 0.002]) == pytest.approx(2 ** 20 / 0.002 / 1e9)  # the median, not the best
    with pytest.raises(ValueError, match="at least 16 KiB, got 100 bytes"):
        common.BandwidthProbe(torch.device("cpu"), 100)


def _decode_row(impl, model, dtype, B, P, *, tps, prefill, gbps=10.0, peak=1.1):
    return {"model": model, "impl": impl, "dtype": dtype, "batch": B, "prompt": P, "new_tokens": 8, "status": "ok",
            "estimated": False, "decode_tokens_per_s": tps, "tokens_per_s": tps, "prefill_s": prefill,
            "achieved_gbps": gbps, "bandwidth_gbps": 20.0, "roofline_fraction": gbps / 20.0, "peak_ratio": peak}


def _decode_result(ours_tps, hf_tps, gbps, peak, prefill):
    rows = []
    for d in ("float32", "bfloat16"):
        for B in (1, 8):
            rows.append(_decode_row("kv-cache", "smol", d, B, 512, tps=ours_tps, prefill=prefill, gbps=gbps, peak=peak))
            rows.append(_decode_row("hf-sdpa", "smol", d, B, 512, tps=hf_tps, prefill=1.5))
            rows.append(_decode_row("hf-eager", "smol", d, B, 512, tps=hf_tps / 2, prefill=2.0))
            rows.append(_decode_row("kv-cache", decode.GPT2_MODEL, d, B, 16, tps=ours_tps, prefill=1.0, gbps=gbps))
            rows.append(_decode_row("hf-sdpa", decode.GPT2_MODEL, d, B, 16, tps=hf_tps, prefill=1.5))
    return {"bandwidth": {"gbps": 20.0}, "ckpt": {"name": "smol"}, "settings": {"dtypes": ["float32"]},
            "results": rows}


def test_decode_targets_pass_and_miss_on_the_measured_numbers():
    good = decode.targets(_decode_result(ours_tps=30.0, hf_tps=10.0, gbps=18.0, peak=1.1, prefill=1.0))
    bad = decode.targets(_decode_result(ours_tps=9.0, hf_tps=10.0, gbps=10.0, peak=1.5, prefill=2.0))
    assert [t["status"] for t in good] == ["PASS"] * 7 + ["n/a"] * 2  # no context of 1024, no checks
    assert [t["status"] for t in bad] == ["MISS"] * 7 + ["n/a"] * 2
    assert "3.00x (float32 B=1 P=512)" in good[0]["measured"] and "0.90x" in bad[0]["measured"]
    assert "0.50 (float32 B=1 P=512)" in bad[3]["measured"] and "measured around each row's runs" in bad[3]["measured"]
    assert [t["status"] for t in decode.targets({"results": [], "bandwidth": {"gbps": 1.0}})] == ["n/a"] * 9
    one_call = {"model": "smol", "dtype": "float32"}
    for path, serves, status in (("kernel", True, "PASS"), ("graph", False, "PASS"), ("graph", True, "MISS")):
        checks = [dict(one_call, compiled_path=path, kernel_serves=serves)]  # the last: a kernel the call missed
        assert decode.targets(dict(_decode_result(30.0, 10.0, 18.0, 1.1, 1.0), checks=checks))[-1]["status"] == status


def test_decode_targets_take_our_faster_row_eager_or_compiled():
    result = _decode_result(ours_tps=9.0, hf_tps=10.0, gbps=10.0, peak=1.1, prefill=1.0)
    assert decode.targets(result)[0]["status"] == "MISS"  # control: the eager rows alone
    result["results"] += [_decode_row("compiled", "smol", d, B, 512, tps=30.0, prefill=1.0)
                          for d in ("float32", "bfloat16") for B in (1, 8)]
    first = decode.targets(result)[0]
    assert first["status"] == "PASS" and "3.00x (float32 B=1 P=512 compiled)" in first["measured"]


def test_decode_report_warns_when_a_batch_1_row_reads_faster_than_the_roofline():
    result = _decode_result(ours_tps=30.0, hf_tps=10.0, gbps=18.0, peak=1.1, prefill=1.0)
    for r in result["results"]:
        r["roofline_fraction"] = r["achieved_gbps"] / 20.0
    assert decode._over_roofline(result) == []  # 0.9 of the roofline: possible
    result["results"][0]["roofline_fraction"] = 1.3
    assert "1 batch-1 row(s) above the roofline (up to 1.30x)" in decode._over_roofline(result)[0]


def test_train_quick_run_writes_json_and_plot(tmp_path):
    assert bench(["train", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "train.json").read_text())
    assert (tmp_path / "train.png").stat().st_size > 5_000
    assert {"suite", "machine", "settings", "params", "check", "results"} <= set(result)
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == set(train.IMPLS)
    s = result["settings"]
    assert rows["nanogpt"]["tokens_per_s"] == pytest.approx(s["batch_size"] * s["seq_len"] / rows["nanogpt"]["time_s"])
    assert result["check"]["loss_err"] < 1e-5


def test_train_check_fails_loudly_when_the_models_differ():
    nets = train.models(train.QUICK, torch.device("cpu"))
    with torch.no_grad():
        nets["nanogpt"].h[1].mlp.c_fc.bias += 0.5
    x = torch.randint(256, (2, 64))
    with pytest.raises(common.CorrectnessError, match="train: nanogpt loss vs ours"):
        train._check(nets, x, x)


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_finetune_quick_run_checks_both_modes_and_writes_json_and_plot(tmp_path):
    assert bench(["finetune", "--quick", "--threads", "1", "--dtypes", "float32", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "finetune.json").read_text())
    assert (tmp_path / "finetune.png").stat().st_size > 5_000
    assert [(r["mode"], r["impl"]) for r in result["results"]] == [(m, i) for m in finetune.MODES
                                                                   for i in finetune.IMPLS]
    assert all(c["loss_err"] < 1e-5 for c in result["checks"]) and len(result["targets"]) == 3


def test_finetune_check_fails_loudly_when_the_models_differ():
    base, _ = finetune._base(finetune.QUICK)
    pair = finetune._Pair(base, "lora", 4, torch.device("cpu"))
    x = torch.randint(512, (2, 16))
    with torch.no_grad():
        next(iter(lora_modules(pair.models["selfattn"]).values())).lora_B.add_(0.5)
    with pytest.raises(common.CorrectnessError, match="finetune lora float32: transformers vs ours"):
        pair.check(x, x, "float32", "finetune lora float32")


def test_surgery_quick_run_measures_the_changed_model_and_writes_json_and_plot(tmp_path):
    assert bench(["surgery", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "surgery.json").read_text())
    assert (tmp_path / "surgery.png").stat().st_size > 5_000
    before, after = result["results"]
    s = result["settings"]
    assert after["cache_bytes"] < before["cache_bytes"] and before["perplexity"] != after["perplexity"]
    assert after["tokens"] == before["tokens"] == s["windows"] * (s["context"] - 1)
    with pytest.raises(ValueError, match="need sink_tokens < window < context"):
        surgery.Settings(window=64, context=64).check()


def test_bad_settings_are_value_errors_naming_the_value():
    with pytest.raises(ValueError, match=r"every T must divide tokens=512.*\[300\]"):
        attention.Settings(seq_lens=(128, 300), tokens=512).check()
    with pytest.raises(ValueError, match="unknown implementations \\['flash'\\]"):
        attention.Settings(impls=("flash",)).check()
    with pytest.raises(ValueError, match="prompt \\+ new_tokens=128 <= block_size=1024.*\\[900\\]"):
        decode.Settings(prompts=(16, 900)).check()
    with pytest.raises(ValueError, match="dtypes must be some of float32, bfloat16, float16, got \\['int8'\\]"):
        decode.Settings(dtypes=("int8",)).check()
    with pytest.raises(ValueError, match="batches must be positive ints, got \\[0\\]"):
        decode.Settings(batches=(0,)).check()
    with pytest.raises(ValueError, match="device 'tpu9' is not a torch device"):
        _validate.device("tpu9")


def test_decode_flags_set_the_settings_and_no_ckpt_drops_the_checkpoint():
    from benchmarks import cli as bench_cli
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    argv = ["decode", "--batches", "1", "4", "--dtypes", "bfloat16", "--ckpt-prompt", "64", "--no-memory"]
    s = bench_cli._settings("decode", parser.parse_args(argv))
    assert (s.batches, s.dtypes, s.ckpt_prompt, s.memory, s.ckpt) == ((1, 4), ("bfloat16",), 64, False,
                                                                       decode.DEFAULT_CKPT)
    argv = ["decode", "--no-ckpt"]
    assert bench_cli._settings("decode", parser.parse_args(argv)).ckpt is None
    argv = ["decode", "--quick"]  # the quick settings never load a checkpoint
    assert bench_cli._settings("decode", parser.parse_args(argv)).ckpt is None


def test_decode_with_speculative_runs_both_suites_each_with_its_own_settings(tmp_path, monkeypatch):
    from benchmarks import speculative
    ran = {}  # suite name -> the settings it ran with
    for name, suite in (("decode", decode), ("speculative", speculative)):  # runs recorded, reports and plots stubbed
        monkeypatch.setattr(suite, "run", lambda settings, device, log, name=name: ran.update({name: settings}) or {})
        monkeypatch.setattr(suite, "report", lambda result: "")
        monkeypatch.setattr(suite, "plot", lambda result, path: path)
    argv = ["decode", "--quick", "--new-tokens", "5", "--threads", "1", "--out", str(tmp_path)]
    assert bench(argv + ["--speculative"]) == 0
    assert ran["decode"].new_tokens == 5 and ran["speculative"] == speculative.QUICK  # not the decode suite's flags
    assert {p.name for p in tmp_path.iterdir()} == {"decode.json", "speculative.json"}
    ran.clear()
    assert bench(argv) == 0 and list(ran) == ["decode"]


def test_bench_all_gives_every_suite_the_flags_it_takes(tmp_path, monkeypatch):
    import benchmarks as suites
    ran = {}
    for name, suite in suites.SUITES.items():
        monkeypatch.setattr(suite, "run", lambda settings, device, log, name=name: ran.update({name: settings}) or {})
        monkeypatch.setattr(suite, "report", lambda result: "")
        monkeypatch.setattr(suite, "plot", lambda result, path: path)
    assert bench(["all", "--quick", "--reps", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    assert ran and all(settings.reps == 2 for settings in ran.values() if hasattr(settings, "reps"))


def test_the_default_model_is_the_one_make_models_fetches():  # the benchmarks moved out of the package once
    from helpers.smollm2 import PATH

    assert decode.DEFAULT_CKPT == str(PATH)


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_serving_quick_run_serves_each_count_of_clients_and_writes_json_and_plot(tmp_path):
    from benchmarks import serving
    assert bench(["serving", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serving.json").read_text())
    assert (tmp_path / "serving.png").stat().st_size > 5_000
    s = result["settings"]
    assert [(r["server"], r["clients"]) for r in result["results"]] == [(serving.OURS, c) for c in s["clients"]]
    for row in result["results"]:
        assert row["requests"] == row["clients"] * s["reps"]
        assert 0 < row["completion_tokens"] <= row["requests"] * s["max_tokens"]
        assert row["tokens_per_s"] == pytest.approx(row["completion_tokens"] / row["wall_s"])
        assert 0 < row["ttft_median_s"] <= row["ttft_p95_s"] and row["itl_median_s"] <= row["itl_p95_s"]
    assert "GGUF" in result["llama_missing"] and list(result["check"]) == [serving.OURS]
    assert len(result["check"][serving.OURS]) == len(serving.PROMPTS)
    assert [t["status"] for t in result["targets"]][1:] == ["n/a"] * len(s["clients"])


def test_serving_refuses_bad_settings_and_says_why_a_server_did_not_start(tmp_path, monkeypatch, capsys):
    import sys

    from benchmarks import llama_cpp, serving
    assert bench(["serving", "--quick", "--clients", "1", "0", "--out", str(tmp_path)]) == 2
    assert "clients must be positive ints, got [1, 0]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_batch must be in 1..16"):
        serving.Settings(max_batch=17).check()
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    assert llama_cpp.program("llama-server") == (None, f"no llama-server in {tmp_path} ($LLAMA_CPP_BIN)")
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(OSError, match="exited with status 3: no model here"):
        with serving._launched("broken", argv, serving._free_port(), start_s=30.0):
            pass


@pytest.mark.models  # the suite loads them, and runs llama-completion
@pytest.mark.llama_cpp
def test_loading_quick_run_times_ours_beside_llama_cpp_and_writes_json_and_plot(tmp_path):
    assert bench(["loading", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "loading.json").read_text())
    assert (tmp_path / "loading.png").stat().st_size > 5_000
    (row,) = result["results"]
    assert row["model"] == "SmolLM2-135M Q4_1" and 0 < row["load_s"] <= row["ready_s"] and row["llama_cpp_s"] > 0
    assert result["llama_missing"] is None and [t["status"] for t in result["targets"]] in (["PASS"], ["MISS"])
