"""selfattn bench: the peers compute what we compute, the counts and checks are right, and
each suite's quick run writes its JSON and plot."""
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from selfattn import SelfAttention, _validate
from selfattn.bench import attention, common, decode, memory, train
from selfattn.bench.peers import ATTENTION_PEERS, NanoGPT, SeedSelfAttention, attention_peer
from selfattn.cli import main as cli_main
from selfattn.model import GPT, GPTConfig


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
    (logits, loss), (nano_logits, nano_loss) = gpt(idx, tgt), nano(idx, tgt)
    torch.testing.assert_close(nano_logits, logits, rtol=1e-12, atol=1e-12)
    loss.backward()
    nano_loss.backward()
    nano_params = dict(nano.named_parameters())
    for key, p in gpt.named_parameters():  # our loss is computed from float32 logits: float32 agreement
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
    assert cli_main(["bench", "attention", "--quick", "--threads", "1", "--dtype", "float32", "--no-memory",
                     "--impls", "math", "nanogpt", "--out", str(tmp_path)]) == 1
    assert "FAILED the correctness check" in capsys.readouterr().err
    assert not (tmp_path / "attention.json").exists()


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


def test_attention_quick_run_writes_json_and_plot(tmp_path, capsys):
    assert cli_main(["bench", "attention", "--quick", "--threads", "1", "--out", str(tmp_path),
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


def test_decode_quick_run_writes_json_and_plot(tmp_path, capsys):
    assert cli_main(["bench", "decode", "--quick", "--threads", "1", "--out", str(tmp_path),
                     "--prompts", "8", "--new-tokens", "16", "--reps", "2"]) == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    assert (tmp_path / "decode.png").stat().st_size > 10_000
    assert {"suite", "machine", "settings", "params", "checks", "results", "targets"} <= set(result)
    rows = {r["impl"]: r for r in result["results"]}
    assert set(rows) == set(decode.IMPLS) and all(r["status"] == "ok" for r in rows.values())
    assert rows["no-cache"]["estimated"] and not rows["kv-cache"]["estimated"]
    assert rows["kv-cache"]["tokens_per_s"] == pytest.approx(16 / rows["kv-cache"]["time_s"])
    assert result["checks"][0]["vs_hf_err"] < 1e-4 and result["checks"][0]["cache_err"] < 1e-4
    assert "kv-cache decoding >= 2x" in capsys.readouterr().out


def test_decode_check_fails_loudly_when_the_weights_differ():
    ours, hf, _ = decode.models(decode.QUICK, torch.device("cpu"))
    with torch.no_grad():
        hf.transformer.h[0].attn.c_attn.weight[0, 0] += 1.0
    with pytest.raises(common.CorrectnessError, match="our logits vs transformers'"):
        decode._check(ours, hf, torch.randint(512, (1, 8)), decode.QUICK)


def test_train_quick_run_writes_json_and_plot(tmp_path):
    assert cli_main(["bench", "train", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
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


def test_bad_settings_are_value_errors_naming_the_value():
    with pytest.raises(ValueError, match=r"every T must divide tokens=512.*\[300\]"):
        attention.Settings(seq_lens=(128, 300), tokens=512).check()
    with pytest.raises(ValueError, match="unknown implementations \\['flash'\\]"):
        attention.Settings(impls=("flash",)).check()
    with pytest.raises(ValueError, match="prompt \\+ new_tokens=256 <= block_size=1024.*\\[900\\]"):
        decode.Settings(prompts=(16, 900)).check()
    with pytest.raises(ValueError, match="device 'tpu9' is not a torch device"):
        _validate.device("tpu9")
