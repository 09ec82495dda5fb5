"""Perplexity over sliding contexts (selfattn.training.evaluate, `selfattn eval`): the number transformers'
perplexity guide computes on the same ids, for disjoint, overlapping and short windows; the
command prints it; bad input is one line before the model loads. On chat data: the loss over the
assistant's tokens only, checked on SmolLM2 against the model's own logits."""
import json
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402  (the [hf] extra, part of [dev])

from selfattn.cli import eval as eval_cli  # noqa: E402
from selfattn.cli import main  # noqa: E402
from selfattn.config import GPTConfig  # noqa: E402
from selfattn.io import loading  # noqa: E402
from selfattn.io.hf import to_hf  # noqa: E402
from selfattn.training import chat  # noqa: E402
from selfattn.training.evaluate import IGNORE, masked_perplexity, perplexity  # noqa: E402

from helpers.models import scrambled  # noqa: E402
from helpers.perplexity import guide_perplexity  # noqa: E402
from helpers.smollm2 import smollm2  # noqa: E402

transformers.logging.set_verbosity_error()
BLOCK = 32
# (tokens, window, stride) -> (windows, tokens predicted)
CASES = {
    "disjoint": ((100, 32, 32), (4, 96)),  # each window's first token is not predicted
    "disjoint, a last window of one token": ((97, 32, 32), (3, 93)),  # which predicts nothing
    "overlapping": ((100, 32, 8), (10, 99)),  # every token but the first, once
    "overlapping, stride not dividing": ((90, 32, 13), (6, 89)),
    "shorter than one window": ((20, 32, 32), (1, 19)),
    "shorter than one window, overlapping": ((20, 32, 8), (1, 19)),
}


@pytest.fixture(scope="module")
def gpt2():
    """Our GPT built as GPT-2 (learned positions, biases), every weight random, dropout on and in
    training mode (perplexity must read it in eval mode), and the same model in transformers."""
    torch.manual_seed(0)
    ours = scrambled(GPTConfig(vocab_size=61, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, bias=True,
                               dropout=0.1)).train()
    return ours, to_hf(ours).eval()


def ids_of(n: int) -> list[int]:
    return torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize("case", CASES)
def test_equals_the_guide_on_transformers(gpt2, case):
    ours, hf = gpt2
    (n, window, stride), (windows, tokens) = CASES[case]
    ids = ids_of(n)
    got = perplexity(ours, ids, context=window, stride=stride)
    loss, predicted = guide_perplexity(hf, ids, window, stride)
    expected = math.exp(loss)
    print(f"{case}: perplexity ours {got.perplexity:.7f}, transformers {expected:.7f}, "
          f"relative difference {abs(got.perplexity / expected - 1):.1e}")
    assert (got.contexts, got.tokens, got.context, got.stride) == (windows, tokens, window, stride)
    assert predicted == tokens
    assert got.loss == pytest.approx(loss, rel=1e-5) and got.perplexity == pytest.approx(expected, rel=1e-5)
    assert got.perplexity == pytest.approx(math.exp(got.loss), rel=1e-12)
    assert ours.training  # its mode is given back


@pytest.mark.parametrize("wrong", ["all targets", "window means"])
def test_a_wrong_masking_or_averaging_is_caught(gpt2, wrong):
    """Negative control: the same comparison fails when every window target is counted (tokens
    predicted twice, some with less context) or when the windows' means are averaged."""
    ours, hf = gpt2
    ids = ids_of(100)
    got = perplexity(ours, ids, context=32, stride=8)
    loss, _ = guide_perplexity(hf, ids, 32, 8, wrong=wrong)
    print(f"{wrong}: loss ours {got.loss:.6f}, wrong reference {loss:.6f}")
    assert got.loss != pytest.approx(loss, rel=1e-3)


