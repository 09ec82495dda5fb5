"""``selfattn check --ckpt FOLDER`` audits every family: the whole model's causality, each window
its layers slide over (the first such layer against that window's rule, at a length past it),
and the KV caches (rolling for windowed layers) against the full forward. A model whose window
mask is one token too wide fails it."""
import pytest
import torch

from selfattn.audit import check_cache, suite
from selfattn.cli import main
from selfattn.io import loading

from helpers.families import CASES, W, build


@pytest.fixture(scope="module", params=list(CASES))
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param).save_pretrained(folder)
    return folder


def test_check_passes_on_every_family(folder, capsys):
    assert main(["check", "--ckpt", str(folder), "--method", "perturb"]) == 0
    out = capsys.readouterr().out
    config = loading.load(folder).model.config
    windows = sorted({config.layer_window(i) for i in range(config.n_layer)} - {None})
    lines = [line for line in out.splitlines() if line.startswith(str(folder))]
    assert len(lines) == 2 + len(windows) and all(" ok " in line for line in lines), out
    for window in windows:  # the default length reaches past the window, so its rule is audited
        assert any(f"window={window} " in line for line in lines), out


def test_the_cache_check_passes_a_correct_mixture_of_experts_with_margin(tmp_path):
    # gpt-oss with weights scrambled harder and a shorter window: its expert mixture rounds more than
    # 16 eps a block (the fixed bound it once failed), as much as its full forward rounds
    folder = tmp_path / "gpt-oss"
    build("gpt-oss", noise=0.3, sliding_window=12).save_pretrained(folder)
    model = loading.load(folder).model
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    report = check_cache(model, ids[:, :12], 12)
    assert report.ok, str(report)
    assert (report.errors <= report.bounds / 2).all(), str(report)  # with a margin of 2 at least


def test_a_window_one_token_too_wide_fails_the_audit(tmp_path):  # negative control
    folder = tmp_path / "mistral"
    build("mistral").save_pretrained(folder)
    model = loading.load(folder).model
    for block in model.blocks:
        block.attn.window = W + 1  # the mask sees one key more than the config's window, which the cache holds
    torch.manual_seed(0)
    reports = {case.name: case.run() for case in suite.model_cases("m", model, W + 4, dict(method="perturb"))}
    assert reports["m"].ok and reports["m kv-cache"].ok  # causal, and its caches follow its attention: no tell
    assert reports[f"m layer 0 window={W}"].leaks  # but the layer depends on the key W back, which its window hides


def test_a_window_past_the_audit_length_is_refused_naming_the_length_it_needs(tmp_path):
    folder = tmp_path / "mistral"
    build("mistral").save_pretrained(folder)
    cases = suite.model_cases("m", loading.load(folder).model, W, dict(method="perturb"))
    assert [c.refused for c in cases if c.refused] == [f"window {W} >= --seq-len {W}: pass --seq-len {W + 1} "
                                                        f"or more to audit it"]
