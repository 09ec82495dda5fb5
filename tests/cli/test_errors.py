"""Every command: a mistake a user can fix is one line on stderr and a non-zero exit, never a
traceback, and it comes before the work (nothing half-done, nothing written)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.cli import run as bench
from selfattn.cli import main

ROOT = Path(__file__).resolve().parents[2]  # python -m benchmarks runs from the repository's root

MISSING = "mps" if torch.cuda.is_available() else "cuda"  # an accelerator this machine lacks


@pytest.mark.parametrize("device, words", [("quantum", ["'quantum' is not a torch device"]),
                                           (MISSING, [f"{MISSING!r} is not available on this machine"])])
@pytest.mark.parametrize("command", [["train", "--max-steps", "1"], ["sample", "--ckpt", "nowhere"], ["check"],
                                     ["benchmarks", "attention", "--quick"]])
def test_every_device_flag_refuses_a_device_in_one_line(command, device, words, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")] if command[0] in ("train", "benchmarks") else []
    run, name = ((bench, "python -m benchmarks attention") if command[0] == "benchmarks"
                 else (main, f"selfattn {command[0]}"))
    assert run([*command[command[0] == "benchmarks":], *out, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{name}: error: device ") and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_demo_sizes_are_checked_before_anything_is_allocated(capsys):
    assert main(["demo", "--seq-len", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len 1000000 would need about 32,000.0 GB" in err, err
    assert main(["demo", "--n-head", "0"]) == 2
    assert "n_head must be a positive int, got 0" in capsys.readouterr().err
    assert main(["demo", "--seq-len", "8"]) == 0  # control: a small T runs
    assert "Self-attention from scratch: B=1, T=8" in capsys.readouterr().out


EMPTY_TEXT = "--text is empty: pass a text, or leave --text out for random tokens"


@pytest.mark.parametrize("argv, message, good", [
    (["heads", "--layers", "abc"], "--layers must be comma-separated integers, got 'abc'", "0"),
    (["heads", "--text", ""], EMPTY_TEXT, "a"),
    (["heads", "--top", "0"], "--top must be positive, got 0", "1"),
    (["explore", "--text", ""], EMPTY_TEXT, "a"),
    (["sample", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0", "1"),
    (["sample", "--temperature", "inf"], "--temperature must be a finite number >= 0 (0 = greedy), got inf", "1"),
    (["sample", "--speculative", "self:x"], "--speculative self:x: speculative='self:x': self:N drafts with the "
                                            "model's first N blocks, N a positive int", "self:1"),
])
def test_flag_values_are_refused_before_the_model_is_loaded(argv, message, good, tmp_path, monkeypatch, capsys):
    import selfattn.cli.explore
    import selfattn.cli.heads
    import selfattn.cli.sample

    def loader(path):
        raise AssertionError(f"{path} loaded before the flags were checked")

    for command in (selfattn.cli.explore, selfattn.cli.heads, selfattn.cli.sample):
        monkeypatch.setattr(command, "load", loader)
    out = {"heads": ["--out", str(tmp_path / "out")], "explore": ["--out", str(tmp_path / "page.html")]}
    command = [argv[0], "--ckpt", str(tmp_path / "model"), *out.get(argv[0], [])]
    assert main([*command, *argv[1:]]) == 2
    assert capsys.readouterr().err == f"selfattn {argv[0]}: error: {message}\n"
    with pytest.raises(AssertionError, match="loaded before"):  # control: a good value goes on to load the model
        main([*command, argv[1], good])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, usage", [(["sample", "--ckpt", "x", "--bogus", "1"], "usage: selfattn sample"),
                                         (["benchmarks", "decode", "--quick", "--bogus"],
                                          "usage: python -m benchmarks decode")])
def test_an_unknown_flag_shows_the_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        bench(argv[1:]) if argv[0] == "benchmarks" else main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and err.strip().splitlines()[-1].endswith("error: unrecognized arguments: --bogus" +
                                                                          (" 1" if "1" in argv else ""))


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_bench_checks_its_output_folder_before_the_work(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("a file, not a folder")
    done = subprocess.run([sys.executable, "-m", "benchmarks", "attention", "--quick", "--out", str(target)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""  # nothing was benchmarked
    assert done.stderr == f"python -m benchmarks attention: error: {str(target)!r} is a file, not a folder\n"
    inside = subprocess.run([sys.executable, "-m", "benchmarks", "attention", "--quick", "--out",
                             str(target / "sub")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert inside.returncode == 2
    sub = str(target / "sub")
    assert inside.stderr == (f"python -m benchmarks attention: error: folder {sub!r} cannot be created: "
                             f"{str(target)!r} is a file\n")


# Ctrl-C at the moment torch is being imported, the longest part of starting up: an import hook
# sends the process a real SIGINT there, as the terminal would.
CTRL_C_WHILE_TORCH_LOADS = """
import os, signal, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)