def test_defaults_read_disjoint_contexts_of_block_size(gpt2):
    ours, _ = gpt2
    ids = torch.tensor(ids_of(100))
    got = perplexity(ours.eval(), ids)
    assert got == perplexity(ours, ids.tolist(), context=BLOCK, stride=BLOCK) and (got.context, got.stride) == (32, 32)
    assert not ours.training  # an eval model stays in eval mode
    ours.train()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(context=0), ValueError, "context must be a positive int, got 0"),
    (dict(stride=-1), ValueError, "stride must be a positive int, got -1"),
    (dict(context=8.0), TypeError, "context must be an int, got float 8.0"),
    (dict(context=8, stride=9), ValueError, "stride=9 is larger than context=8"),
    (dict(context=33), ValueError, "context=33 is longer than the model reads (block_size=32)"),
    (dict(stride=33), ValueError, "stride=33 is larger than context=32"),
    (dict(ids=[5]), ValueError, "at least 2 tokens (one read, one predicted), got 1"),
    (dict(ids=[]), ValueError, "at least 2 tokens (one read, one predicted), got 0"),
    (dict(ids=[[1, 2, 3]]), TypeError, "ids must be a 1-D sequence of token ids, got torch.int64 of shape (1, 3)"),
    (dict(ids=[1.0, 2.0]), TypeError, "ids must be a 1-D sequence of token ids, got torch.float32 of shape (2,)"),
])
def test_bad_arguments_are_refused_naming_the_values(gpt2, kwargs, error, message):
    ours, _ = gpt2
    ids = kwargs.pop("ids", [1, 2, 3])
    with pytest.raises(error) as e:
        perplexity(ours, ids, **kwargs)
    assert message in str(e.value)


