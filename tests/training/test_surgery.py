"""Attention surgery on a loaded model before fine-tuning (``train --init-from PATH --set FIELD=VALUE``):
fields that change no shape are set as they are; fewer key/value heads are mean-pooled groups."""
import dataclasses

import pytest
import torch

from selfattn.cli import main
from selfattn.io import loading
from selfattn.io.loading import Loaded
from selfattn.training import finetune

from helpers.models import scrambled, small

MICRO = ["--batch-size", "4", "--max-steps", "1", "--eval-every", "1", "--set", "eval_batches=1"]


def _loaded(model) -> Loaded:
    return Loaded(model, None, None, "source")


@pytest.mark.parametrize("variant", [{}, {"pos": "rope", "qkv_bias": True}, {"pos": "rope", "qk_norm": "projection",
                                                                            "norm": "rmsnorm"}])
def test_fewer_kv_heads_are_the_mean_of_their_groups(variant):
    source = scrambled(small(n_kv_head=4, **variant))
    idx = torch.randint(0, 61, (2, 12))
    config = finetune.changed_config(source, {"n_kv_head": 2}, "source")
    pooled = finetune.start_from(_loaded(source), config, "source").eval()
    assert [b.attn.n_kv_head for b in pooled.blocks] == [2, 2]
    moved = (pooled(idx)[0] - source(idx)[0]).abs().amax()
    assert moved > 1e-2  # the heads differed: pooling changes the function ...
    with torch.no_grad():  # ... and where each group's heads are equal, pooling them changes nothing
        for b in source.blocks:
            D, HD = b.attn.head_dim, b.attn.n_head * b.attn.head_dim
            for name in ("weight", "bias"):
                t = getattr(b.attn.qkv, name)
                if t is not None:
                    kv = t[HD:].view(-1, 2, D, *t.shape[1:])  # (2·Hkv / 2, 2, D, ...): pairs of heads
                    kv[:, 1] = kv[:, 0]
            if b.attn.k_norm is not None and b.attn.k_norm.weight.shape[0] != D:
                b.attn.k_norm.weight.view(-1, 2, D)[:, 1] = b.attn.k_norm.weight.view(-1, 2, D)[:, 0]
    pooled = finetune.start_from(_loaded(source), config, "source").eval()
    torch.testing.assert_close(pooled(idx)[0], source(idx)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fields, words", [
    ({"n_kv_head": 3}, "n_head=4 is not a multiple of n_kv_head=3"),
    ({"n_kv_head": 8}, "not a multiple of n_kv_head=8"),
    ({"window": 24}, "window=24 is not shorter than block_size=24"),
    ({"sink_tokens": 2}, r"needs a window longer than them \(window=None\)"),
    ({"window": 4, "sink_tokens": 4}, "window=4"),
    ({"n_embd": 64}, "cannot fill"),
])
def test_a_change_the_model_cannot_take_is_refused_naming_it(fields, words):
    with pytest.raises(ValueError, match=words):
        finetune.changed_config(scrambled(small(n_kv_head=4)), fields, "source")


def test_a_window_with_sink_tokens_trains_from_a_run(tmp_path, capsys):
    base = tmp_path / "base"
    assert main(["train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", *MICRO,
                 "--out", str(base)]) == 0
    out = tmp_path / "streaming"
    assert main(["train", "--init-from", str(base), "--set", "window=8", "--set", "sink_tokens=2", *MICRO,
                 "--out", str(out)]) == 0
    config = loading.load(out).model.config
    assert (config.window, config.sink_tokens) == (8, 2)
    assert dataclasses.replace(config, window=None, sink_tokens=None) == loading.load(base).model.config
    capsys.readouterr()
    assert main(["train", "--init-from", str(base), "--set", "window=99", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "window=99 is not shorter than block_size=16" in err, err
