"""python -m benchmarks interp: the quick suite (a small random Llama-shaped model, no model file) times every row
against TransformerLens after checking it, and writes its JSON and plot; its correctness check fails where ours
computes something else (a perturbed weight, a sweep that differs, scores masked elsewhere)."""
import argparse
import json

import pytest
import torch

from benchmarks import common, interp
from benchmarks.cli import run as bench

ROWS = [("forward", "selfattn"), ("every site", "selfattn"), ("every site", "TransformerLens"),
        ("3 sites", "selfattn"), ("3 sites", "TransformerLens"), ("head sweep", "selfattn"),
        ("head sweep", "TransformerLens")]


@pytest.mark.slow  # make check leaves it out: TransformerLens boots (as in tests/interp's patching tests)
def test_interp_quick_run_checks_and_times_every_row_and_writes_json_and_plot(tmp_path, capsys):
    assert interp.QUICK.ckpt is None  # no model file: the test needs no `models` mark
    assert bench(["interp", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "interp.json").read_text())
    assert (tmp_path / "interp.png").stat().st_size > 5_000
    s, rows, checks = result["settings"], result["results"], result["checks"]
    assert [(r["row"], r["impl"]) for r in rows] == ROWS
    for r in rows:
        assert len(r["times_s"]) == (s["sweep_reps"] if r["row"] == "head sweep" else s["reps"])
        assert r["time_s"] == common.median(r["times_s"]) > 0
        assert r["peak_bytes"] is None or r["peak_bytes"] >= 0  # None: no peak memory on this machine
    n_layer = result["n_layer"]
    assert checks["every site"]["sites"] >= 20 * n_layer  # each head's result among them (on in theirs)
    assert checks["3 sites"]["sites"] == 3 and result["few_sites"] == interp.few_sites(n_layer)
    assert max(checks[row]["error"] for row in ("every site", "3 sites", "head sweep")) <= 1e-4
    assert [t["status"] for t in result["targets"]][2] == "PASS"  # the agreement with TransformerLens
    assert all(t["status"] in ("PASS", "MISS") for t in result["targets"])
    out = capsys.readouterr().out
    assert "head sweep at least 3x faster than TransformerLens's" in out and "TL / ours" in out


@pytest.mark.slow  # make check leaves it out: TransformerLens boots
def test_interp_check_fails_when_our_weights_differ_from_transformer_lens(monkeypatch):
    boot = interp._bridge

    def perturbed(model, *args):  # TransformerLens gets the weights as they were, ours then change
        bridge = boot(model, *args)
        with torch.no_grad():
            model.blocks[1].attn.qkv.weight.mul_(1.1)
        return bridge
    monkeypatch.setattr(interp, "_bridge", perturbed)
    with pytest.raises(common.CorrectnessError, match=r"every site: blocks\.1\.\S+ differs from TransformerLens's by"):
        interp.run(interp.QUICK, torch.device("cpu"), log=lambda line: None)


def test_the_checks_see_a_difference_and_skip_only_the_same_masked_scores():
    values = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 5  # (L, H)
    assert interp.check_sweeps(values.clone(), values) == 0
    with pytest.raises(common.CorrectnessError, match="head sweep: ours differs from TransformerLens's"):
        interp.check_sweeps(values + 1e-3 * values.abs().amax(), values)
    scores = torch.randn(1, 2, 4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf"))
    assert interp.site_error(scores.clone(), scores, "scores") == 0
    with pytest.raises(common.CorrectnessError, match=r"scores: masked \(-inf\) in other places"):
        interp.site_error(scores.tril(), scores, "scores")
    with pytest.raises(common.CorrectnessError, match=r"z: shape \(1, 4\) where TransformerLens has \(1, 5\)"):
        interp.site_error(torch.zeros(1, 4), torch.zeros(1, 5), "z")
    ours = (torch.zeros(1, 2, 3), {"blocks.0.attn.hook_z": torch.ones(2)})
    with pytest.raises(common.CorrectnessError, match=r"do not both hold \['blocks\.0\.hook_resid_post'\]"):
        interp.check_caches(ours, ours, {"blocks.0.attn.hook_z", "blocks.0.hook_resid_post"}, "every site")


def test_interp_flags_set_the_settings_and_bad_prompts_are_refused():
    from benchmarks import cli as bench_cli
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    argv = ["interp", "--tokens", "64", "--sweep-reps", "2", "--reps", "4", "--no-memory", "--ckpt", "model.gguf"]
    s = bench_cli._settings("interp", parser.parse_args(argv))
    assert (s.tokens, s.sweep_reps, s.reps, s.memory, s.ckpt) == (64, 2, 4, False, "model.gguf")
    assert bench_cli._settings("interp", parser.parse_args(["interp", "--quick"])).ckpt is None
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        interp.Settings(tokens=0).check()
    tokenizer = interp._ours(interp.QUICK)[1]  # bytes
    with pytest.raises(ValueError, match=r"'The capital of France is' is 24 tokens and the corrupted one .* 23"):
        interp._prompts(tokenizer, interp.Settings(clean="The capital of France is"), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"answer ' Paris' must be one token, it is 6"):
        interp._prompts(tokenizer, interp.Settings(clean="The capital of Spain is"), torch.device("cpu"))