TEXT = "the cat sat on the mat. the dog sat on the log. " * 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A micro model trained for a few steps (block_size 16), and a text file."""
    root = tmp_path_factory.mktemp("eval")
    assert main(["train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                 "--batch-size", "8", "--max-steps", "4", "--eval-every", "4", "--set", "eval_batches=1",
                 "--save-every", "4", "--lr", "1e-2", "--out", str(root / "run")]) == 0
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return root / "run", root / "text.txt"


@pytest.mark.parametrize("flags, context, stride", [([], 16, 16), (["--context", "12", "--stride", "5"], 12, 5),
                                                    (["--stride", "4"], 16, 4)])
def test_the_command_prints_the_librarys_perplexity(run, capsys, flags, context, stride):
    ckpt, data = run
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(data), "--device", "cpu", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    loaded = loading.load(ckpt)
    ids = loaded.require_tokenizer().encode(TEXT)
    expected = perplexity(loaded.model, ids, context=context, stride=stride)
    print("\n".join(lines))
    assert lines[-1] == f"perplexity {expected.perplexity:.6g}" and lines[-2] == f"loss {expected.loss:.6g}"
    assert f"{len(ids):,} tokens, {expected.tokens:,} predicted" in lines[1]
    assert f"{expected.contexts} contexts of up to {context} tokens, stride {stride}" in lines[2]


@pytest.mark.parametrize("flags, message", [
    (["--data", "{missing}"], "data path '{missing}' does not exist"),
    (["--data", "{empty}"], "data path '{empty}' holds no text (empty)"),
    (["--data", "/dev/null"], "data path '/dev/null' is not a regular file or a folder (a device or a pipe?)"),
    (["--data", "{folder}"], "--data '{folder}' is a folder; give a text file"),
    (["--data", "{text}", "--stride", "0"], "--stride must be a positive number of tokens, got 0"),
    (["--data", "{text}", "--context", "-3"], "--context must be a positive number of tokens, got -3"),
    (["--data", "{text}", "--context", "8", "--stride", "9"], "--stride 9 is larger than --context 8"),
])
def test_bad_input_is_one_line_before_the_model_loads(run, tmp_path, capsys, monkeypatch, flags, message):
    ckpt, text = run
    (tmp_path / "empty.txt").touch()
    names = dict(missing=tmp_path / "nothing.txt", empty=tmp_path / "empty.txt", folder=tmp_path, text=text)
    flags = [flag.format(**names) for flag in flags]
    monkeypatch.setattr(eval_cli, "load", lambda path: pytest.fail("the model was loaded"))
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(ckpt), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selfattn eval: error: ") and message.format(**names) in err, err


def test_a_stride_past_the_default_context_is_refused_naming_block_size(run, capsys):
    ckpt, text = run
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(text), "--stride", "17"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stride 17 is larger than the model's block_size 16" in err, err


# --- sequences with their own targets: chat data ------------------------------------------------

def test_masked_perplexity_is_the_mean_loss_over_the_targets(gpt2):
    ours, _ = gpt2
    g = torch.Generator().manual_seed(1)
    sequences = []
    for n in (5, 32, 17):
        ids = torch.randint(0, 61, (n,), generator=g)
        targets = torch.where(torch.rand(n, generator=g) < 0.5, torch.roll(ids, -1), IGNORE)  # (n,)
        targets[-1] = IGNORE
        sequences.append((ids.tolist(), targets.tolist()))
    got = masked_perplexity(ours, sequences)
    with torch.no_grad():
        ours.eval()
        nll = [F.cross_entropy(ours(torch.tensor([ids]))[0][0], torch.tensor(targets), reduction="sum")
               for ids, targets in sequences]
        ours.train()
    tokens = sum(sum(t != IGNORE for t in targets) for _, targets in sequences)
    assert (got.tokens, got.sequences) == (tokens, 3) and ours.training
    assert got.loss == pytest.approx(sum(nll).item() / tokens, rel=1e-6)
    assert got.perplexity == pytest.approx(math.exp(got.loss), rel=1e-12)
    with pytest.raises(ValueError, match=r"none of the 1 sequence\(s\) has a target"):
        masked_perplexity(ours, [([1, 2, 3], [IGNORE] * 3)])


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Count to three."},
     {"role": "assistant", "content": "One, two, three."}],
]


def test_the_command_on_a_chat_file_measures_the_assistants_tokens_only(tmp_path, capsys):
    """On SmolLM2: the printed perplexity is the one computed here from the model's logits and
    cross-entropy on the assistant's tokens; the loss over every token (negative control) differs."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(smollm2()), "--data", str(data), "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    print("\n".join(lines))
    loaded = loading.load(smollm2())
    nll, tokens, nll_all, tokens_all = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for messages in CONVERSATIONS:
            ids, mask = chat.encode(messages, loaded.tokenizer, loaded.chat)
            logits = loaded.model.eval()(torch.tensor([ids]))[0][0, :-1]  # (T - 1, V): each predicts the next
            losses = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")  # (T - 1,)
            assistant = torch.tensor(mask[1:])  # (T - 1,) the next token is the assistant's
            nll, tokens = nll + losses[assistant].sum().item(), tokens + int(assistant.sum())
            nll_all, tokens_all = nll_all + losses.sum().item(), tokens_all + len(losses)
    expected, everything = math.exp(nll / tokens), math.exp(nll_all / tokens_all)
    got = float(lines[-1].removeprefix("perplexity "))
    print(f"perplexity printed {got}, reference {expected:.6f}, over every token {everything:.6f}")
    assert lines[-1].startswith("perplexity ") and got == pytest.approx(expected, rel=2e-5)
    assert "2 conversations" in lines[1] and f"{tokens:,} assistant tokens predicted" in lines[1]
    assert got != pytest.approx(everything, rel=1e-2)  # negative control: the prompts are not counted


@pytest.mark.parametrize("flags, message", [
    (["--context", "8"], "--context and --stride read a text in sliding contexts; the chat file '{chat}' is read "
                         "one whole conversation a forward"),
    (["--stride", "8"], "--context and --stride read a text in sliding contexts"),
    ([], "{chat} line 2: not JSON"),
])
def test_bad_chat_input_is_one_line_before_the_model_loads(run, tmp_path, capsys, monkeypatch, flags, message):
    ckpt, _ = run
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + ("{" if not flags else "") + "\n")
    monkeypatch.setattr(eval_cli, "load", lambda path: pytest.fail("the model was loaded"))
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(data), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selfattn eval: error: ") and message.format(chat=data) in err, err


def test_a_model_without_a_chat_template_is_refused_on_chat_data(run, tmp_path, capsys):
    ckpt, _ = run
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    assert main(["eval", "--ckpt", str(ckpt), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no chat template" in err, err
