"""Every command: a mistake a user can fix is one line on stderr and a non-zero exit, never a
traceback, and it comes before the work (nothing half-done, nothing written)."""
import os
import subprocess
import sys

import pytest
import torch

from selfattn.cli import main

MISSING = "mps" if torch.cuda.is_available() else "cuda"  # an accelerator this machine lacks


@pytest.mark.parametrize("device, words", [("quantum", ["'quantum' is not a torch device"]),
                                           (MISSING, [f"{MISSING!r} is not available on this machine"])])
@pytest.mark.parametrize("command", [["train", "--max-steps", "1"], ["sample", "--ckpt", "nowhere"], ["check"],
                                     ["bench", "attention", "--quick"]])
def test_every_device_flag_refuses_a_device_in_one_line(command, device, words, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")] if command[0] in ("train", "bench") else []
    assert main([*command, *out, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"selfattn {command[0]}: error: device ") and all(
        w in err for w in words), err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_demo_sizes_are_checked_before_anything_is_allocated(capsys):
    assert main(["demo", "--seq-len", "1000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq-len 1000000 would need about 32,000.0 GB" in err, err
    assert main(["demo", "--n-head", "0"]) == 2
    assert "n_head must be a positive int, got 0" in capsys.readouterr().err
    assert main(["demo", "--seq-len", "8"]) == 0  # control: a small T runs
    assert "Self-attention from scratch: B=1, T=8" in capsys.readouterr().out


@pytest.mark.parametrize("argv, usage", [(["sample", "--ckpt", "x", "--bogus", "1"], "usage: selfattn sample"),
                                         (["bench", "decode", "--quick", "--bogus"], "usage: selfattn bench decode")])
def test_an_unknown_flag_shows_the_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and err.strip().splitlines()[-1].endswith("error: unrecognized arguments: --bogus" +
                                                                          (" 1" if "1" in argv else ""))


def test_bench_checks_its_output_folder_before_the_work(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("a file, not a folder")
    done = subprocess.run([sys.executable, "-m", "selfattn", "bench", "attention", "--quick", "--out", str(target)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and done.stdout == ""  # nothing was benchmarked
    assert done.stderr == f"selfattn bench: error: {str(target)!r} is a file, not a folder\n"
    inside = subprocess.run([sys.executable, "-m", "selfattn", "bench", "attention", "--quick", "--out",
                             str(target / "sub")], capture_output=True, text=True, timeout=120)
    assert inside.returncode == 2
    sub = str(target / "sub")
    assert inside.stderr == f"selfattn bench: error: folder {sub!r} cannot be created: {str(target)!r} is a file\n"