sys.meta_path.insert(0, CtrlC())
{start}
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh process, started as a shell starts a command: Ctrl-C at its default (a
    child inherits an ignored SIGINT, as the suite's workers had it after tests that compile)."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("command", [["train", "--max-steps", "1"], ["check"], ["sample", "--ckpt", "x"]])
def test_ctrl_c_while_starting_up_is_one_line_not_a_traceback(command, tmp_path):
    start = "from selfattn.cli import run\nrun()"  # what the `selfattn` script runs
    done = _python(CTRL_C_WHILE_TORCH_LOADS.format(start=start), *command)
    assert (done.returncode, done.stdout, done.stderr) == (-signal.SIGINT, "", f"selfattn {command[0]}: interrupted\n")
    done = _python(CTRL_C_WHILE_TORCH_LOADS.format(start="import selfattn.model"))  # control: the hook bites
    assert done.returncode == -signal.SIGINT and "Traceback" in done.stderr and "KeyboardInterrupt" in done.stderr


def test_ctrl_c_while_a_command_runs_is_one_line_and_status_130(monkeypatch, capsys):
    import selfattn.cli.demo

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(selfattn.cli.demo, "main", interrupted)
    assert main(["demo"]) == 130
    assert capsys.readouterr().err == "selfattn demo: interrupted\n"


@pytest.mark.slow  # make check leaves it out: fresh interpreters
def test_the_package_loads_torch_only_when_a_public_name_is_used():
    code = ("import sys, selfattn, selfattn.cli; print('torch' in sys.modules); "
            "from selfattn import SelfAttention, attention; import selfattn.model; "
            "print('torch' in sys.modules, callable(selfattn.attention), attention is selfattn.attention)")
    done = _python(code)
    assert done.stdout.split() == ["False", "True", "True", "True"], done.stderr


def test_a_real_ctrl_c_during_start_up_prints_no_traceback(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "selfattn", "train", "--max-steps", "1", "--out",
                             str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # importing torch takes longer than that
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGINT and err == "selfattn train: interrupted\n", (proc.returncode, err)


@pytest.mark.parametrize("command", [["sample", "--ckpt", "nowhere", "--prompt"],
                                     ["heads", "--ckpt", "nowhere", "--text"]])
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_text_flag_that_is_not_utf8_is_one_line_naming_the_flag_and_the_byte(command, tmp_path):
    argv = [*command, b"caf\xe9".decode("utf-8", "surrogateescape")]  # as Python reads an argv byte that is not UTF-8
    done = subprocess.run([sys.executable, "-m", "selfattn", *argv], capture_output=True, text=True, timeout=120,
                          errors="surrogateescape", cwd=tmp_path)
    flag = command[-1]
    assert done.returncode == 2 and done.stderr == (
        f"selfattn {command[0]}: error: {flag} is not valid UTF-8 text: byte 0xe9 at character 3\n"), done.stderr
    good = subprocess.run([sys.executable, "-m", "selfattn", *command, "café"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # control: the same text in UTF-8 goes on (to the missing model)
    assert "UTF-8" not in good.stderr
