"""One vocabulary across the commands: ``selfattn --help`` groups them by what a user does; each
command's help ends with an example that parses; a flag name means one thing everywhere (``--ckpt``,
``--device``, ``--dtype``, ``--seed``, ``--text``, ``--random-tokens`` from one definition in
``cli/flags.py``); ``--out`` says FOLDER or FILE; renamed and abbreviated flags are refused; and
``--dtype`` takes effect in every command that takes it."""
import argparse
import shlex
from pathlib import Path

import pytest
import torch

from selfattn.analysis.induction import InductionConfig
from selfattn.cli import COMMANDS, GROUPS, build_parser, flags, main
from selfattn.config import GPTConfig
from selfattn.training.config import TrainConfig

from helpers.models import byte_run

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("--ckpt", "--device", "--dtype", "--seed", "--text", "--random-tokens")  # one definition each


def _parser(name: str) -> argparse.ArgumentParser:
    return build_parser([name])._subparsers._group_actions[0].choices[name]


def _flags(name: str) -> dict[str, argparse.Action]:
    return {option: action for action in _parser(name)._actions for option in action.option_strings}


def test_the_top_level_help_lists_every_command_once_under_what_a_user_does(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert list(GROUPS) == ["use a model", "adapt it", "look inside", "measure"]
    assert all(f"\n{group}:\n" in out for group in GROUPS)
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert sorted(name for name in listed if name in COMMANDS) == sorted(COMMANDS)  # each once
    assert "python -m benchmarks" in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_commands_help_ends_with_an_example_that_parses(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1].strip()
    assert last.startswith(f"selfattn {name} "), last
    argv = shlex.split(last)[1:]
    args, unknown = build_parser(argv).parse_known_args(argv)
    assert not unknown and args.command == name


def test_an_example_that_does_not_parse_is_caught(capsys):  # negative control for the test above
    argv = ["eval", "--ckpt", "x", "--data", "y", "--window", "8"]
    assert build_parser(argv).parse_known_args(argv)[1] == ["--window", "8"]


def test_the_shared_flags_have_one_definition():
    reference = argparse.ArgumentParser()
    flags.add_model(reference)
    flags.add_input(reference, random_tokens=1)
    reference = {o: a for a in reference._actions for o in a.option_strings}
    takers = {flag: [] for flag in SHARED}
    for name in COMMANDS:
        for flag, action in _flags(name).items():
            if flag not in SHARED or name in ("train", "induction"):  # their config fields: below
                continue
            takers[flag].append(name)
            want = reference[flag]
            assert action.help == want.help or flag == "--seed" or (  # --seed says what it seeds
                name == "check" and flag == "--ckpt" and action.help.endswith(": " + flags.CKPT_HELP)), (name, flag)
            same = (action.choices, action.metavar, action.type) == (want.choices, want.metavar, want.type)
            assert same, (name, flag)
            if flag != "--random-tokens":  # its default is each command's size of input
                assert action.default == want.default or (flag == "--ckpt" and not action.required), (name, flag)
    loading = {"sample", "serve", "eval", "heads", "explore", "check", "lens", "patch"}
    assert all(set(takers[flag]) >= loading for flag in ("--ckpt", "--device", "--dtype"))
    assert set(takers["--ckpt"]) == loading | {"export"}  # export reads the model where it is, in float32
    assert set(takers["--seed"]) >= {"sample", "check", "demo", "heads", "explore", "scaling"}
    assert set(takers["--random-tokens"]) == set(takers["--text"]) == {"heads", "explore", "lens"}
    # the commands whose --seed and --device are config fields: the same default
    assert InductionConfig().seed == TrainConfig().seed == flags.SEED == 0
    assert TrainConfig().device == reference["--device"].default == "auto"


def test_every_out_says_whether_it_is_a_folder_or_a_file():
    outs = {name: _flags(name)["--out"] for name in COMMANDS if "--out" in _flags(name)}
    assert set(outs) == {"train", "heads", "induction", "explore", "export", "calibrate", "lens", "patch"}
    for name, action in outs.items():
        assert action.metavar in ("FOLDER", "FILE", "FOLDER|FILE.gguf"), (name, action.metavar)
        words = {"FOLDER": ["folder"], "FILE": ["file"], "FOLDER|FILE.gguf": ["folder", "file"]}[action.metavar]
        assert all(w in action.help.lower() for w in words), (name, action.help)


@pytest.mark.parametrize("argv, old", [
    (["eval", "--ckpt", "x", "--data", "y", "--window", "8"], "--window 8"),  # now --context
    (["heads", "--ckpt", "x", "--length", "4"], "--length 4"),  # now --random-tokens
    (["explore", "--ckpt", "x", "--repeat", "4"], "--repeat 4"),  # now --random-tokens
    (["calibrate", "--masks", "causal"], "--masks causal"),  # --kinds
    (["calibrate", "--dtype", "float32"], "--dtype float32"),  # --dtypes: --dtype is the model's dtype elsewhere
    (["sample", "--ckpt", "x", "--max-new", "3"], "--max-new 3"),  # no abbreviation stands for a flag
])
def test_a_renamed_or_abbreviated_flag_is_refused(argv, old, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: selfattn {argv[0]}") and err.rstrip().endswith(f"unrecognized arguments: {old}")


# --- --dtype takes effect --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A random byte-level GPT saved as a run folder, and a text file."""
    root = tmp_path_factory.mktemp("dtype")
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16)
    byte_run(root / "run", cfg)
    (root / "text.txt").write_text("the cat sat on the mat; the cat sat on the mat. " * 4, encoding="utf-8")
    return root


def _spy(monkeypatch, module, name: str, seen: list) -> None:
    """Wrap ``module.name`` to note the dtype of the model it is called with (its first module argument)."""
    real = getattr(module, name)

    def spy(*args, **kw):
        model = next(a for a in args if isinstance(a, torch.nn.Module))
        seen.append(next(model.parameters()).dtype)
        return real(*args, **kw)
    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("command", ["sample", "eval", "heads", "explore", "check", "lens", "patch"])
def test_dtype_casts_the_model_each_command_runs(run, command, dtype, monkeypatch, capsys):
    import selfattn.audit.suite
    import selfattn.cli.eval
    import selfattn.cli.explore
    import selfattn.cli.heads
    import selfattn.cli.lens
    import selfattn.cli.patch
    import selfattn.cli.sample

    where = {"sample": (selfattn.cli.sample, "new_tokens"), "eval": (selfattn.cli.eval, "perplexity"),
             "heads": (selfattn.cli.heads, "attention_maps"), "explore": (selfattn.cli.explore, "explore"),
             "check": (selfattn.audit.suite, "model_cases"), "lens": (selfattn.cli.lens, "logit_lens"),
             "patch": (selfattn.cli.patch, "patch")}[command]
    seen = []
    _spy(monkeypatch, *where, seen)
    rest = {"sample": ["--prompt", "the", "--max-new-tokens", "4"], "eval": ["--data", str(run / "text.txt")],
            "heads": ["--out", str(run / "heads")], "explore": ["--out", str(run / "page.html")],
            "check": ["--method", "perturb"], "lens": ["--text", "the cat", "--out", str(run / "lens.png")],
            "patch": ["--clean", "the cat", "--corrupt", "the dog", "--answer", "x",
                      "--out", str(run / "p.png")]}[command]
    argv = [command, "--ckpt", str(run / "run"), "--device", "cpu", *rest] + (["--dtype", dtype] if dtype else [])
    assert main(argv) == 0, capsys.readouterr().err
    assert seen == [getattr(torch, dtype or "float32")], (where[1], seen)  # float32 by default
    out = capsys.readouterr().out
    if command in ("eval", "heads", "explore", "lens", "patch"):
        assert f"on cpu in {dtype or 'float32'}" in out.splitlines()[0]


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_quantize_and_threads_reach_the_model_each_command_runs(run, command, monkeypatch, capsys):
    import selfattn.cli.eval
    import selfattn.cli.sample
    from selfattn.generation.int8 import Int8Linear

    module, name = {"sample": (selfattn.cli.sample, "new_tokens"), "eval": (selfattn.cli.eval, "perplexity")}[command]
    real, seen = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda model, *a, **k: seen.append(
        (sum(isinstance(m, Int8Linear) for m in model.modules()), torch.get_num_threads())) or real(model, *a, **k))
    rest = {"sample": ["--prompt", "the", "--max-new-tokens", "4"], "eval": ["--data", str(run / "text.txt")]}[command]
    threads = torch.get_num_threads()
    try:
        assert main([command, "--ckpt", str(run / "run"), *rest, "--quantize", "int8", "--threads", "1"]) == 0
        assert seen[-1][0] > 0 and seen[-1][1] == 1  # int8 layers, one thread
        if command == "eval":
            assert capsys.readouterr().out.splitlines()[0].endswith("in float32, weights int8")
        torch.set_num_threads(threads)
        assert main([command, "--ckpt", str(run / "run"), *rest]) == 0
        assert seen[-1] == (0, threads)  # the negative control: neither flag, neither change
    finally:
        torch.set_num_threads(threads)
    assert main([command, "--ckpt", str(run / "run"), *rest, "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_check_refuses_a_dtype_without_a_model(capsys):
    assert main(["check", "--dtype", "bfloat16"]) == 2
    assert "--dtype bfloat16 is the dtype of --ckpt's model" in capsys.readouterr().err


def test_dtype_casts_the_model_serve_batches(run, monkeypatch, capsys):
    pytest.importorskip("fastapi")
    import selfattn.serve.engine
    import selfattn.serve.server
    from selfattn.generation.int8 import Int8Linear

    seen = []

    class Engine(selfattn.serve.engine.Engine):
        def __init__(self, model, **kw):
            seen.append(model)
            super().__init__(model, **kw)

    class Server:  # the command's whole path, up to answering requests
        def __init__(self, app):
            self.app = app

        def run(self, sockets):
            pass

    monkeypatch.setattr(selfattn.serve.engine, "Engine", Engine)
    monkeypatch.setattr(selfattn.serve.server, "server", Server)
    assert main(["serve", "--ckpt", str(run / "run"), "--port", "0", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    assert main(["serve", "--ckpt", str(run / "run"), "--port", "0", "--device", "cpu"]) == 0
    assert [m.lm_head.weight.dtype for m in seen] == [torch.bfloat16, torch.float32]  # control: float32 by default
    assert main(["serve", "--ckpt", str(run / "run"), "--port", "0", "--quantize", "int8"]) == 0
    assert isinstance(seen[-1].lm_head, Int8Linear) and not isinstance(seen[0].lm_head, Int8Linear)
