"""No long silence (#57): the library's slow steps (loading weights, tokenizing a corpus or a chat file, exporting a
folder or a GGUF file, quantizing, the perplexity probe) report their progress to the reporter the CLI installs,
and print nothing without one; the terminal reporter shows tqdm bars on stderr, none under ``TQDM_DISABLE`` or
off a terminal. Ctrl-C during training names the step, the last checkpoint and the command that continues."""
import io
import json

import pytest

from selfattn._util import progress
from selfattn.cli import INTERRUPTED
from selfattn.tokenizers import BPETokenizer
from selfattn.tokenizers.chat import ChatTemplate
from selfattn.training import chat, checkpoint, data

from helpers.gguf_export import command

TEXT = "The cat sat on the mat. The dog sat on the log. " * 60
RUN = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
       "--save-every", "2", "--eval-every", "2", "--set", "eval_batches=1", "--arch", "llama"]


class Fake:
    """A reporter that records what is reported: ("track", what, items) and ("stage", what)."""

    def __init__(self):
        self.seen = []

    def track(self, iterable, what, total, unit):
        items = list(iterable)
        self.seen.append(("track", what, len(items)))
        return items

    def stage(self, what):
        self.seen.append(("stage", what))
        return progress.contextlib.nullcontext()

    def names(self) -> list[str]:
        return [entry[1] for entry in self.seen]


@pytest.fixture
def fake(monkeypatch):
    """The CLI's reporter replaced by a Fake (as if stderr were a terminal)."""
    reporter = Fake()
    monkeypatch.setattr(progress, "terminal", lambda stream=None: reporter)
    return reporter


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Llama-block run on a text file."""
    root = tmp_path_factory.mktemp("silences")
    (root / "text.txt").write_text(TEXT)
    code, _, err = command("train", *RUN, "--data", str(root / "text.txt"), "--max-steps", "2",
                           "--out", str(root / "run"))
    assert code == 0, err
    return root / "run"


def test_training_reports_tokenizing_its_corpus(fake, tmp_path):
    (tmp_path / "text.txt").write_text(TEXT)
    code, _, err = command("train", *RUN, "--data", str(tmp_path / "text.txt"), "--max-steps", "1",
                           "--out", str(tmp_path / "run"))
    assert code == 0, err
    assert any(name.startswith("tokenizing") for name in fake.names()), fake.seen
    assert any(name.startswith("writing the token cache") for name in fake.names()), fake.seen


def test_a_gguf_export_reports_each_step_and_a_folder_export_too(fake, run, tmp_path):
    (tmp_path / "ppl.txt").write_text(TEXT)
    code, _, err = command("export", "--ckpt", str(run), "--out", str(tmp_path / "m.gguf"), "--type", "q8_0",
                           "--ppl-data", str(tmp_path / "ppl.txt"))
    assert code == 0, err
    names = fake.names()
    for step in ("converting the tensors", "q8_0 tensors", "writing the GGUF file", "loading the weights",
                 "checking its logits", "perplexity"):
        assert step in names, (step, fake.seen)
    assert ("track", "q8_0 tensors", 12) in fake.seen  # every tensor of the file, quantized one by one

    fake.seen.clear()  # the GGUF file back to a folder: loading it, converting, writing
    code, _, err = command("export", "--ckpt", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert {"loading the weights", "converting the model for transformers", "checking its logits",
            "writing hf"} <= set(fake.names()), fake.seen


def test_a_chat_file_reports_its_conversations():
    tok = BPETokenizer.train(TEXT, 300)
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", {}, "t")
    conversations = [chat.Conversation(i + 1, [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "the cat"}]) for i in range(5)]
    reporter = Fake()
    with progress.reporting(reporter):
        chat.encode_all(conversations, tok, template, where="chat.jsonl", block_size=64)
    assert reporter.seen == [("track", "tokenizing chat.jsonl", 5)]


def test_without_a_reporter_nothing_is_reported_or_printed(run, tmp_path, capsys):
    assert progress.track(x := [1, 2], "x") is x  # the iterable itself
    with progress.stage("nothing"):
        pass
    (tmp_path / "text.txt").write_text(TEXT)
    data.prepare(tmp_path / "cache", data=str(tmp_path / "text.txt"), tokenizer="byte", bpe_vocab=0,
                 val_fraction=0.1, block_size=16)
    code, _, err = command("export", "--ckpt", str(run), "--out", str(tmp_path / "m.gguf"))  # stderr: no terminal
    assert code == 0 and err == "", err
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_terminal_reporter_draws_on_a_terminal_unless_disabled(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    assert progress.terminal(io.StringIO()) is None  # not a terminal: no bar
    stream = Terminal()
    reporter = progress.terminal(stream)
    assert reporter is not None
    with progress.reporting(reporter):
        assert list(progress.track(range(3), "loading the weights", unit="tensor")) == [0, 1, 2]
    assert "loading the weights" in stream.getvalue()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert progress.terminal(Terminal()) is None
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert progress.terminal(Terminal()) is not None
    monkeypatch.setenv("RANK", "1")  # another rank than 0 under torchrun
    assert progress.terminal(Terminal()) is None


@pytest.mark.parametrize("stop_at, saved", [(3, 2), (1, None)])
def test_ctrl_c_in_training_names_the_last_checkpoint_and_how_to_continue(tmp_path, monkeypatch, stop_at, saved):
    import selfattn.cli.train as train_cli

    real = train_cli.train

    def interrupted_at(*args, on_event, **kw):
        def events(kind, record):
            on_event(kind, record)
            if kind == "step" and record["step"] == stop_at:
                raise KeyboardInterrupt
        return real(*args, on_event=events, **kw)

    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "run"
    monkeypatch.setattr(train_cli, "train", interrupted_at)
    code, _, err = command("train", *RUN, "--data", str(tmp_path / "text.txt"), "--max-steps", "4",
                           "--out", str(out))
    err = err.splitlines()[-1]  # after the training bar: one line
    assert code == INTERRUPTED, err
    if saved is None:
        assert f"interrupted at step {stop_at}; no checkpoint was saved yet" in err, err
        return
    assert (f"selfattn train: interrupted at step {stop_at}; the last checkpoint is step {saved} "
            f"({checkpoint.latest(out)}): continue with: selfattn train --resume --out {out}") in err, err
    monkeypatch.setattr(train_cli, "train", real)
    code, printed, err = command(*err.split("continue with: selfattn ")[1].split())  # the command it names
    assert code == 0 and "resuming at step 2" in printed and "done, step 4" in printed, err
    assert json.loads((out / "log.jsonl").read_text().splitlines()[-1])["step"] == 4
