"""`selfattn sample --speculative lookup|self:N|draft:PATH`: greedy, the text is plain sampling's
with every drafter; a bad value is refused by the flag's name before the prompt is printed."""
import pytest

from selfattn.cli import main


def _train(out, layers):
    assert main(["train", "--n-layer", str(layers), "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                 "--batch-size", "8", "--max-steps", "4", "--eval-every", "4", "--set", "eval_batches=1",
                 "--save-every", "4", "--lr", "1e-2", "--out", str(out)]) == 0
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A micro model of 2 layers (block_size 16: long samples slide) and a 1-layer draft."""
    folder = tmp_path_factory.mktemp("speculative")
    return _train(folder / "target", 2), _train(folder / "draft", 1)


def _greedy(capsys, target, *flags):
    assert main(["sample", "--ckpt", target, "--prompt", "to be or not to be, ", "--max-new-tokens", "40",
                 "--temperature", "0", *flags]) == 0
    return capsys.readouterr().out


def test_greedy_text_is_the_same_with_every_drafter(runs, capsys):
    target, draft = runs
    plain = _greedy(capsys, target)
    assert plain.startswith("to be or not to be, ") and len(plain) > 30
    for how in ("lookup", "self:1", f"draft:{draft}"):
        assert _greedy(capsys, target, "--speculative", how) == plain, how
    assert _greedy(capsys, draft) != plain  # control: the draft alone writes other text


@pytest.mark.parametrize("how, words", [
    ("self:2", ["--speculative self:2", "n_layer=2"]),
    ("medusa", ["--speculative must be lookup, self:N or draft:PATH, got 'medusa'"]),
    ("draft:", ["--speculative draft:", "a path"]),
    ("draft:/no/such/run", ["--speculative draft:/no/such/run", "does not exist"]),
])
def test_bad_values_are_refused_before_the_prompt_is_printed(runs, capsys, how, words):
    assert main(["sample", "--ckpt", runs[0], "--prompt", "The prompt", "--speculative", how]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("selfattn sample: error: ") and all(w in err for w in words), err
